#!/usr/bin/env bash
# The main job: start every Procfile process, submit the demo train run, follow it, print the
# summary and export, then stop the processes this script started.
set -euo pipefail
cd "$(dirname "$0")/.."
# -v / --verbose: keep the model libraries' progress bars and warnings in the processes' logs
# (hidden by default: app/engines/quiet.py); the same as TURNSTILE_VERBOSE=1 or `make demo VERBOSE=1`.
for arg in "$@"; do
  case "$arg" in
    -v|--verbose) export TURNSTILE_VERBOSE=1 ;;
    *) echo "usage: scripts/demo.sh [-v|--verbose]" >&2; exit 2 ;;
  esac
done
exec bash scripts/with_stack.sh demo .venv/bin/python -m app demo --config "${TURNSTILE_DEMO_CONFIG:-demo/train.json}"
