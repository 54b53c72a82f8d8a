"""The trainer: a resident policy and its AdamW optimizer, kept for the life of a gpu worker.

`Trainer` holds what a step needs between steps: the model (with LoRA adapters when
`TrainingConfig.lora`), its KL reference, the optimizer state, the per-run settings (length
limit, packing, activation checkpointing) and, under several processes, its FSDP2 sharding.
`Trainer.update` runs one training step, `app.training.update.run_update`; this module gives it
the forwards (`forward_logprobs`, `reference_logprobs`, `logprobs`) and the step's activation
checkpointing plan (`plan_checkpointing`).  Checkpoints (`save`/`load`) hold the weights the
engines load and the optimizer state.

Routing replay (`TrainingConfig.routing_replay`, MoE policies): `RouteReplay` hooks stay on
every router of the policy (and of the frozen KL reference) for the trainer's life, and each
forward first sets its micro-batch's recorded routes (`MicroBatch.routes`), so the backward's
activation-checkpointing recompute of a layer replays the same experts.  Every forward that
scores the sampled tokens replays: the policy's (with grad), the old-logprob pass (it is the
PPO ratio's denominator and the trainer-vs-rollout gap, both about the function that sampled),
and the KL reference (the initial policy scored on the same tokens: free routing would make the
KL partly a routing difference, not a weight difference).

Memory per token: no KV cache in training forwards, the LM head only at sampled positions in
chunks (`policy.token_logprobs`), and activation checkpointing of the decoder layers
(`TrainingConfig.activation_checkpointing`, on by default on CUDA).

Several processes (`torchrun`, `app.training.distributed`): the model is sharded with FSDP2;
rank 0 leads (its method calls are broadcast and replayed by the other ranks in `follow`).
"""
from __future__ import annotations

import copy
import gc
import json
import os
from pathlib import Path

import torch

from app.engines.routing import RouteReplay, check_routes, route_shape
from app.runconfig import TrainingConfig
from app.training import distributed, head, memory, packing, policy
from app.training.batching import MicroBatch, StepSequence, make_micro_batches
from app.training.update import run_update

OPTIMIZER_FILE = "optimizer.pt"
ADAPTER_FILE = "adapter.pt"
ENGINE_ADAPTER_DIR = "adapter"  # what engines serve per request (the embedded and the PEFT layout, for vLLM)
MODEL_DIR = "model"


# Attention implementations whose kernels take packed rows without a dense mask (cu_seqlens or
# block-sparse masks derived from position ids).
VARLEN_ATTENTION = ("flash_attention", "flex_attention")


class SequenceTooLongError(ValueError):
    """A training sequence is longer than the trainer accepts (`max_sequence_tokens`)."""


