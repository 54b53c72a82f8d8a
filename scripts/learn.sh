#!/usr/bin/env bash
# `make learn`: start every Procfile process, evaluate the base policy on the starter held-out
# instances, train on the train instances, evaluate the newest checkpoint, compare (95% bootstrap
# intervals), draw var/runs/<train id>/learning.png, then stop the processes this script started.
# TURNSTILE_LEARN_CONFIG names another config (default demo/learn.json).
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG="${TURNSTILE_LEARN_CONFIG:-demo/learn.json}"
mkdir -p var/log
LOG="var/log/learn-$(date +%Y%m%d-%H%M%S).log"
SETTINGS="$(.venv/bin/python -m app.config api_url gateway_url engine_port)"
{ read -r API_URL; read -r GATEWAY_URL; read -r ENGINE_PORT; } <<<"$SETTINGS"

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
.venv/bin/python -m app learn --config "$CONFIG"
