"""The vLLM worker extension without vLLM: the checkpoint reader it feeds to the model runner, and
which of the runner's load paths it takes.  The real vLLM server (CPU build) runs in tests/vllm."""
from __future__ import annotations

import torch

from app.engines.modeling import build_tiny_model, save_weights
from app.engines.vllm.worker import TurnstileWorkerExtension, iter_checkpoint


def test_checkpoint_iterator_yields_every_saved_tensor(tmp_path):
    model = build_tiny_model(3)
    save_weights(model, tmp_path / "ckpt")
    tensors = dict(iter_checkpoint(str(tmp_path / "ckpt")))
    state = model.state_dict()
    assert set(tensors) == set(state) - {"lm_head.weight"}  # tied head is not stored
    assert all(torch.equal(tensors[k], state[k]) for k in tensors)


class _Runner:
    """A model runner stand-in: records what the extension fed it."""

    def __init__(self, with_reload: bool) -> None:
        self.got: list[str] = []
        if with_reload:
            self.reload_weights = lambda weights_iterator, is_checkpoint_format: self.got.extend(
                name for name, _ in weights_iterator)
        self.model = torch.nn.Linear(2, 2)
        self.model.load_weights = lambda it: [self.got.append(n) for n, _ in it]


def test_worker_extension_prefers_the_runners_in_place_reload(tmp_path):
    save_weights(build_tiny_model(3), tmp_path / "ckpt")
    names = {name for name, _ in iter_checkpoint(str(tmp_path / "ckpt"))}
    for with_reload, via in ((True, "model_runner.reload_weights"), (False, "model.load_weights")):
        ext = TurnstileWorkerExtension()
        ext.model_runner = _Runner(with_reload)
        receipt = ext.turnstile_load_weights(str(tmp_path / "ckpt"))
        # No layer here has a CPU GEMM kernel to rebuild (the CPU build's are checked in tests/vllm).
        assert receipt == {"directory": str(tmp_path / "ckpt"), "loaded": len(names), "via": via, "repacked": 0}
        assert set(ext.model_runner.got) == names
