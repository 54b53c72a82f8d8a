"""vLLM worker extension: load a Turnstile checkpoint directory into the running model.

Passed to ``vllm serve --worker-extension-cls app.engines.vllm_worker.TurnstileWorkerExtension``;
vLLM mixes the class into every GPU worker, and the dev-mode route
``POST /collective_rpc {"method": "turnstile_load_weights", "args": [DIR]}`` calls the method
on all of them (vllm/entrypoints/serve/dev/rpc/api_router.py).  The same pattern is used by
RL stacks that reload weights from disk (prime-rl's filesystem weight-update worker).

The model's own ``load_weights`` consumes ``(name, tensor)`` pairs with Hugging Face names,
so fused QKV / gate-up layouts and tied embeddings are handled by vLLM; this module imports
nothing from vLLM and can be imported (and unit-tested) without it.
"""
from __future__ import annotations

import glob
import os
from typing import Iterator

import torch


def iter_checkpoint(directory: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of every ``*.safetensors`` file in ``directory``.

    Raises:
        FileNotFoundError: the directory holds no safetensors file.
    """
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {directory}")
    for path in files:
        yield from load_file(path).items()


class TurnstileWorkerExtension:
    """Mixed into vLLM's worker class; ``self.model_runner`` is the worker's model runner."""

    def turnstile_load_weights(self, directory: str) -> dict:
        """Copy the checkpoint's tensors into the served model in place; return a small receipt."""
        model = self.model_runner.model
        loaded = model.load_weights(iter_checkpoint(directory))
        torch.cuda.synchronize()
        return {"directory": directory, "loaded": len(loaded) if loaded is not None else -1}
