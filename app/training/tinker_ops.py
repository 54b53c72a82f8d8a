"""The Tinker SDK's training ops on a LoRA tenant of the trainer (pure compute: no Celery, no SQL).

A Tinker model is one tenant of a `TenantPool` (app.training.tenants) built from its run's
config (base model, LoRA rank, targets, seed).  Inputs are the SDK requests' JSON
(`<pydantic type>.model_dump(mode="json")`); outputs are the SDK response types' JSON:

    forward            ForwardBackwardInput -> ForwardBackwardOutput (no grad)
    forward_backward   ForwardBackwardInput -> ForwardBackwardOutput; the loss's gradients are
                       ADDED to the tenant's accumulator (`TinkerState.grads`) until optim_step
    optim_step         OptimStepRequest (AdamParams) -> OptimStepResponse: AdamW with the call's
                       learning rate, betas, eps, decoupled weight decay and global-norm clipping,
                       on the accumulated gradients (zeros when none), which it then clears
    save_state         adapter + AdamW moments and step counters + optim step count -> one file
    load_state         that file back (bit-equal on CPU); weights only when `optimizer` is False
                       (then AdamW starts over: no moments, step count 0)

ForwardBackwardOutput per datum: `logprobs` (float32 [N], the trainer's log p(target_tokens[t] |
tokens[:t+1]), t = 0..N-1 for a datum of N input tokens) and `elementwise_loss` (float32 [N]);
metrics: `loss:sum` (the sum over all tokens, app.training.tinker_losses).

Gradients live outside the parameters between calls (`TinkerState.grads`, on the trainer's
device): another tenant, or a GRPO step on the same trainer, may run between two forward_backward
calls and must neither see nor clear them.  They are lost with the process; the caller
(app.tasks.tinker) rebuilds them by replaying the forward_backward requests since the state it
last persisted with `save_state` (and reloads with `load_state`).
"""
from __future__ import annotations

import gc
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from app.runconfig import TrainingConfig
from app.training import policy, tinker_losses
from app.training.tenants import TenantPool
from app.training.tinker_losses import LossInputError

STATE_FORMAT = "turnstile-tinker-state-1"


@dataclass
class TinkerState:
    """A Tinker tenant's bookkeeping, kept in its `Tenant.marks["tinker"]`."""

    grads: dict[str, torch.Tensor] | None = None  # accumulated since the last optim_step, by parameter name
    optim_steps: int = 0                           # optim_steps applied to the adapter
    applied_through: int = 0                       # id of the last future whose effect is persisted
    grad_futures: list[int] = field(default_factory=list)  # the caller's ids of the requests in `grads`


@dataclass
class _Resident:
    pool: TenantPool | None = None


_RESIDENT = _Resident()


def reset_resident() -> None:
    """Forget the resident trainer and all tenants (what a fresh worker process starts with)."""
    _RESIDENT.pool = None
    gc.collect()


def tenant(run_id: int, spec: str, config: TrainingConfig) -> tuple[TenantPool, TinkerState, bool]:
    """(pool, state, fresh): run `run_id`'s tenant made active on the resident pool, the pool built
    first when none holds base model `spec` with `config`'s LoRA shape.  `fresh`: the tenant was
    not resident and starts from its seed (the caller restores its persisted state)."""
    from app.training.threads import apply_cpu_threads
    from app.training.trainer import Trainer

    pool = _RESIDENT.pool
    if pool is None or not pool.accepts(spec, config):
        reset_resident()
        apply_cpu_threads()
        pool = _RESIDENT.pool = TenantPool(Trainer.from_spec(config, spec), spec)
    fresh = run_id not in pool.tenants
    marks = pool.activate(run_id, config)
    state = marks.setdefault("tinker", TinkerState())
    return pool, state, fresh


def drop(run_id: int) -> None:
    """Forget run `run_id`'s resident tenant (after an error mid-op); the next op restores it."""
    if _RESIDENT.pool is not None:
        _RESIDENT.pool.drop(run_id)


