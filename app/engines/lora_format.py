"""A LoRA adapter folder as both engines serve it, and its served name (no torch: the watchdog,
the gateway and the vLLM adapter read it).

The trainer writes one folder per LoRA run and step (`app.engines.embedded.adapters.save_adapter`):

    adapter.safetensors        the embedded engine's layout (`<module path>.lora_A` [r, in],
                               `.lora_B` [out, r], fp32)
    adapter.json               {"r", "alpha", "policy_version"}
    adapter_model.safetensors  the same tensors in PEFT's layout, which vLLM's LoRA loader reads
    adapter_config.json        (`app.engines.vllm.lora`)

The served name of an adapter version carries the content hash: `<label>@<sha256[:12]>` of
`adapter.safetensors` (`adapter_name`), so a name never stands for two contents.  A step whose
update left the adapter unchanged (every advantage 0) pushes the same name again: the embedded
engine then serves it as that step's policy version (the weights are that version's), and vLLM,
which keeps no versions, accepts the second load (the gateway stamps the step row's version).
Each label (a run) keeps its `KEEP_VERSIONS` newest versions served.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

WEIGHTS = "adapter.safetensors"
META = "adapter.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
HASH_CHARS = 12
KEEP_VERSIONS = 2  # adapter versions of one label (one run) served at once: the newest and the one before
_RUN = re.compile(r"^run-(\d+)@")
NAME = re.compile(r"^(?P<label>[A-Za-z0-9][A-Za-z0-9._-]{0,127})@(?P<hash>[0-9a-f]{%d})$" % HASH_CHARS)


def content_hash(folder: str | Path) -> str:
    """SHA-256 (hex) of `folder`'s adapter.safetensors.

    Raises:
        OSError: the file cannot be read."""
    digest = hashlib.sha256()
    with open(Path(folder) / WEIGHTS, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def adapter_name(label: str, folder: str | Path) -> str:
    """The served name of the adapter in `folder`: `<label>@<first 12 hex of its SHA-256>`."""
    return f"{label}@{content_hash(folder)[:HASH_CHARS]}"


def run_label(run_id: int) -> str:
    """The label of a LoRA train run's adapters: `run-<id>`."""
    return f"run-{int(run_id)}"


def run_of(name: str | None) -> int | None:
    """The run id of an adapter name `run-<id>@…`, else None (the base model, another label)."""
    m = _RUN.match(name or "")
    return int(m.group(1)) if m else None


def label_of(name: str) -> str:
    """The label (`run-<id>`) of a served name `<label>@<hash>`."""
    return name.rsplit("@", 1)[0]
