"""One embedded engine process's model, tokenizer and scheduler (`Engine`), and `build_engine`,
which loads them.  The HTTP routes over it are in `app.engines.embedded.server` (admin and
token routes) and `app.engines.embedded.generate` (generation).
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from app.engines.embedded.batching import BatchScheduler
from app.engines.embedded.outputs import TokenTexts
from app.engines.client import weights_label
from app.engines.modeling import load_model, read_metadata

log = logging.getLogger(__name__)
DEFAULT_MAX_MODEL_LEN = 8192
# Serving dtypes (vLLM's ``--dtype`` names).  float32 is the default: the trainer's numerics, in
# which logprob parity between engine and trainer is specified; bfloat16 is an inference engine's
# usual precision, where an MoE's router can pick other experts than the fp32 trainer's.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Engine:
    """Model + tokenizer + scheduler of one engine process."""

    model: Any
    tokenizer: Any
    scheduler: BatchScheduler
    model_spec: str
    served_model_name: str
    engine_id: str
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    dtype: str = "float32"
    tokenizer_lock: Any = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.texts = TokenTexts(self.tokenizer, self.tokenizer_lock)
        self.stop_token_ids = frozenset(
            t for t in {self.tokenizer.eos_token_id, self.tokenizer.convert_tokens_to_ids("<|endoftext|>")}
            if isinstance(t, int) and t >= 0)


def build_engine(model_spec: str, *, max_batch: int = 8, prefill_chunk: int = 512,
                 max_model_len: int = DEFAULT_MAX_MODEL_LEN, served_model_name: str | None = None,
                 engine_id: str | None = None, policy_version: int | None = None,
                 threads: int | None = None, prefix_cache_tokens: int = 16384, update_mode: str = "keep",
                 recompute_kv: bool = True, dtype: str | None = None) -> Engine:
    """Load the model and start the scheduler thread.

    ``policy_version`` defaults to the checkpoint's ``turnstile.json`` value, else 0.
    ``update_mode`` / ``recompute_kv``: what a weight load that names no mode does with running
    requests (``BatchScheduler``).
    ``threads`` (torch intra-op threads) defaults to the ``TURNSTILE_ENGINE_THREADS`` setting (1): on a
    shared box OpenMP's spinning barriers make 2 threads up to 10x slower whenever another
    process holds a core; raise it only where the engine owns its cores.
    ``dtype`` (a ``DTYPES`` name) defaults to the ``TURNSTILE_ENGINE_DTYPE`` setting (float32): the
    parameter dtype the model is loaded and served in; every later weight load (full weights,
    LoRA adapters) is cast into it, and logprobs stay fp32 (log-softmax of the logits upcast to
    fp32, ``app.engines.embedded.sampling``).

    Raises:
        ValueError: ``dtype`` is not a ``DTYPES`` name.
    """
    from app.config import get_settings

    if threads is None:
        threads = get_settings().engine_threads
    dtype = dtype or get_settings().engine_dtype
    if dtype not in DTYPES:
        raise ValueError(f"engine dtype {dtype!r} is not one of {sorted(DTYPES)}")
    torch.set_num_threads(threads)
    started = time.perf_counter()
    model, tokenizer = load_model(model_spec, dtype=DTYPES[dtype])
    log.info("loaded model %s (%s) in %.2fs", model_spec, dtype, time.perf_counter() - started)
    if policy_version is None:
        policy_version = int(read_metadata(model_spec).get("policy_version", 0)) if os.path.isdir(model_spec) else 0
    scheduler = BatchScheduler(model, max_batch=max_batch, prefill_chunk=prefill_chunk,
                               policy_version=policy_version, prefix_cache_tokens=prefix_cache_tokens,
                               weights=weights_label(model_spec), update_mode=update_mode,
                               recompute_kv=recompute_kv).start()
    return Engine(model, tokenizer, scheduler, model_spec,
                  served_model_name or ("SmolLM2-135M-Instruct" if model_spec == "smollm2" else f"turnstile-{os.path.basename(model_spec.rstrip('/'))}"),
                  engine_id or f"embedded-{socket.gethostname()}-{os.getpid()}", max_model_len, dtype)
