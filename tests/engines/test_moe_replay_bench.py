"""bench/moe_replay.py --shape runs here on CPU at a tiny layer count (it is meant for a GPU)."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest

from support import ROOT


def _shape_module():
    spec = importlib.util.spec_from_file_location("moe_replay_shape", ROOT / "bench" / "moe_replay_shape.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_qwen3_30b_a3b_shape_and_overrides():
    bench = _shape_module()
    full = bench.build_config("qwen3-30b-a3b", None, None, None)
    assert (full.num_hidden_layers, full.hidden_size, full.moe_intermediate_size) == (48, 2048, 768)
    assert (full.num_experts, full.num_experts_per_tok, full.vocab_size) == (128, 8, 151936)
    assert (full.num_attention_heads, full.num_key_value_heads, full.head_dim) == (32, 4, 128)
    cut = bench.build_config("qwen3-30b-a3b", 2, 16, 1024)
    assert (cut.num_hidden_layers, cut.num_experts, cut.vocab_size, cut.hidden_size) == (2, 16, 1024, 2048)
    with pytest.raises(ValueError, match="below top-k"):
        bench.build_config("qwen3-30b-a3b", 1, 4, None)
    with pytest.raises(ValueError, match="unknown shape"):
        bench.build_config("qwen3-235b", 1, None, None)


def test_cpu_run_prints_both_modes():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "moe_replay.py"), "--shape", "qwen3-30b-a3b",
                           "--layers", "1", "--experts", "16", "--vocab", "1024", "--batch", "2", "--seq", "16",
                           "--steps", "1", "--device", "cpu"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "1 layers, 16 experts top-8, vocab 1024" in out and "batch 2 x seq 16" in out
    assert "routes: 16 B/token" in out   # 2 B x 1 layer x top-8
    rows = dict(re.findall(r"^(off|on)\s+([\d.]+)\s+[\d.]+$", out, re.M))
    assert set(rows) == {"off", "on"} and all(float(ms) > 0 for ms in rows.values())
    assert re.search(r"on/off: step time x[\d.]+, peak memory x[\d.]+", out)
