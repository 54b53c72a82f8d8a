#!/usr/bin/env bash
# The main job: start every Procfile process, submit the demo train run, follow it, print the
# summary and export, then stop the processes this script started.
set -euo pipefail
cd "$(dirname "$0")/.."
exec bash scripts/with_stack.sh demo .venv/bin/python -m app demo --config "${TURNSTILE_DEMO_CONFIG:-demo/train.json}"
