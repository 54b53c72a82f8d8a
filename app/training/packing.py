"""Document masks for packed rows: several sequences in one row, each attending only to itself.

A packed row holds sequences s_1 .. s_k back to back; token q of document d(q) may attend to
token k iff d(k) == d(q) and k <= q (causal within its document, nothing across a boundary).
Position ids restart at 0 at each document's start, so RoPE sees every sequence as if it were
alone.  With both, a packed row gives each sequence exactly the logits it has alone (Krell et al.
2021, "Efficient Sequence Packing without Cross-contamination", arXiv:2107.02027).

Two forms of the same mask, chosen by the model's attention implementation:

* `flex_attention` (torch.nn.attention.flex_attention, torch >= 2.5): a `BlockMask` built from
  the document ids; blocks across documents are skipped, so the cost is about sum(T_i^2),
  not (sum T_i)^2 (https://pytorch.org/blog/flexattention/, "Document masking").
* `sdpa` / `eager`: a dense bool [1, 1, T, T] block-diagonal causal mask (True = attend),
  exact on any kernel but computing the whole row's T x T scores.

transformers takes either as the model's `attention_mask` as-is (a 4-D tensor or a BlockMask
is "already prepared", `masking_utils._preprocess_mask_arguments`).
"""
from __future__ import annotations

from typing import Sequence

import torch


def flex_attention_available() -> bool:
    """Whether this torch has `torch.nn.attention.flex_attention` (create_block_mask and the op)."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def document_ids(lengths: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 [sum(lengths)]: the index of the document each token of the packed row belongs to."""
    if any(int(n) <= 0 for n in lengths):
        raise ValueError(f"packed sequence lengths must be positive, got {list(lengths)}")
    sizes = torch.tensor([int(n) for n in lengths], dtype=torch.long, device=device)
    return torch.repeat_interleave(torch.arange(len(lengths), device=device), sizes)


def position_ids(lengths: Sequence[int]) -> torch.Tensor:
    """int64 [1, sum(lengths)]: positions restarting at 0 at every document's start."""
    return torch.cat([torch.arange(int(n), dtype=torch.long) for n in lengths]).unsqueeze(0)


def dense_document_mask(documents: torch.Tensor) -> torch.Tensor:
    """bool [1, 1, T, T] for a packed row's `documents` (int64 [T]): causal within a document."""
    t = documents.shape[-1]
    same = documents.unsqueeze(-1) == documents.unsqueeze(-2)
    causal = torch.ones(t, t, dtype=torch.bool, device=documents.device).tril_()
    return (same & causal)[None, None]


def flex_document_mask(documents: torch.Tensor):
    """A flex-attention `BlockMask` [1, heads broadcast, T, T] for `documents` (int64 [T])."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q, k):
        return (documents[q] == documents[k]) & (k <= q)

    t = documents.shape[-1]
    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=t, KV_LEN=t, device=documents.device)


def document_mask(lengths: Sequence[int], attention: str, device: torch.device | str = "cpu"):
    """The attention mask of one packed row of sequences of `lengths` tokens, for `attention`
    ("flex_attention": a BlockMask; anything else: the dense bool [1, 1, T, T] mask).
    Raises ValueError for a non-positive length."""
    documents = document_ids(lengths, device)
    if attention == "flex_attention":
        return flex_document_mask(documents)
    return dense_document_mask(documents)


def dense_mask_elements(mb, attention: str) -> int:
    """Bool elements of the dense mask a micro-batch's forward builds under `attention`: a
    packed row's [T, T] block-diagonal mask, a padded micro-batch's [B, T, T] padding mask
    when some row is padded (transformers hands sdpa `is_causal` and no mask otherwise);
    0 under flex/flash attention, whose masks are not dense."""
    if attention.startswith(("flex", "flash")):
        return 0
    rows, width = mb.input_ids.shape
    if mb.segment_lengths is not None:
        return width * width if len(mb.segment_lengths) > 1 else 0
    return rows * width * width if mb.tokens < mb.padded_tokens else 0
