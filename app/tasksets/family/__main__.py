"""`python -m app.tasksets.family [--check]`: write or check data/tasks/family.jsonl."""
import sys

from app.tasksets.family.generate import main

sys.exit(main())
