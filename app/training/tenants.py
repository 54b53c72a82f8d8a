"""LoRA tenants: several train runs sharing one resident base model, one trainer and one optimizer.

A train run with `training.lora` is an adapter on the base model the trainer holds.  The
`TenantPool` wraps one LoRA `Trainer` (peft adapters on the pool's target modules) and keeps,
per run (a *tenant*), everything that makes the run learn as if it were alone:

    adapter      the trainable lora_A / lora_B tensors, by parameter name (fp32)
    optimizer    AdamW's per-parameter state (exp_avg, exp_avg_sq and its own `step` counter,
                 which drives the bias correction: the schedule's clock)
    config       the run's TrainingConfig (learning rate, betas, weight decay, clipping, loss ...)
    marks        the caller's bookkeeping (the step whose state it holds, its policy version)

Only the active tenant's tensors are installed in the model's parameters and the optimizer;
the others stay in host memory.  `activate(run)` parks the active tenant and installs `run`'s
state before its step.  Installing rebinds each parameter's storage (`Parameter.data`) and
the optimizer's state dict entries: on CPU that moves ownership and copies nothing (the host
tensors are the device tensors), on CUDA it is one host-to-device copy per tensor.  The base
weights are frozen and never written, so tenants cannot see each other through them.

A new tenant's adapter is initialised from its own `seed` only (lora_A Kaiming-uniform as peft
does, from a `torch.Generator` seeded with the run's seed, on CPU; lora_B zeros), so two runs
with equal seeds start bit-equal whichever joined the pool first.

Runs share the pool when `PoolShape` agrees: base model, LoRA rank, alpha, target modules and
parameter dtype (run creation refuses a mismatch naming the field: `app.control.tenancy`).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from app.runconfig import TrainingConfig

HOST = torch.device("cpu")
# The parameter dtype of every adapter: the trainer keeps fp32 master weights.
ADAPTER_DTYPE = "float32"


@dataclass(frozen=True)
class PoolShape:
    """What tenants of one pool must share: base model spec, LoRA rank, alpha, targets, dtype."""

    model: str
    lora_r: int
    lora_alpha: int
    lora_target_modules: tuple[str, ...]
    dtype: str = ADAPTER_DTYPE

    @classmethod
    def of(cls, model: str, config: TrainingConfig) -> "PoolShape":
        return cls(model, config.lora_r, config.lora_alpha, tuple(config.lora_target_modules))


@dataclass
class Tenant:
    """One run's state in host memory (see the module docstring)."""

    config: TrainingConfig
    adapter: dict[str, torch.Tensor]
    optimizer: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    marks: dict = field(default_factory=dict)


class TenantPool:
    """Several LoRA runs on one `Trainer` (built with `config.lora`, one process, no FSDP).

    `model` names the base weights (the `PoolShape.model` runs must match).  Raises ValueError
    when `trainer` has no LoRA adapters.
    """

    def __init__(self, trainer, model: str):
        if not trainer.config.lora:
            raise ValueError("a tenant pool needs a LoRA trainer (training.lora: true)")
        self.trainer = trainer
        self.shape = PoolShape.of(model, trainer.config)
        self.device = trainer.device
        self.params: dict[str, torch.nn.Parameter] = {
            name: p for name, p in trainer.model.named_parameters() if p.requires_grad}
        self.tenants: dict[int, Tenant] = {}
        self.active: int | None = None
        self.last_swap_s = 0.0

    def accepts(self, model: str, config: TrainingConfig) -> bool:
        """Whether a run of `config` on base `model` fits this pool."""
        return config.lora and PoolShape.of(model, config) == self.shape

    def activate(self, run_id: int, config: TrainingConfig) -> dict:
        """Make `run_id` the active tenant (a new one starts from its seed); return its marks.

        Parks the active tenant first (its tensors go to host memory).  `config` replaces the
        tenant's stored settings (same run, same values in practice).  Raises ValueError when
        `config` does not fit the pool (`accepts`).
        """
        if self.active == run_id:
            self.tenants[run_id].config = config
            return self.tenants[run_id].marks
        if not config.lora or PoolShape.of(self.shape.model, config) != self.shape:
            raise ValueError(f"run {run_id}: its LoRA shape {PoolShape.of(self.shape.model, config)} "
                             f"does not fit the pool {self.shape}")
        start = time.perf_counter()
        self.park()
        tenant = self.tenants.get(run_id)
        if tenant is None:
            tenant = self.tenants[run_id] = Tenant(config, self._initial_adapter(config.seed))
        tenant.config = config
        self._install(tenant)
        self.active = run_id
        self.last_swap_s = time.perf_counter() - start
        return tenant.marks

    def park(self) -> None:
        """Move the active tenant's adapter and optimizer state to host memory (none active after)."""
        if self.active is None:
            return
        tenant = self.tenants[self.active]
        state = self.trainer.optimizer.state
        tenant.adapter = {name: p.data.to(HOST) for name, p in self.params.items()}
        tenant.optimizer = {name: {k: v.to(HOST) if torch.is_tensor(v) else v for k, v in state[p].items()}
                            for name, p in self.params.items() if p in state}
        self.active = None

    def drop(self, run_id: int) -> None:
        """Forget `run_id`'s state (a failed step's half-updated adapter, an ended run).  Other
        tenants are untouched; the next `activate(run_id)` starts it afresh (or the caller
        loads its checkpoint)."""
        if self.active == run_id:
            self.active = None  # its tensors stay installed until the next tenant replaces them
        self.tenants.pop(run_id, None)

    def mark(self, run_id: int, **marks) -> None:
        """Update `run_id`'s bookkeeping (e.g. the step and policy version its state is after)."""
        self.tenants[run_id].marks.update(marks)

    def _install(self, tenant: Tenant) -> None:
        state = self.trainer.optimizer.state
        for name, p in self.params.items():
            p.data = tenant.adapter[name].to(self.device)
            saved = tenant.optimizer.get(name)
            if saved is None:
                state.pop(p, None)
            else:
                # AdamW (not fused / capturable) keeps its `step` counter on the CPU.
                state[p] = {k: v if k == "step" or not torch.is_tensor(v) else v.to(self.device)
                            for k, v in saved.items()}
        self.trainer.use_config(tenant.config)

    def _initial_adapter(self, seed: int) -> dict[str, torch.Tensor]:
        """Fresh adapters from `seed` alone: lora_A Kaiming-uniform(a=sqrt(5)) as peft's default
        init, lora_B zeros (so the adapted model starts equal to the base), fp32 on the host."""
        generator = torch.Generator(device="cpu").manual_seed(seed)
        out = {}
        for name, p in self.params.items():
            tensor = torch.empty(p.shape, dtype=p.dtype, device=HOST)
            if "lora_A" in name:
                torch.nn.init.kaiming_uniform_(tensor, a=math.sqrt(5), generator=generator)
            else:
                tensor.zero_()
            out[name] = tensor
        return out
