#!/usr/bin/env bash
# Start a local Redis if none answers at REDIS_URL (default localhost:6379); install it if missing.
# REDIS_URL comes from app.config (environment, then .env) once the virtualenv exists.
set -euo pipefail
cd "$(dirname "$0")/.."
url="${REDIS_URL:-redis://localhost:6379/0}"  # until the virtualenv can run app.config
if [ -x .venv/bin/python ]; then
  rc=0; out="$(.venv/bin/python -m app.config redis_url 2>&1)" || rc=$?
  if [ "$rc" -eq 0 ]; then url="$out"; elif [ "$rc" -eq 2 ]; then echo "$out" >&2; exit 2; fi  # 2: invalid setting
fi
hostport="${url#redis://}"; hostport="${hostport%%/*}"; host="${hostport%%:*}"; port="${hostport##*:}"
[ "$port" = "$host" ] && port=6379
if command -v redis-cli >/dev/null 2>&1 && redis-cli -h "$host" -p "$port" ping 2>/dev/null | grep -q PONG; then
  echo "redis: answering at $host:$port"; exit 0
fi
if ! command -v redis-server >/dev/null 2>&1; then
  echo "redis: not installed; installing redis-server with apt-get"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server
fi
mkdir -p var/redis
redis-server --daemonize yes --bind 127.0.0.1 --port "$port" --save "" --appendonly no \
  --dir "$PWD/var/redis" --logfile "$PWD/var/redis/redis.log" --maxmemory-policy noeviction
for _ in $(seq 50); do
  redis-cli -h 127.0.0.1 -p "$port" ping 2>/dev/null | grep -q PONG && { echo "redis: started on :$port"; exit 0; }
  sleep 0.1
done
echo "redis: failed to start (see var/redis/redis.log)" >&2; exit 1
