"""Data-parallel training with FSDP2: process group, sharding, reductions, sharded checkpoints.

Under `torchrun` every rank runs one `Trainer` whose model is sharded with PyTorch's FSDP2
(`torch.distributed.fsdp.fully_shard`, per-parameter sharding over a 1-D device mesh; see
https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html): each decoder layer is
one FSDP unit (its parameters are all-gathered just before its forward and backward, and
its gradients reduce-scattered after), the rest (embedding, final norm, LM head, which share
the tied embedding) is the root unit.  Each rank keeps 1/world of the fp32 master weights,
gradients and AdamW state.

Rank 0 is the leader: it runs the gpu worker's Celery task and calls the Trainer's methods
as a single-process trainer would; each call is first broadcast (`broadcast_object`) so the
other ranks, looping in `app.training.trainer.follow`, make the same call with the same
arguments.  FSDP's collectives require that every rank runs the same sequence of forward and
backward passes, which the Trainer guarantees by giving every rank the same number of
micro-batches (see `Trainer.update`).

Checkpoints: the sharded model and optimizer state go through torch.distributed.checkpoint
(`sharded/`, one file per rank plus metadata; resumable at any world size), and rank 0 also
writes the full weights as one safetensors model (`model/`, what the engines load).  Every
rank must see the checkpoint directory (one machine, or a shared filesystem across machines).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

SHARDED_DIR = "sharded"
# How long the ranks > 0 wait for rank 0's next trainer call (an idle gpu worker between steps).
CONTROL_TIMEOUT = timedelta(days=365)


@dataclass
class RankGroup:
    """This process's place in the data-parallel group: `rank` of `world`, on `mesh` (1-D)."""

    rank: int
    world: int
    mesh: object  # torch.distributed.device_mesh.DeviceMesh
    control: object = None  # gloo group of rank 0's call broadcasts (None: the default group)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def broadcast_object(self, obj=None):
        """Rank 0's `obj` on every rank (pickled; the others pass None)."""
        box = [obj if self.leader else None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def all_reduce(self, values: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Element-wise "sum" | "max" of a float64 CPU tensor over the ranks (returned, CPU)."""
        device = _comm_device(self.mesh)
        out = values.to(device=device, dtype=torch.float64).clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return out.cpu()

    def gather_objects(self, obj) -> list:
        """Every rank's `obj` (pickled), in rank order, on every rank."""
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.control)
        return out

    def barrier(self) -> None:
        dist.barrier()


def current() -> RankGroup | None:
    """The data-parallel group this process belongs to, or None when it trains alone.

    A process group of world size > 1 must already be initialised (`init_from_env`).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    global _GROUP
    if _GROUP is None:
        from torch.distributed.device_mesh import init_device_mesh

        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
        # The other ranks wait in `follow` for rank 0's next call for as long as the worker
        # is idle between steps: that wait must not time out like a training collective.
        control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        _GROUP = RankGroup(dist.get_rank(), dist.get_world_size(), mesh, control)
    return _GROUP


_GROUP: RankGroup | None = None


def init_from_env(backend: str | None = None) -> RankGroup | None:
    """Initialise the default process group from torchrun's environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT, LOCAL_RANK) and return `current()`.

    `backend`: "nccl" when CUDA is available, else "gloo" (CPU), unless given.  On CUDA the
    process is bound to GPU LOCAL_RANK.  Without WORLD_SIZE in the environment (not under
    torchrun) nothing is initialised and None is returned.
    """
    if "WORLD_SIZE" not in os.environ:
        return None
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    return current()


def device(group: RankGroup) -> torch.device:
    """The device this rank trains on: its local GPU under nccl, else the CPU."""
    if _comm_device(group.mesh).type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _comm_device(mesh) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")


def shard(root: torch.nn.Module, layers, group: RankGroup) -> torch.nn.Module:
    """Apply FSDP2 to `root`: each module of `layers` its own unit, then `root` (the rest).

    `root` must be the module whose forward the trainer calls (FSDP2 gathers the root unit's
    parameters in the root's forward pre-hook), with the model inside it.  Returns `root`,
    now an `FSDPModule` whose parameters are `DTensor` shards.
    """
    from torch.distributed.fsdp import fully_shard

    for layer in layers:
        fully_shard(layer, mesh=group.mesh)
    fully_shard(root, mesh=group.mesh)
    return root


def grad_norm_value(norm) -> float:
    """A Python float of the total norm `clip_grad_norm_` returned (a DTensor under FSDP2)."""
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def save_sharded(module: torch.nn.Module, optimizer, directory: Path) -> None:
    """Write `module`'s and `optimizer`'s sharded state to `directory/sharded/` (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(module, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(directory / SHARDED_DIR))


def load_sharded(module: torch.nn.Module, optimizer, directory: Path) -> None:
    """Restore `module` and `optimizer` from `directory/sharded/` in place (collective).

    Raises FileNotFoundError when the checkpoint has no sharded state (written by a
    single-process trainer).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not (directory / SHARDED_DIR).is_dir():
        raise FileNotFoundError(f"{directory} has no {SHARDED_DIR}/ state; an FSDP trainer resumes only from "
                                f"checkpoints written by an FSDP trainer")
    model_state, optim_state = get_state_dict(module, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=str(directory / SHARDED_DIR))
    set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def full_state_dict(module: torch.nn.Module, group: RankGroup, prefix: str = "") -> dict[str, torch.Tensor] | None:
    """The full (unsharded) fp32 weights of `module` on rank 0's CPU, keys with `prefix`
    stripped; None on the other ranks (collective: every rank must call it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not group.leader:
        return None
    return {k.removeprefix(prefix): v for k, v in state.items()}


def export_safetensors(config, state: dict[str, torch.Tensor], directory: Path, metadata: dict | None) -> None:
    """Write `state` as one Hugging Face model folder the engines load: `config.json`,
    `model.safetensors` (a tied LM head is left out, as `save_pretrained` does) and
    `turnstile.json` (`metadata`).  `config` is the model's `PretrainedConfig`.
    """
    from safetensors.torch import save_file

    from app.engines import modeling

    directory.mkdir(parents=True, exist_ok=True)
    if getattr(config, "tie_word_embeddings", False):
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / modeling.WEIGHTS_FILE),
              metadata={"format": "pt"})
    config.save_pretrained(directory)
    if metadata is not None:
        (directory / modeling.METADATA_FILE).write_text(json.dumps(metadata, indent=2, sort_keys=True))
