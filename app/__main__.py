"""`python -m app …`: the Turnstile command line (see `python -m app --help`)."""
from app.cli import main

raise SystemExit(main())
