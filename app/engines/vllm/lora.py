"""vLLM adapter, LoRA: run adapters served per request by a running ``vllm serve`` (several train
runs on one base model, as the embedded engine does with ``app.engines.embedded.adapters``).

The server runs with ``--enable-lora --max-loras N --max-lora-rank R --max-cpu-loras M`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (``serve_command`` with ``enable_lora``), which add the
runtime routes ``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` and
``POST /v1/unload_lora_adapter {"lora_name"}``; a loaded adapter is then a model name of its own
in ``GET /v1/models`` (its ``parent`` is the base model) and in a request's ``model`` field
(https://docs.vllm.ai/en/latest/features/lora.html#dynamically-serving-lora-adapters).

* **Format.** vLLM reads PEFT's layout, which the trainer's adapter folder carries beside the
  embedded engine's files (``save_adapter``: ``adapter_config.json``, ``adapter_model.safetensors``).
* **Names.** ``run-<id>@<sha256[:12]>`` of the adapter file, so one name never stands for two
  contents: a new version is a new name, vLLM gives it a new LoRA int id, and its prefix cache,
  which keys blocks by that id (the LoRA name and id are part of each block hash), never hands
  blocks computed under one adapter or version to another.  Loading a name again is a no-op.
* **Eviction.** ``--max-loras`` bounds the adapters in one batch and ``--max-cpu-loras`` those
  kept in host memory; beyond them vLLM reads an adapter again from its ``lora_path`` on its own.
  A name is unknown (a 404 "model does not exist") only after a restart or an unload: the
  gateway then loads it again on demand (``app.proxy.upstream``).
* **Versions.** Each run keeps its ``KEEP_VERSIONS`` newest names registered (the embedded engine's
  rule); ``load_adapter`` unloads the older ones of the same run, so a server's registry is
  bounded by runs, not by steps.
"""
from __future__ import annotations

from pathlib import Path

from app.engines.client import EngineClient, EngineHTTPError
from app.engines.lora_format import KEEP_VERSIONS, PEFT_CONFIG, PEFT_WEIGHTS, label_of


class VLLMAdapterError(RuntimeError):
    """vLLM refused to load or unload an adapter; the message holds its answer."""


def served_adapters(client: EngineClient) -> list[str]:
    """The adapter names the server serves, in the order it registered them (``GET /v1/models``
    entries whose ``parent`` is set; the base model's has none)."""
    return [m["id"] for m in client.models(timeout=10.0) if m.get("parent") and isinstance(m.get("id"), str)]


def load_adapter(client: EngineClient, name: str, folder: str | Path, *, keep: int = KEEP_VERSIONS) -> list[str]:
    """Serve the adapter in ``folder`` (PEFT layout) as ``name`` (``<label>@<hash>``), then unload
    the same label's older names beyond the newest ``keep``; return the names unloaded.

    Raises:
        VLLMAdapterError: the folder lacks the PEFT files, or vLLM refused the adapter (a rank
            above ``--max-lora-rank``, an unreadable file, a server without ``--enable-lora``).
        app.engines.client.EngineConnectionError: the server cannot be reached.
    """
    folder = Path(folder)
    missing = [f for f in (PEFT_CONFIG, PEFT_WEIGHTS) if not (folder / f).is_file()]
    if missing:
        raise VLLMAdapterError(f"{folder}: no {' or '.join(missing)} (the PEFT layout vLLM reads)")
    try:
        client.load_lora_adapter(name, str(folder))  # a name already served is this very adapter
    except EngineHTTPError as exc:
        raise VLLMAdapterError(f"vLLM did not load {name} from {folder}: HTTP {exc.status}: "
                               f"{exc.message[:500]}") from exc
    same = [n for n in served_adapters(client) if label_of(n) == label_of(name) and n != name]
    dropped = same[:max(0, len(same) - (keep - 1))]
    for old in dropped:
        unload_adapter(client, old)
    return dropped


def unload_adapter(client: EngineClient, name: str) -> bool:
    """Stop serving ``name``; whether it was served (an unknown name is not an error).

    Raises:
        VLLMAdapterError: vLLM failed otherwise.
    """
    try:
        client.request("POST", "/v1/unload_lora_adapter", {"lora_name": name})
    except EngineHTTPError as exc:
        if exc.status == 404:  # "The lora adapter '…' cannot be found."
            return False
        raise VLLMAdapterError(f"vLLM did not unload {name}: HTTP {exc.status}: {exc.message[:500]}") from exc
    return True
