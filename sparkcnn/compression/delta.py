"""Sparse weight deltas over a flat parameter vector, and model layouts.

A model is one flat float32 vector of length ``P``, cut into tensors by a
**layout**: a tuple of tensor sizes in order, so tensor ``t`` occupies
``flat[offsets[t]:offsets[t + 1]]`` with ``offsets = [0, *cumsum(layout)]``.

A :class:`SparseDelta` is the pair ``(indices, values)`` with global flat
indices, i.e. the dense vector::

    dense = np.zeros(size, np.float32); dense[indices] = values
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

Layout = Sequence[int]


def layout_offsets(layout: Layout) -> np.ndarray:
    """``[0, l0, l0 + l1, …, P]`` as int64; rejects negative or non-integer sizes."""
    sizes = np.asarray(tuple(layout), dtype=np.int64)
    if sizes.ndim != 1:
        raise ValueError(f"layout must be a flat sequence of tensor sizes, got shape {sizes.shape}")
    if sizes.size and sizes.min() < 0:
        bad = int(np.flatnonzero(sizes < 0)[0])
        raise ValueError(f"layout tensor {bad}: size must be >= 0, got {int(sizes[bad])}")
    offsets = np.zeros(sizes.size + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    return offsets


@dataclass(frozen=True, eq=False)  # eq=False: elementwise array == has no single truth value
class SparseDelta:
    """``dense[indices] = values`` over a flat vector of length ``size``.

    Invariants (checked by :meth:`validate`, relied on everywhere):
    ``indices`` int64, strictly increasing, within ``[0, size)``;
    ``values`` float32 of the same length.
    """

    size: int  # P, length of the flat parameter vector
    indices: np.ndarray  # int64, sorted strictly increasing, global flat indices
    values: np.ndarray  # float32, same length as indices

    def __post_init__(self) -> None:
        # O(1) checks plus dtype coercion only; the O(nnz) ones live in validate().
        indices = np.asarray(self.indices, dtype=np.int64)
        values = np.asarray(self.values, dtype=np.float32)
        if indices.ndim != 1 or values.ndim != 1 or indices.shape != values.shape:
            raise ValueError(
                f"SparseDelta indices {indices.shape} and values {values.shape} "
                "must be 1-D of the same length"
            )
        if int(self.size) < 0:
            raise ValueError(f"SparseDelta size must be >= 0, got {self.size}")
        object.__setattr__(self, "size", int(self.size))
        object.__setattr__(self, "indices", indices)
        object.__setattr__(self, "values", values)

    @classmethod
    def from_dense(cls, vec) -> "SparseDelta":
        """Every entry of ``vec`` (indices = ``arange(P)``), zeros included."""
        values = np.ascontiguousarray(vec, dtype=np.float32).ravel()
        return cls(values.size, np.arange(values.size, dtype=np.int64), values)

    @classmethod
    def empty(cls, size: int) -> "SparseDelta":
        return cls(size, np.empty(0, np.int64), np.empty(0, np.float32))

    @property
    def nnz(self) -> int:
        """Number of stored entries (a stored zero still counts)."""
        return int(self.indices.size)

    def to_dense(self) -> np.ndarray:
        dense = np.zeros(self.size, dtype=np.float32)
        dense[self.indices] = self.values
        return dense

    def validate(self) -> "SparseDelta":
        """Check the invariants in O(nnz); raise ValueError naming the first fault."""
        idx = self.indices
        if idx.size:
            if idx[0] < 0 or idx[-1] >= self.size:
                bad = int(idx[0] if idx[0] < 0 else idx[-1])
                raise ValueError(f"index {bad} out of range [0, {self.size})")
            steps = np.diff(idx)
            if steps.size and steps.min() <= 0:
                at = int(np.flatnonzero(steps <= 0)[0]) + 1
                raise ValueError(
                    f"indices not strictly increasing at position {at} "
                    f"({int(idx[at - 1])} then {int(idx[at])})"
                )
        return self
