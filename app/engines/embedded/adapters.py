"""LoRA adapters served per request by the embedded engine (several runs on one base model).

The adapter folder, its files and its served name `<label>@<sha256[:12]>` are
`app.engines.lora_format`'s; the engine recomputes the hash on load and refuses a name whose hash
differs (a corrupted or rewritten file), naming the cause.

Mixed batches: requests naming different adapters (or none) share one decode batch.  A
forward hook on every adaptable projection adds, for each adapter present in the batch, its
low-rank update to that adapter's rows only: y[rows] += alpha/r * (x[rows] A^T) B^T
(punica-style grouping by adapter, in plain torch).  The scheduler says which row uses which
adapter (`rows(...)`) around each forward; outside it (and in other threads: the groups are
thread-local) the hooks add nothing, so the base model is unchanged.

Each label (a run) keeps its `KEEP_VERSIONS` newest versions loaded; loading a third drops the
oldest, so an engine's adapter memory is bounded by runs, not by steps; a request that still
names an evicted version loads it again from its folder (on demand, not a 404).

Routes (`register`, admin): `POST /v1/load_lora_adapter {"lora_name", "lora_path", "policy_version"}`
(vLLM's route and field names) and `POST /v1/unload_lora_adapter {"lora_name"}`; `GET /v1/models`
lists the base model only (its route is unchanged), `GET /v1/lora_adapters` the adapters.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from app.engines.lora_format import (HASH_CHARS, KEEP_VERSIONS, META, NAME, PEFT_CONFIG, PEFT_WEIGHTS, WEIGHTS,
                                     content_hash, label_of)

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_local = threading.local()


class AdapterError(ValueError):
    """An adapter that cannot be loaded or served; `status` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, eq=False)
class Adapter:
    """One loaded adapter version: `weights[path] = (A [r, in], B [out, r])` on the model's device."""

    name: str
    policy_version: int
    scale: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def cache_key(self) -> tuple[str, int]:
        """What prefix-cache entries computed under this adapter are keyed by: (name, version)."""
        return (self.name, self.policy_version)


