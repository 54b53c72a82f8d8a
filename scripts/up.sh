#!/usr/bin/env bash
# `make up`: start every Procfile process in the foreground, unless a Turnstile stack already
# answers on this machine's configured ports (one clear line instead of a wall of
# address-in-use errors from every process).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! .venv/bin/python -m workers.ports; then
  exit 1
fi
# `-e /dev/null`: honcho must not parse .env itself; every process reads it through app.config.
exec .venv/bin/honcho start -e /dev/null
