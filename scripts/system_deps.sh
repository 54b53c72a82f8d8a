#!/usr/bin/env bash
# Debian/Ubuntu packages Turnstile uses: git, Redis, bubblewrap (episode sandbox), Node.js/npm (harness CLIs),
# Chromium and its driver (the dashboard's browser tests drive the system browser; nothing is downloaded),
# and the rootless image runtime: skopeo (pull/copy images), umoci (unpack them without root or daemon),
# docker-registry (the tests' loopback OCI registry) and mmdebstrap (builds the tests' fixture image).
set -euo pipefail
need=()
command -v git >/dev/null 2>&1 || need+=(git)
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v bwrap >/dev/null 2>&1 || need+=(bubblewrap)
command -v npm >/dev/null 2>&1 || need+=(nodejs npm)
command -v patch >/dev/null 2>&1 || need+=(patch)
command -v skopeo >/dev/null 2>&1 || need+=(skopeo)
command -v umoci >/dev/null 2>&1 || need+=(umoci)
command -v docker-registry >/dev/null 2>&1 || need+=(docker-registry)
command -v mmdebstrap >/dev/null 2>&1 || need+=(mmdebstrap)
[ -x /usr/bin/chromium ] || need+=(chromium)
[ -x /usr/bin/chromedriver ] || need+=(chromium-driver)
python3 -c "import venv, ensurepip" 2>/dev/null || need+=(python3-venv)
if [ ${#need[@]} -eq 0 ]; then echo "system: all packages present"; exit 0; fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "system: please install: ${need[*]}" >&2; exit 1
fi
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
echo "system: installing ${need[*]}"
$SUDO apt-get update -qq
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