# --- forward / forward_backward ------------------------------------------------------------

@dataclass
class _Datum:
    tokens: torch.Tensor              # int64 [N]
    inputs: dict[str, torch.Tensor]   # loss_fn_inputs, flattened to [N] (float32 or int64)


def parse(payload: dict[str, Any], vocab_size: int) -> tuple[str, dict, list[_Datum]]:
    """(loss_fn, loss config, data) of a ForwardBackwardInput JSON.  Raises `LossInputError` for
    an unsupported loss, a non-text chunk, inputs that do not fit the loss, or a token id
    outside [0, vocab_size)."""
    from pydantic import ValidationError
    from tinker.types._pydantic_types.forward_backward_input import ForwardBackwardInput

    try:
        request = ForwardBackwardInput.model_validate(payload)
    except ValidationError as exc:
        raise LossInputError(f"not a ForwardBackwardInput: {exc.errors()[0].get('msg')}") from None
    loss_fn = request.loss_fn
    config = tinker_losses.check(loss_fn, request.loss_fn_config)
    if not request.data:
        raise LossInputError("forward_backward: no data")
    data = []
    for i, datum in enumerate(request.data):
        where = f"data[{i}]"
        try:
            tokens = torch.tensor(datum.model_input.to_ints(), dtype=torch.int64)
        except (ValueError, TypeError, AttributeError) as exc:
            raise LossInputError(f"{where}: model_input must be encoded_text chunks only ({exc})") from None
        if tokens.numel() == 0:
            raise LossInputError(f"{where}: model_input has no tokens")
        inputs = {name: value.to_torch().reshape(-1) for name, value in datum.loss_fn_inputs.items()}
        tinker_losses.check_inputs(loss_fn, inputs, tokens.numel(), where)
        for name, ids in (("model_input", tokens), ("target_tokens", inputs["target_tokens"])):
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
                raise LossInputError(f"{where}: {name} holds token ids outside [0, {vocab_size})")
        inputs = {k: v.long() if k == "target_tokens" else v.float() for k, v in inputs.items()}
        data.append(_Datum(tokens, inputs))
    return loss_fn, config, data


def _micro_batches(data: list[_Datum], budget: int) -> list[list[int]]:
    """Datum indices in order, grouped so each group's rows x longest row is at most `budget`
    tokens (a longer datum alone)."""
    groups: list[list[int]] = []
    longest = 0
    for i, datum in enumerate(data):
        n = datum.tokens.numel()
        if groups and max(longest, n) * (len(groups[-1]) + 1) <= budget:
            groups[-1].append(i)
            longest = max(longest, n)
        else:
            groups.append([i])
            longest = n
    return groups


def _logprobs(trainer, data: list[_Datum]) -> list[torch.Tensor]:
    """The trainer's logprobs (float32 [N] each) of every datum's target tokens, right-padded into
    one batch; differentiable when grad is enabled."""
    device = trainer.device
    lengths = [d.tokens.numel() for d in data]
    input_ids = torch.full((len(data), max(lengths)), trainer.pad_id, dtype=torch.int64)
    mask = torch.zeros_like(input_ids)
    for b, d in enumerate(data):
        input_ids[b, : lengths[b]] = d.tokens
        mask[b, : lengths[b]] = 1
    rows = torch.cat([torch.full((n,), b, dtype=torch.int64) for b, n in enumerate(lengths)])
    cols = torch.cat([torch.arange(n, dtype=torch.int64) for n in lengths])
    targets = torch.cat([d.inputs["target_tokens"] for d in data])
    with policy.autocast(device):
        values = trainer.forward(input_ids.to(device), mask.to(device), None, rows.to(device), cols.to(device),
                                 targets.to(device))
    return list(values.float().split(lengths))


def _tensor_json(t: torch.Tensor) -> dict[str, Any]:
    return {"data": t.detach().float().cpu().tolist(), "dtype": "float32", "shape": [int(t.numel())]}


