#!/usr/bin/env bash
# The main job: start every Procfile process, submit the demo train run, follow it, print the
# summary and export, then stop the processes this script started.
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG="${TURNSTILE_DEMO_CONFIG:-demo/train.json}"
mkdir -p var/log
LOG="var/log/demo-$(date +%Y%m%d-%H%M%S).log"
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
.venv/bin/python -m app.cli.wait --timeout 300 \
  api="$API_URL/api/health" gateway="$GATEWAY_URL/health" engine="http://127.0.0.1:$ENGINE_PORT/health" \
  || { tail -50 "$LOG"; exit 1; }
echo "dashboard: $API_URL/ (sign in with the API token: .venv/bin/python -m app token)"
.venv/bin/python -m app demo --config "$CONFIG"
