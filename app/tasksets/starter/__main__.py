"""`python -m app.tasksets.starter [--check | --ids SPLIT]`: write or check data/tasks/starter.jsonl."""
import sys

from app.tasksets.starter.generate import main

sys.exit(main())