def save_adapter(folder: str | Path, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], r: int, alpha: int,
                 policy_version: int | None) -> None:
    """Write an adapter folder from `weights[path] = (A, B)` (module paths of the causal LM)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for path, (a, b) in weights.items():
        tensors[f"{path}.lora_A"] = a.detach().to("cpu", torch.float32).contiguous()
        tensors[f"{path}.lora_B"] = b.detach().to("cpu", torch.float32).contiguous()
    save_file(tensors, str(folder / WEIGHTS))
    (folder / META).write_text(json.dumps({"r": r, "alpha": alpha, "policy_version": policy_version}))
    _save_peft(folder, tensors, r, alpha)


def _save_peft(folder: Path, tensors: dict[str, torch.Tensor], r: int, alpha: int) -> None:
    """The adapter in PEFT's saved layout (what `PeftModel.save_pretrained` writes and vLLM's
    `--enable-lora` loader reads: https://docs.vllm.ai/en/latest/features/lora.html): tensors
    `base_model.model.<path>.lora_A.weight` [r, in] / `.lora_B.weight` [out, r] and a LoRA config
    with scale alpha / r, no bias, no dropout (the engines sample without it)."""
    peft = {f"base_model.model.{key}.weight": tensor for key, tensor in tensors.items()}
    targets = sorted({key.rsplit(".", 1)[0].rsplit(".", 1)[-1] for key in tensors})
    save_file(peft, str(folder / PEFT_WEIGHTS))
    (folder / PEFT_CONFIG).write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha, "target_modules": targets,
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "modules_to_save": None}))


def peft_weights(state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """`(A, B)` per module path from a peft LoRA state dict (keys like
    `base_model.model.<path>.lora_A.default.weight`)."""
    out: dict[str, list] = {}
    for key, tensor in state.items():
        m = re.match(r"^(?:base_model\.model\.)?(?P<path>.+)\.lora_(?P<ab>[AB])\.[^.]+\.weight$", key)
        if m:
            out.setdefault(m["path"], [None, None])["AB".index(m["ab"])] = tensor
    return {path: (a, b) for path, (a, b) in out.items() if a is not None and b is not None}


class AdapterSet:
    """The adapters an engine serves, by name, and the hooks that apply them (see the module doc).

    `model`: the engine's causal LM; its projections named in `TARGETS` get a forward hook.
    """

    def __init__(self, model) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.adapters: dict[str, Adapter] = {}
        self.evicted: dict[str, tuple[Path, int]] = {}  # name -> (folder, version): loaded again on demand
        self.folders: dict[str, Path] = {}  # where each served adapter was read from
        self._lock = threading.RLock()  # loads and unloads come from the HTTP threads
        self.paths = {name: module for name, module in model.named_modules()
                      if name.rsplit(".", 1)[-1] in TARGETS and isinstance(module, torch.nn.Linear)}
        for path, module in self.paths.items():
            module.register_forward_hook(_hook(path))

    def __len__(self) -> int:
        return len(self.adapters)

    def load(self, name: str, folder: str | Path, policy_version: int | None = None) -> Adapter:
        """See `_load` (serialised: one load or unload at a time)."""
        with self._lock:
            return self._load(name, folder, policy_version)

    def _load(self, name: str, folder: str | Path, policy_version: int | None = None) -> Adapter:
        """Read the adapter in `folder` and serve it as `name` (`<label>@<hash>`); return it.

        Raises AdapterError: a name without the content hash, a hash that differs from the
        file's (corrupted or rewritten), an unreadable file, a module path or shape that does
        not fit the model, or a name already serving other content.
        """
        m = NAME.match(name or "")
        if m is None:
            raise AdapterError(f"lora_name {name!r}: an adapter name is <label>@<first {HASH_CHARS} hex digits of the "
                               f"SHA-256 of {WEIGHTS}>")
        folder = Path(folder)
        if not (folder / WEIGHTS).is_file():
            raise AdapterError(f"lora_path {str(folder)!r}: no {WEIGHTS} there")
        digest = content_hash(folder)[:HASH_CHARS]
        if digest != m["hash"]:
            raise AdapterError(f"{folder / WEIGHTS}: content hash {digest} differs from the name's {m['hash']}: "
                               "the file is corrupted or was rewritten; refused")
        held = self.adapters.get(name)
        if held is not None:  # same name, same content: already served
            # A step whose update left the adapter bit-identical (every advantage 0) pushes it
            # again under the step's version: those weights are that version's, so requests from
            # now on are stamped with it.  Kept at the first version, every later rollout of the
            # run would look stale to the scheduler and be dropped, and the run would stall.
            if policy_version is not None and int(policy_version) > held.policy_version:
                held = dataclasses.replace(held, policy_version=int(policy_version))
                self.adapters[name] = held
            return held
        try:
            tensors = load_file(str(folder / WEIGHTS))
            meta = json.loads((folder / META).read_text())
        except Exception as exc:  # safetensors raises its own error type on a bad header
            raise AdapterError(f"{folder}: the adapter cannot be read ({type(exc).__name__}: {exc})") from exc
        weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        r = int(meta["r"])
        for key in tensors:
            path, _, part = key.rpartition(".")
            if part not in ("lora_A", "lora_B") or path in weights:
                continue
            module = self.paths.get(path)
            a, b = tensors.get(f"{path}.lora_A"), tensors.get(f"{path}.lora_B")
            if module is None or a is None or b is None:
                raise AdapterError(f"{folder / WEIGHTS}: {path!r} is not an adaptable projection of the served model "
                                   "or lacks lora_A / lora_B")
            if a.shape != (r, module.in_features) or b.shape != (module.out_features, r):
                raise AdapterError(f"{folder / WEIGHTS}: {path} has A {tuple(a.shape)}, B {tuple(b.shape)}; the model "
                                   f"needs [{r}, {module.in_features}] and [{module.out_features}, {r}]")
            dtype = module.weight.dtype  # the served dtype: an fp32 adapter is cast into a bf16 engine
            weights[path] = (a.to(self.device, dtype), b.to(self.device, dtype))
        version = policy_version if policy_version is not None else int(meta.get("policy_version") or 0)
        adapter = Adapter(name, int(version), float(meta["alpha"]) / r, weights)
        self.adapters[name] = adapter
        # Older versions of the same label beyond KEEP_VERSIONS are dropped (requests holding one
        # finish with it); the previous version stays for sessions that have not seen the new name.
        same = [n for n in self.adapters if label_of(n) == m["label"]]
        for old in same[:-KEEP_VERSIONS]:
            dropped = self.adapters.pop(old)
            self.evicted[old] = (self.folders.pop(old), dropped.policy_version)
        self.folders[name] = folder
        self.evicted.pop(name, None)
        return adapter

    def unload(self, name: str) -> bool:
        """Stop serving `name` (requests already holding it finish with it; it is not loaded again
        on demand); whether it was served."""
        with self._lock:
            self.folders.pop(name, None)
            self.evicted.pop(name, None)
            return self.adapters.pop(name, None) is not None

    def resolve(self, model: str | None) -> Adapter | None:
        """The adapter a request's `model` names; None for any other name (the base model).  An
        adapter evicted for newer versions is loaded again from its folder (not a 404).
        Raises AdapterError: 404 for a name in adapter form never loaded (or unloaded), or what
        `load` raises when an evicted adapter's folder is gone or changed."""
        if model and NAME.match(model):
            adapter = self.adapters.get(model)
            if adapter is None and model in self.evicted:
                folder, version = self.evicted[model]  # evicted for a newer version: load it again
                adapter = self.load(model, folder, version)
            if adapter is None:
                raise AdapterError(f"The model `{model}` does not exist: no adapter of that name is loaded", 404)
            return adapter
        return None


