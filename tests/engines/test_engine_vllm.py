"""vLLM adapter pieces that run without a GPU: the serve command line and the checkpoint reader
the vLLM worker extension feeds to ``model.load_weights``.  vLLM itself runs only in
scripts/gpu_check.sh on a GPU machine (there is no GPU here)."""
from __future__ import annotations

import torch

from app.engines.modeling import build_tiny_model, save_weights
from app.engines.vllm import WORKER_EXTENSION, VLLMServeConfig, serve_command
from app.engines.vllm_worker import TurnstileWorkerExtension, iter_checkpoint


def test_serve_command_has_tool_parser_dev_mode_and_reload_extension():
    argv, env = serve_command(VLLMServeConfig(model="/models/qwen", reasoning_parser="qwen3", enable_lora=True))
    joined = " ".join(argv)
    assert argv[:3] == ["vllm", "serve", "/models/qwen"]
    assert "--enable-auto-tool-choice --tool-call-parser hermes" in joined
    assert "--reasoning-parser qwen3" in joined and "--enable-sleep-mode" in argv and "--enable-lora" in argv
    assert argv[argv.index("--worker-extension-cls") + 1] == WORKER_EXTENSION
    assert env == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    module, _, name = WORKER_EXTENSION.rpartition(".")
    assert module == TurnstileWorkerExtension.__module__ and name == TurnstileWorkerExtension.__name__


def test_checkpoint_iterator_yields_every_saved_tensor(tmp_path):
    model = build_tiny_model(3)
    save_weights(model, tmp_path / "ckpt")
    tensors = dict(iter_checkpoint(str(tmp_path / "ckpt")))
    state = model.state_dict()
    assert set(tensors) == set(state) - {"lm_head.weight"}  # tied head is not stored
    assert all(torch.equal(tensors[k], state[k]) for k in tensors)
