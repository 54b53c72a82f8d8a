#!/usr/bin/env bash
# Create .venv and install Turnstile's pinned requirements (CPU torch; no CUDA download).
set -euo pipefail
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip_args=()
# CPU build of torch: a local wheel folder if the machine has one, else PyTorch's CPU index.
if ! ls ${PIP_FIND_LINKS:-/nonexistent}/torch-2.13.0*cpu* >/dev/null 2>&1 && ! ls /opt/wheels/torch-2.13.0*cpu* >/dev/null 2>&1; then
  pip_args+=(--extra-index-url https://download.pytorch.org/whl/cpu)
fi
.venv/bin/pip install -q "${pip_args[@]}" -r requirements-dev.txt
# Packages whose declared dependencies we do not need (see the file for why).
.venv/bin/pip install -q --no-deps -r requirements-model.txt
# tinker-cookbook without its tml-renderers>=0.4.1, which PyPI lacks (requirements-tinker.txt pins the rest).
.venv/bin/pip install -q --no-deps -r requirements-tinker-cookbook.txt
# swebench 4.1.0's spec table, apart from the 5.0.2 that grades (app/tasksets/formats/swebench_specs.py).
.venv/bin/pip install -q --no-deps --target .venv/opt/swebench-4.1.0 -r requirements-swebench-specs.txt
# The project itself, editable and without dependencies: the `turnstile` command (pyproject.toml).
.venv/bin/pip install -q --no-deps --no-build-isolation -e .
echo "python: .venv ready ($(.venv/bin/python --version))"