@contextlib.contextmanager
def rows(adapters: list[Adapter | None], device: torch.device):
    """Within: batch row i of each forward uses `adapters[i]` (None: the base model)."""
    groups: dict[int, tuple[Adapter, list[int]]] = {}
    for i, adapter in enumerate(adapters):
        if adapter is not None:
            groups.setdefault(id(adapter), (adapter, []))[1].append(i)
    everyone = len(adapters)
    _local.groups = [(adapter, None if len(index) == everyone else torch.tensor(index, device=device))
                     for adapter, index in groups.values()]
    try:
        yield
    finally:
        _local.groups = None


def _hook(path: str):
    def add_lora(_module, inputs, output):
        groups = getattr(_local, "groups", None)
        if not groups:
            return None
        x = inputs[0]
        for adapter, index in groups:
            ab = adapter.weights.get(path)
            if ab is None:
                continue
            a, b = ab
            if index is None:
                output = output + adapter.scale * ((x @ a.T) @ b.T)
            else:
                output = output.index_add(0, index, adapter.scale * ((x.index_select(0, index) @ a.T) @ b.T))
        return output
    return add_lora


def request_adapter(engine, body: dict) -> Adapter | None:
    """The adapter a generation request's `model` names (None: the base model); an unknown
    adapter name is a 404 in vLLM's error body (`EngineError`)."""
    from app.engines.embedded.validation import EngineError, get_field

    try:
        return engine.scheduler.adapters.resolve(get_field(body, "model", str))
    except AdapterError as exc:
        raise EngineError(str(exc), status=exc.status, param="model") from exc


def register(app, engine, require_admin: Callable[[], None]) -> None:
    """Add the adapter routes (see the module docstring) to the engine's Flask app."""
    from flask import jsonify

    from app.engines.embedded.validation import EngineError, get_field, json_body

    adapters: AdapterSet = engine.scheduler.adapters

    @app.post("/v1/load_lora_adapter")
    def load_lora_adapter():
        require_admin()
        body = json_body()
        started = time.perf_counter()
        try:
            adapter = adapters.load(get_field(body, "lora_name", str), get_field(body, "lora_path", str) or "",
                                    get_field(body, "policy_version", int))
        except AdapterError as exc:
            raise EngineError(str(exc), status=exc.status, param="lora_path") from exc
        return jsonify({"lora_name": adapter.name, "policy_version": adapter.policy_version,
                        "engine_id": engine.engine_id, "load_s": round(time.perf_counter() - started, 3)})

    @app.post("/v1/unload_lora_adapter")
    def unload_lora_adapter():
        require_admin()
        name = get_field(json_body(), "lora_name", str)
        if not adapters.unload(name or ""):
            raise EngineError(f"no adapter {name!r} is loaded", status=404, param="lora_name")
        return jsonify({"lora_name": name, "engine_id": engine.engine_id})

    @app.get("/v1/lora_adapters")
    def lora_adapters():
        return jsonify({"object": "list", "data": [
            {"id": a.name, "object": "model", "parent": engine.served_model_name, "policy_version": a.policy_version}
            for a in adapters.adapters.values()]})
