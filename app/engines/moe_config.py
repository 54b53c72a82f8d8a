"""Whether a model spec is a mixture-of-experts model, and its route shape, read without torch.

The API process decides at run creation whether routing replay can apply (`app.control.preflight`),
and it imports no torch or transformers: this module answers from the spec alone (the built-in
tiny models) or from the model folder's ``config.json`` (Hugging Face config keys: Qwen3-MoE and
Qwen2-MoE ``num_experts``, Mixtral ``num_local_experts``, DeepSeek-V3 ``n_routed_experts``, each
with ``num_experts_per_tok``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

# name -> (experts, experts per token) of the built-in tiny Qwen3-MoE models (app.engines.modeling)
TINY_MOE_SHAPES = {"tiny-moe": (8, 2), "tiny-moe-wide": (32, 4)}
TINY_MOE_LAYERS = 2  # every decoder layer of the tiny MoE is sparse
DENSE_SPECS = ("tiny", "smollm2")  # the built-in dense models
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


class MoEShape(NamedTuple):
    """A sparse model's route shape: ``layers`` MoE layers, ``top_k`` experts per token of ``experts``."""

    layers: int
    top_k: int
    experts: int


def shape_of_config(config: dict) -> MoEShape | None:
    """The MoE shape a Hugging Face ``config.json`` dict describes, or None for a dense model.

    MoE layers: ``num_hidden_layers`` less ``mlp_only_layers`` and, with ``decoder_sparse_step``
    k > 1, the layers whose index + 1 is not a multiple of k (Qwen3-MoE's rule), less DeepSeek's
    ``first_k_dense_replace`` leading dense layers.
    """
    config = config.get("text_config") or config  # multimodal wrappers keep the LM's config inside
    experts = next((int(config[k]) for k in EXPERT_KEYS if config.get(k)), 0)
    top_k = int(config.get("num_experts_per_tok") or 0)
    if experts <= 0 or top_k <= 0:
        return None
    layers = int(config.get("num_hidden_layers") or 0)
    dense = set(config.get("mlp_only_layers") or [])
    step = int(config.get("decoder_sparse_step") or 1)
    first_dense = int(config.get("first_k_dense_replace") or 0)
    sparse = [i for i in range(layers) if i not in dense and (i + 1) % step == 0 and i >= first_dense]
    return MoEShape(len(sparse), top_k, experts) if sparse else None


def moe_shape(spec: str | Path) -> MoEShape | None:
    """The MoE shape of model ``spec`` (a built-in name or a model folder), None when it is dense.

    Raises:
        LookupError: ``spec`` is neither a built-in model nor a folder holding ``config.json``
            (e.g. a Hugging Face id only an external engine knows).
    """
    name = str(spec)
    if name in TINY_MOE_SHAPES:
        experts, top_k = TINY_MOE_SHAPES[name]
        return MoEShape(TINY_MOE_LAYERS, top_k, experts)
    if name in DENSE_SPECS:
        return None
    path = Path(name) / "config.json"
    if not path.is_file():
        raise LookupError(f"{name}: not a built-in model and no config.json in such a folder")
    try:
        return shape_of_config(json.loads(path.read_text()))
    except (ValueError, TypeError) as exc:
        raise LookupError(f"{path}: not a readable model config ({exc})") from exc