def forward_backward(pool: TenantPool, state: TinkerState, payload: dict[str, Any], backward: bool = True) -> dict:
    """forward (`backward=False`) or forward_backward of the active tenant on a ForwardBackwardInput
    JSON; returns ForwardBackwardOutput JSON (module docstring).  With `backward`, adds the
    gradient of `loss:sum` to `state.grads` (nothing is added when it raises).
    Raises `LossInputError` for a request that does not fit (`parse`)."""
    trainer = pool.trainer
    loss_fn, config, data = parse(payload, trainer.vocab_size)
    params = pool.params
    for p in params.values():
        p.grad = None
    outputs: list[dict[str, Any]] = [{} for _ in data]
    total = 0.0
    for group in _micro_batches(data, trainer.config.micro_batch_tokens):
        batch = [data[i] for i in group]
        with torch.set_grad_enabled(backward):
            logprobs = _logprobs(trainer, batch)
            losses = [tinker_losses.elementwise(loss_fn, lp, {k: v.to(lp.device) for k, v in d.inputs.items()}, config)
                      for lp, d in zip(logprobs, batch)]
            loss = torch.stack([x.sum() for x in losses]).sum()
        if backward:
            loss.backward()
        total += float(loss.detach())
        for i, lp, el in zip(group, logprobs, losses):
            outputs[i] = {"logprobs": _tensor_json(lp), "elementwise_loss": _tensor_json(el)}
    if backward:
        grads = state.grads or {}
        for name, p in params.items():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            grads[name] = grads[name] + g if name in grads else g.detach().clone()
            p.grad = None
        state.grads = grads
    return {"loss_fn_output_type": "ArrayRecord", "loss_fn_outputs": outputs, "metrics": {"loss:sum": total}}


# --- optim_step ----------------------------------------------------------------------------

def adam_params(payload: dict[str, Any]) -> dict[str, float]:
    """The AdamParams of an OptimStepRequest JSON (its `adam_params`, or `optim_params` of type
    adam), with the SDK's defaults.  Raises `LossInputError` for another optimizer family or an
    out-of-range value."""
    from tinker.types.optimizer import AdamParams

    raw = payload.get("adam_params") or payload.get("optim_params")
    if raw is None:
        raw = {}
    if raw.get("type") not in (None, "adam", "adamw"):
        raise LossInputError(f"optimizer {raw.get('type')!r} is not supported here: AdamParams only")
    fields = set(AdamParams.model_fields)
    params = AdamParams.model_validate({k: v for k, v in raw.items() if k in fields}).model_dump()
    checks = {"learning_rate": params["learning_rate"] >= 0, "beta1": 0 <= params["beta1"] < 1,
              "beta2": 0 <= params["beta2"] < 1, "eps": params["eps"] > 0, "weight_decay": params["weight_decay"] >= 0,
              "grad_clip_norm": params["grad_clip_norm"] >= 0}
    bad = [name for name, ok in checks.items() if not ok or not math.isfinite(params[name])]
    if bad:
        raise LossInputError(f"AdamParams out of range: {', '.join(f'{k}={params[k]}' for k in bad)} "
                             "(learning_rate, eps, weight_decay, grad_clip_norm >= 0 (eps > 0); 0 <= beta < 1)")
    return params


def optim_step(pool: TenantPool, state: TinkerState, payload: dict[str, Any]) -> dict:
    """One AdamW step of the active tenant on its accumulated gradients (module docstring); returns
    OptimStepResponse JSON {"metrics": {"grad_norm" (before clipping), "optim_step", "learning_rate"}}.
    Raises `LossInputError` for bad AdamParams (nothing applied)."""
    adam = adam_params(payload)
    trainer = pool.trainer
    params = list(pool.params.values())
    for name, p in pool.params.items():
        p.grad = state.grads[name] if state.grads is not None else torch.zeros_like(p)
    norms = torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in params])
    grad_norm = float(torch.linalg.vector_norm(norms))
    if adam["grad_clip_norm"] > 0:
        torch.nn.utils.clip_grad_norm_(params, adam["grad_clip_norm"])
    for group in trainer.optimizer.param_groups:
        group.update(lr=adam["learning_rate"], betas=(adam["beta1"], adam["beta2"]), eps=adam["eps"],
                     weight_decay=adam["weight_decay"])
    trainer.optimizer.step()
    for p in params:
        p.grad = None
    state.grads = None
    state.grad_futures = []
    state.optim_steps += 1
    return {"metrics": {"grad_norm": grad_norm, "optim_step": float(state.optim_steps),
                        "learning_rate": adam["learning_rate"]}}


