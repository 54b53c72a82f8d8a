"""The vLLM adapter: how Turnstile serves a policy with vLLM and reloads its weights.

* ``app.engines.vllm.serve``: the ``vllm serve`` command line (``serve_command``, its CPU-build
  form ``cpu_serve_command``, ``smollm2_serving_dir``) and ``WORKER_EXTENSION``, the dotted path
  vLLM loads the worker extension by;
* ``app.engines.vllm.reload``: ``VLLMReloader``, the weight reload over vLLM's dev-mode routes;
* ``app.engines.vllm.worker``: ``TurnstileWorkerExtension``, run inside vLLM's workers (imports
  torch, not re-exported here, so callers of the other two stay light).
"""
from __future__ import annotations

from app.engines.vllm.reload import VLLMReloader, VLLMReloadError
from app.engines.vllm.serve import WORKER_EXTENSION, VLLMServeConfig, cpu_serve_command, serve_command, smollm2_serving_dir

__all__ = ["WORKER_EXTENSION", "VLLMReloadError", "VLLMReloader", "VLLMServeConfig", "cpu_serve_command",
           "serve_command", "smollm2_serving_dir"]
