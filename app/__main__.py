"""`python -m app …`: the Turnstile command line, the same program as the `turnstile` script (see `turnstile --help`)."""
from app.cli import main

raise SystemExit(main())