# --- state files ---------------------------------------------------------------------------

def save_state(pool: TenantPool, state: TinkerState, path: Path, meta: dict | None = None) -> None:
    """Write the active tenant's adapter, AdamW state and optim step count (and `meta`) to `path`
    (torch.save, written to a temporary file, fsynced, then renamed into place: a reader sees the
    old file or the new one, never half of one)."""
    opt_state = pool.trainer.optimizer.state
    blob = {"format": STATE_FORMAT, "optim_steps": state.optim_steps, "meta": dict(meta or {}),
            "adapter": {name: p.data.detach().cpu().clone() for name, p in pool.params.items()},
            "optimizer": {name: {k: v.detach().cpu().clone() if torch.is_tensor(v) else v
                                 for k, v in opt_state[p].items()}
                          for name, p in pool.params.items() if p in opt_state}}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as handle:
        torch.save(blob, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def load_state(pool: TenantPool, state: TinkerState, path: Path, optimizer: bool = True) -> dict:
    """Install the state file `path` (`save_state`) into the active tenant; return its `meta`.
    Clears the accumulated gradients (they were of other weights).  Without `optimizer` the
    weights alone: AdamW's moments dropped and the optim step count 0.
    Raises FileNotFoundError when `path` is missing, ValueError when it is not a state file or
    its adapter does not fit this tenant's LoRA shape."""
    if not path.is_file():
        raise FileNotFoundError(f"no saved state at {path}")
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file: name it and the cause
        raise ValueError(f"{path}: not a readable state file ({type(exc).__name__}: {exc})") from exc
    if not isinstance(blob, dict) or blob.get("format") != STATE_FORMAT:
        raise ValueError(f"{path}: not a Tinker state file of this server")
    adapter = blob["adapter"]
    mismatch = [n for n, p in pool.params.items() if n not in adapter or adapter[n].shape != p.shape]
    if mismatch or set(adapter) - set(pool.params):
        raise ValueError(f"{path}: its adapter does not fit this model's LoRA shape (e.g. {mismatch[:2]}): "
                         "load a state saved by a model of the same base model and LoRA rank")
    opt_state = pool.trainer.optimizer.state
    with torch.no_grad():
        for name, p in pool.params.items():
            p.data.copy_(adapter[name])
            saved = blob["optimizer"].get(name) if optimizer else None
            if saved is None:
                opt_state.pop(p, None)
            else:  # AdamW (not fused / capturable) keeps its `step` counter on the CPU
                opt_state[p] = {k: v.clone() if k == "step" or not torch.is_tensor(v) else v.to(p.device).clone()
                                for k, v in saved.items()}
    state.grads = None
    state.grad_futures = []
    state.optim_steps = int(blob["optim_steps"]) if optimizer else 0
    return dict(blob.get("meta") or {})


def save_engine_adapter(pool: TenantPool, state: TinkerState, folder: Path) -> None:
    """Write the active tenant's adapter into `folder` in the engines' per-request LoRA format
    (`app.engines.embedded.adapters.save_adapter`, as a LoRA train run's checkpoint), its policy
    version the optim step count."""
    from app.engines.embedded.adapters import peft_weights, save_adapter

    config = pool.trainer.config
    adapters = {name: p.data.detach().cpu() for name, p in pool.params.items()}
    save_adapter(folder, peft_weights(adapters), config.lora_r, config.lora_alpha, state.optim_steps)
