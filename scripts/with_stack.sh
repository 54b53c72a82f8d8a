#!/usr/bin/env bash
# Start every Procfile process, wait until the API, gateway and engine answer, run the given
# command, then stop the processes this script started (also on failure or Ctrl-C).
# Usage: scripts/with_stack.sh LOG_NAME COMMAND [ARGS...]   (logs: var/log/LOG_NAME-<time>.log)
set -euo pipefail
cd "$(dirname "$0")/.."
NAME="$1"; shift
mkdir -p var/log
LOG="var/log/$NAME-$(date +%Y%m%d-%H%M%S).log"
# Where the processes will answer, from the same settings they read (a bad setting stops here).
SETTINGS="$(.venv/bin/python -m app.config api_url gateway_url engine_port)"
{ read -r API_URL; read -r GATEWAY_URL; read -r ENGINE_PORT; } <<<"$SETTINGS"

# `-e /dev/null`: honcho must not parse .env itself; every process reads it through app.config.
.venv/bin/honcho start -e /dev/null -f Procfile >"$LOG" 2>&1 &
HONCHO=$!
stop() {
  kill -TERM "$HONCHO" 2>/dev/null || true
  for _ in $(seq 30); do kill -0 "$HONCHO" 2>/dev/null || break; sleep 1; done
  kill -KILL "$HONCHO" 2>/dev/null || true
  echo "processes stopped (logs: $LOG)"
}
trap stop EXIT
echo "processes starting (logs: $LOG)"
.venv/bin/python -m workers.wait --timeout 300 \
  api="$API_URL/api/health" gateway="$GATEWAY_URL/health" engine="http://127.0.0.1:$ENGINE_PORT/health" \
  || { tail -50 "$LOG"; exit 1; }
echo "dashboard: $API_URL/ (sign in with the API token: .venv/bin/python -m app token)"
"$@"
