#!/usr/bin/env bash
# `make learn`: start every Procfile process, evaluate the base policy on the family held-out
# instances, train on the train instances, evaluate the newest checkpoint, compare (95% bootstrap
# intervals), draw var/runs/<train id>/learning.png, then stop the processes this script started.
# TURNSTILE_LEARN_CONFIG names another config (default demo/learn.json); TURNSTILE_LEARN_SEED=S uses split seed S
# and S as the warm start's and trainer's seed (read by `python -m app learn`).
set -euo pipefail
cd "$(dirname "$0")/.."
exec bash scripts/with_stack.sh learn .venv/bin/python -m app learn --config "${TURNSTILE_LEARN_CONFIG:-demo/learn.json}"
