"""The vLLM serve command lines (GPU and CPU build), checked without vLLM.  The real vLLM server
(CPU build) runs in tests/vllm; on a GPU machine, scripts/gpu_check.sh."""
from __future__ import annotations

from app.engines.vllm import WORKER_EXTENSION, VLLMServeConfig, cpu_serve_command, serve_command
from app.engines.vllm.worker import TurnstileWorkerExtension


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


def test_cpu_serve_command_changes_only_what_the_cpu_build_needs():
    config = VLLMServeConfig(model="/models/smollm2", port=8299, extra_args=["--enforce-eager"])
    gpu_argv, gpu_env = serve_command(config)
    argv, env = cpu_serve_command(config, python="/venv/bin/python", kv_cache_gib=2)
    assert argv[:5] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/smollm2"]
    assert "--enable-sleep-mode" in gpu_argv and "--enable-sleep-mode" not in argv
    assert argv[argv.index("--dtype") + 1] == "float32"
    # Everything else is the GPU command line, in the same order.
    rest = [a for a in gpu_argv[3:] if a != "--enable-sleep-mode"]
    rest[rest.index("--dtype") + 1] = "float32"
    assert argv[5:] == rest
    assert env == {**gpu_env, "VLLM_CPU_KVCACHE_SPACE": "2"}
    bf16, _ = cpu_serve_command(VLLMServeConfig(model="m", dtype="bfloat16"), python="p")
    assert bf16[bf16.index("--dtype") + 1] == "bfloat16"   # an explicit dtype is kept
