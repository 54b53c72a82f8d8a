"""Compact column types for token arrays.

Token ids and logprobs are stored as little-endian binary (4 bytes per entry)
instead of JSON text: an 8k-token prompt is 32 KiB, not ~60 KiB of digits, and
reads back without parsing.  Values round-trip exactly: int32 ids in
[-2^31, 2^31-1], float32 logprobs (a Python float read back is the float32
value widened to float64, bit-exact).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
from sqlalchemy import LargeBinary
from sqlalchemy.types import TypeDecorator


class _PackedArray(TypeDecorator):
    """Base: a `Sequence` of numbers <-> bytes of one fixed numpy dtype."""

    impl = LargeBinary
    cache_ok = True
    dtype: np.dtype

    def process_bind_param(self, value: Sequence | np.ndarray | None, dialect) -> bytes | None:
        if value is None:
            return None
        arr = np.asarray(value)
        if arr.ndim != 1:
            raise ValueError(f"{type(self).__name__} expects a 1-D sequence, got shape {arr.shape}")
        if np.issubdtype(self.dtype, np.integer) and arr.size:
            if not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(f"{type(self).__name__} expects integers, got dtype {arr.dtype}")
            info = np.iinfo(self.dtype)
            if arr.min() < info.min or arr.max() > info.max:
                raise ValueError(f"{type(self).__name__}: value out of {self.dtype} range")
        return arr.astype(self.dtype.newbyteorder("<"), copy=False).tobytes()

    def process_result_value(self, value: bytes | None, dialect) -> list | None:
        if value is None:
            return None
        return np.frombuffer(value, dtype=self.dtype.newbyteorder("<")).tolist()


class Int32Array(_PackedArray):
    """List of int32 token ids (shape [n], dtype int32) stored as 4n bytes."""

    cache_ok = True
    dtype = np.dtype(np.int32)


class Float32Array(_PackedArray):
    """List of float32 values (e.g. per-token logprobs in nats, shape [n]) stored as 4n bytes."""

    cache_ok = True
    dtype = np.dtype(np.float32)


class UInt8Array(_PackedArray):
    """List of uint8 flags (e.g. a loss mask of 0/1, shape [n]) stored as n bytes."""

    cache_ok = True
    dtype = np.dtype(np.uint8)