class Trainer:
    """A policy and its AdamW optimizer, resident for the life of a gpu worker process.

    `model` is a `*ForCausalLM` (fp32) already on its device; with `config.lora` it is wrapped
    with peft adapters here.  `vocab_size` bounds valid token ids (defaults to the
    embedding's row count); `pad_id` fills padded positions.  `group` (a
    `distributed.RankGroup`): shard the model with FSDP2 over that group (every rank builds the
    same model); None trains in this process alone.
    Raises ValueError for LoRA under FSDP (not supported).
    """

    def __init__(self, config: TrainingConfig, model, pad_id: int = 0, group: distributed.RankGroup | None = None):
        self.config = config
        self.device = next(model.parameters()).device
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self.pad_id = pad_id
        self.group = group
        self.world = group.world if group is not None else 1
        self.position_limit = getattr(model.config, "max_position_embeddings", None)
        torch.manual_seed(config.seed)
        if config.lora:
            if group is not None:
                raise ValueError("training.lora: LoRA adapters are not trained under FSDP; use one process")
            model = policy.add_lora(model, config.lora_r, config.lora_alpha, config.lora_dropout,
                                    config.lora_target_modules)
        self.model = model
        self.model.train()
        # Score with dropout off, as the engines sample (TrainingConfig refuses lora_dropout > 0;
        # a checkpoint's config may still carry attention dropout).
        policy.disable_dropout(self.model)
        lm_config = policy.causal_lm(model).config
        attention = getattr(lm_config, "_attn_implementation", None) or ""
        if (config.packing is not False and self.device.type == "cuda" and attention == "sdpa"
                and packing.flex_attention_available()):
            # flex attention skips the blocks across packed documents (sdpa would compute them)
            policy.causal_lm(model).set_attn_implementation("flex_attention")
            attention = "flex_attention"
        self.attention = attention
        self.shape = memory.Shape.of(lm_config)
        self.route_shape = route_shape(model)  # (MoE layers, top_k, experts) or None (dense)
        self.replays: list[RouteReplay] = []  # entered while routing replay is on
        self._apply_settings(config)
        self._mask_cache: tuple | None = None
        # The KL reference is the initial policy: the adapters switched off under LoRA,
        # a frozen copy otherwise (memory: one more set of weights).
        self.reference = None
        if config.kl_coef > 0 and not config.lora:
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
        self.forward = policy.TokenLogprobs(self.model)
        self.reference_forward = policy.TokenLogprobs(self.reference) if self.reference is not None else None
        if group is not None:
            distributed.shard(self.forward, policy.causal_lm(self.model).model.layers, group)
            if self.reference_forward is not None:
                distributed.shard(self.reference_forward, self.reference.model.layers, group)
        self._use_replay(config.routing_replay)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=config.learning_rate,
            betas=(config.adam_beta1, config.adam_beta2),
            weight_decay=config.weight_decay,
        )

    def _use_replay(self, enabled: bool) -> None:
        """Enter (or leave) `RouteReplay` on the policy and the frozen reference.
        Raises ValueError naming training.routing_replay for a dense model."""
        if enabled and not self.replays:
            if self.route_shape is None:
                raise ValueError("training.routing_replay: the policy has no mixture-of-experts layers to replay")
            self.replays = [RouteReplay(m).__enter__() for m in (self.model, self.reference) if m is not None]
        elif not enabled and self.replays:
            for replay in self.replays:
                replay.__exit__(None, None, None)
            self.replays = []

    def _set_routes(self, mb: MicroBatch, measure: bool = True) -> None:
        """Force the next forward (and its recompute) to `mb`'s recorded routes under routing replay;
        `measure`: tally where the live router disagrees (the policy's forwards, not the reference's).
        Raises ValueError for a micro-batch without routes."""
        if not self.replays:
            return
        if mb.routes is None:
            raise ValueError("training.routing_replay: a micro-batch has no routes (its chains were recorded without "
                             "routed experts)")
        for replay in self.replays:
            replay.set(mb.routes, mb.route_recorded if measure else None)

    def route_mismatch(self) -> dict | None:
        """Routing replay's tally over the policy's forwards since the last call, then reset: the
        share of recorded (token, layer) pairs whose experts the live router would have chosen
        otherwise, overall and per MoE layer, and the tokens compared (each forward of a token
        counts: the old-logprob pass and the update's forward both, when a step runs both);
        None when replay is off."""
        if not self.replays:
            return None
        replay = self.replays[0]
        differ, compared = replay.mismatch()
        replay.differ, replay.compared = [0] * len(differ), [0] * len(compared)
        return {"route_mismatch_fraction": sum(differ) / sum(compared) if sum(compared) else 0.0,
                "route_mismatch_by_layer": [d / c if c else 0.0 for d, c in zip(differ, compared)],
                "tokens_compared": compared[0] if compared else 0}

    def check_routes(self, sequences: list[StepSequence]) -> None:
        """Under routing replay, refuse (ValueError naming the episode) a trainable sequence whose
        routes are missing, of another shape than the model's `[T, layers, top_k]`, or hold an
        out-of-range or repeated expert id (`app.engines.routing.check_routes`; the last row
        may be -1, unrouted)."""
        if not self.replays:
            return
        for i, seq in enumerate(sequences):
            if seq.trainable == 0:
                continue
            name = f"training.routing_replay: sequence {i} (episode {seq.episode_id}, {len(seq.token_ids)} tokens)"
            routes = seq.routes
            if routes is not None and len(routes) == len(seq.token_ids) and len(routes) and (routes[-1] < 0).all():
                check_routes(routes[:-1], len(seq.token_ids) - 1, self.route_shape, name)
            else:
                check_routes(routes, len(seq.token_ids), self.route_shape, name)

    def _apply_settings(self, config: TrainingConfig) -> None:
        """Take `config`'s per-run settings: the length limit, packing and checkpointing."""
        self.config = config
        limit = config.max_sequence_tokens or self.position_limit
        self.max_sequence_tokens = int(limit) if limit else None
        self.limit_source = "training.max_sequence_tokens" if config.max_sequence_tokens else "the model's max_position_embeddings"
        self.packing = self.attention.startswith(VARLEN_ATTENTION) if config.packing is None else config.packing
        checkpointing = config.activation_checkpointing
        # None: chosen per step by the memory model where memory binds (CUDA, or a budget given).
        self.checkpointing_auto = checkpointing is None and (
            self.device.type == "cuda" or config.activation_memory_gib is not None)
        self.activation_checkpointing = bool(checkpointing)
        self.plan: memory.Plan | None = None
        policy.set_activation_checkpointing(self.model, self.activation_checkpointing)

    def use_config(self, config: TrainingConfig) -> None:
        """Train with another run's settings on the same model (a LoRA tenant, `app.training.tenants`):
        the per-run settings and AdamW's learning rate, betas and weight decay.  The model-shaping
        fields (LoRA rank, alpha, targets) and the seed were fixed when the trainer was built.
        Checkpointing is re-applied only when its settings differ (transformers' checkpointing
        switch walks every module: ~60 ms on SmolLM2, most of a tenant swap)."""
        fields = ("max_sequence_tokens", "packing", "activation_checkpointing", "activation_memory_gib")
        if all(getattr(config, f) == getattr(self.config, f) for f in fields):
            self.config = config  # same per-run settings: limits, packing and the checkpointing plan stay
        else:
            self._apply_settings(config)
        self._use_replay(config.routing_replay)
        for group in self.optimizer.param_groups:
            group.update(lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2),
                         weight_decay=config.weight_decay)

    @classmethod
    def from_spec(cls, config: TrainingConfig, spec: str, device: torch.device | None = None) -> "Trainer":
        """Load the policy `spec` ("tiny" | "smollm2" | checkpoint dir) on `device` (CUDA if present).

        In a process group of several ranks (`distributed.current()`), the model is sharded
        over the group on this rank's device; rank 0 first tells the other ranks (waiting in
        `follow`) to build the same trainer.
        """
        group = distributed.current()
        if group is not None:
            if group.leader:
                group.broadcast_object(("build", (config.to_dict(), spec)))
            device = distributed.device(group)
        device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model, _vocab = policy.load_policy(spec, device)
        return cls(config, model, pad_id=int(model.config.pad_token_id or 0), group=group)

    def _lead(self, method: str, *args) -> None:
        """On rank 0 of a group, have the other ranks (in `follow`) call `method(*args)` too."""
        if self.group is not None and self.group.leader:
            self.group.broadcast_object((method, args))

    def check_lengths(self, sequences: list[StepSequence]) -> None:
        """Raise `SequenceTooLongError` naming the length and the limit when a trainable
        sequence is longer than `max_sequence_tokens` (checked before any model work)."""
        if self.max_sequence_tokens is None:
            return
        too_long = [s for s in sequences if s.trainable > 0 and len(s.token_ids) > self.max_sequence_tokens]
        if too_long:
            worst = max(too_long, key=lambda s: len(s.token_ids))
            raise SequenceTooLongError(
                f"a training sequence of {len(worst.token_ids)} tokens (episode {worst.episode_id}) is longer than "
                f"the limit of {self.max_sequence_tokens} tokens ({self.limit_source}); {len(too_long)} of "
                f"{len(sequences)} sequences exceed it. Raise training.max_sequence_tokens if the device's memory "
                f"allows (activation checkpointing lowers memory per token), or cap the episodes' context")

    # --- logprobs ----------------------------------------------------------------------

    def _mask(self, mb: MicroBatch):
        """The attention mask of `mb`: its padding mask, or for a packed row the document mask
        (`app.training.packing`; flash-attention derives it from the position ids itself)."""
        if mb.segment_lengths is None or self.attention.startswith("flash"):
            return mb.attention_mask
        key = (mb.segment_lengths, mb.input_ids.device)
        if self._mask_cache is None or self._mask_cache[0] != key:
            self._mask_cache = (key, packing.document_mask(mb.segment_lengths, self.attention, mb.input_ids.device))
        return self._mask_cache[1]

    def forward_logprobs(self, mb: MicroBatch, grad: bool, top: bool = False):
        """The sampled tokens' logprobs [N]; with `top` and the teacher's top-k in `mb`, the triple
        (that, the student's logprobs of the teacher's k tokens [N, k], log of its mass outside
        them [N])."""
        extra = mb.teacher_top_ids if top else None
        self._set_routes(mb)
        with torch.set_grad_enabled(grad), policy.autocast(self.device):
            # under the sampling transform each token was drawn with (identity: all None)
            return self.forward(mb.input_ids, self._mask(mb), mb.position_ids, mb.rows, mb.cols, mb.targets,
                                **mb.transform(), **({"extra_targets": extra} if extra is not None else {}))

    def reference_logprobs(self, mb: MicroBatch) -> torch.Tensor | None:
        """The KL reference's logprobs [N] of `mb`'s sampled tokens, no grad (the adapters off under
        LoRA, else the frozen initial copy); None when `kl_coef` is 0."""
        if self.config.kl_coef <= 0:
            return None
        self._set_routes(mb, measure=False)  # the policy forward's micro-batch: its recompute still replays
        with torch.no_grad(), policy.autocast(self.device):
            args = (mb.input_ids, self._mask(mb), mb.position_ids, mb.rows, mb.cols, mb.targets)
            if self.config.lora:
                with self.model.disable_adapter():
                    return self.forward(*args, **mb.transform())
            return self.reference_forward(*args, **mb.transform())

    def logprobs(self, sequences: list[StepSequence]) -> list[torch.Tensor]:
        """Trainer logprobs (float32 [trainable tokens], CPU) of each sequence's sampled tokens, no grad.

        Raises `SequenceTooLongError` as `update` does.  Under FSDP every rank computes all of them.
        """
        self._lead("logprobs", sequences)
        self.check_lengths(sequences)
        self.check_routes(sequences)
        out: list[torch.Tensor] = [torch.empty(0)] * len(sequences)
        for mb in make_micro_batches(sequences, self.config.micro_batch_tokens, "token", self.pad_id, self.packing):
            mb = mb.to(self.device)
            values = self.forward_logprobs(mb, grad=False).float().cpu()
            index = mb.sequence_index.cpu()
            for i in index.unique().tolist():
                out[i] = values[index == i]
        return out

    # --- one step ----------------------------------------------------------------------

    def update(self, sequences: list[StepSequence]) -> dict:
        """Run one GRPO step over `sequences` (`app.training.update.run_update`: its stages and
        metrics); return its metrics.  Raises `SequenceTooLongError` before any forward pass."""
        self._lead("update", sequences)
        return run_update(self, sequences)

    def plan_checkpointing(self, batches: list[MicroBatch]) -> dict:
        """Pick this step's checkpointing from the memory model of its largest micro-batch
        (`app.training.memory`): a fixed `activation_checkpointing` is kept as set; None picks
        none / every k-th layer / full to fit the activation budget.  Returns its metrics."""
        if not batches:
            return {"activation_checkpointing": self.activation_checkpointing}
        largest = max(batches, key=lambda mb: mb.padded_tokens)
        dense = packing.dense_mask_elements(largest, self.attention)
        kwargs = {"act_bytes": 2 if self.device.type == "cuda" else 4, "resid_bytes": 4, "dense_mask": dense,
                  "head_chunk": min(head.chunk_positions(self.shape.vocab), largest.targets.numel())}
        if self.checkpointing_auto:
            plan = memory.plan_checkpointing(self.shape, largest.padded_tokens, self._activation_budget(), **kwargs)
            if self.plan is None or plan.layers != self.plan.layers:
                policy.set_checkpointed_layers(self.model, plan.layers)
        else:
            plan = memory.fixed_plan(self.shape, largest.padded_tokens, self.activation_checkpointing, **kwargs)
        self.plan = plan
        self.activation_checkpointing = bool(plan.layers)
        return {"activation_checkpointing": self.activation_checkpointing, "checkpointing": plan.mode,
                "checkpointed_layers": len(plan.layers),
                "activation_memory_predicted_gib": plan.predicted_bytes / 2**30}

    def _activation_budget(self) -> float:
        """Bytes the largest micro-batch's activations may take: `activation_memory_gib`, or on
        CUDA 85% of the free device memory less the gradients and AdamW state not yet allocated
        (the same on every rank: the smallest)."""
        if self.config.activation_memory_gib is not None:
            budget = float(memory.gib(self.config.activation_memory_gib))
        else:
            free, _total = torch.cuda.mem_get_info(self.device)
            free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            param_bytes = sum(p.numel() * p.element_size() for p in self.params)
            pending = (0 if all(p.grad is not None for p in self.params) else param_bytes) + \
                (0 if self.optimizer.state else 2 * param_bytes)
            budget = 0.85 * free - pending
        if self.group is not None:
            budget = -float(self.group.all_reduce(torch.tensor([-budget]), op="max")[0])
        return budget

    # --- checkpoints -------------------------------------------------------------------

    def save(self, directory: Path, metadata: dict) -> None:
        """Write `directory`: `model/` (full weights, LoRA merged; what engines load),
        `optimizer.pt`, `adapter.pt` and `adapter/` (LoRA only; the latter in the engines'
        per-request adapter format) and `trainer_state.json` (`metadata`).
        The caller makes the directory visible atomically (see `app.training.checkpoints`).
        Under FSDP: `sharded/` (model + optimizer, torch.distributed.checkpoint) instead of
        `optimizer.pt`, and rank 0 writes `model/` from the gathered full weights; every rank
        must see `directory`.
        """
        self._lead("save", directory, metadata)
        directory.mkdir(parents=True, exist_ok=True)
        if self.group is not None:
            distributed.save_sharded(self.forward, self.optimizer, directory)
            state = distributed.full_state_dict(self.forward, self.group, prefix="policy.")
            if self.group.leader:
                distributed.export_safetensors(policy.causal_lm(self.model).config, state, directory / MODEL_DIR,
                                               {"policy_version": metadata.get("policy_version")})
                _write_json(directory / "trainer_state.json", metadata)
            self.group.barrier()
            return
        policy.save_policy_weights(self.model, directory / MODEL_DIR, {"policy_version": metadata.get("policy_version")})
        _save_torch(self.optimizer.state_dict(), directory / OPTIMIZER_FILE)
        if self.config.lora:
            adapters = {k: v for k, v in self.model.state_dict().items() if "lora_" in k}
            _save_torch(adapters, directory / ADAPTER_FILE)
            # The same adapters in the engines' format (per-request LoRA: app.engines.embedded.adapters).
            from app.engines.embedded.adapters import peft_weights, save_adapter

            save_adapter(directory / ENGINE_ADAPTER_DIR, peft_weights(adapters), self.config.lora_r,
                         self.config.lora_alpha, metadata.get("policy_version"))
        _write_json(directory / "trainer_state.json", metadata)

    def load(self, directory: Path) -> dict:
        """Restore weights and optimizer state from a checkpoint `directory`; return its metadata.

        Under FSDP from `sharded/` (raises FileNotFoundError when absent)."""
        self._lead("load", directory)
        if self.group is not None:
            distributed.load_sharded(self.forward, self.optimizer, directory)
            return json.loads((directory / "trainer_state.json").read_text())
        if self.config.lora:
            try:
                adapters = torch.load(directory / ADAPTER_FILE, map_location=self.device)
            except Exception as exc:  # a truncated or overwritten file: name it and the cause
                raise ValueError(f"{directory / ADAPTER_FILE}: the LoRA adapter file cannot be read "
                                 f"({type(exc).__name__}: {exc})") from exc
            if not isinstance(adapters, dict):
                raise ValueError(f"{directory / ADAPTER_FILE}: not an adapter state dict ({type(adapters).__name__})")
            missing = set(adapters) - set(self.model.state_dict())
            if missing:
                raise ValueError(f"{directory}: adapter keys do not fit the model: {sorted(missing)[:3]}")
            self.model.load_state_dict(adapters, strict=False)
        else:
            policy.load_policy_weights(self.model, directory / MODEL_DIR)
        self.optimizer.load_state_dict(torch.load(directory / OPTIMIZER_FILE, map_location=self.device))
        return json.loads((directory / "trainer_state.json").read_text())


def follow(group: distributed.RankGroup) -> None:
    """The loop of ranks other than 0: replay rank 0's trainer calls until it calls `stop`.

    Rank 0 broadcasts `("build", (config dict, spec))` from `Trainer.from_spec` and
    `(method, args)` from `update`, `logprobs`, `save` and `load`; this rank makes the same
    call on its own trainer (built here, the previous one dropped first).  An exception here
    propagates: the process exits and torchrun stops the group.
    """
    trainer = None
    while True:
        op, args = group.broadcast_object()
        if op == "stop":
            return
        if op == "build":
            trainer = None
            gc.collect()
            config, spec = args
            trainer = Trainer.from_spec(TrainingConfig.model_validate(config), spec)
        else:
            getattr(trainer, op)(*args)


def stop_followers(group: distributed.RankGroup | None) -> None:
    """On rank 0: release the other ranks from `follow`."""
    if group is not None and group.leader:
        group.broadcast_object(("stop", ()))


def _save_torch(obj, path: Path) -> None:
    with open(path, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w") as handle:
        json.dump(data, handle, indent=2, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
