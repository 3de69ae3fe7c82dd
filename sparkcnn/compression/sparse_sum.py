"""Summing sparse deltas on the driver::

    G = Σ_k w_k · S_k                     (dense float32, or added into `out`)

Each delta's indices are unique (the SparseDelta invariant), so the buffered
``out[idx] += w · values`` is exact per delta; summation follows the order of
the deltas, so results are deterministic. Measured (numpy 2.4, shared 2-vCPU
VM; 256 distinct deltas of 25.5 k entries into 25.6 M parameters): 140–200 ms
for this per-delta add, ~215 ms for one concatenated ``np.bincount`` (which
also allocates a float64 array of the model's size), 160–180 ms for
``np.add.at``. All three are bound by the random memory accesses."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import CodecError
from .codec import DecodedParts, decode_parts, dense_indices, wire_to_float32
from .delta import Layout, SparseDelta


def _output(size: int, out: np.ndarray | None) -> np.ndarray:
    if out is None:
        return np.zeros(size, dtype=np.float32)
    if out.dtype != np.float32 or out.shape != (size,):
        raise ValueError(f"out must be float32 of shape ({size},), got {out.dtype} {out.shape}")
    return out


def _check_weights(n: int, weights: Sequence[float]) -> list[np.float32]:
    if len(weights) != n:
        raise ValueError(f"got {n} deltas but {len(weights)} weights")
    return [np.float32(w) for w in weights]


def weighted_sum(deltas: Sequence[SparseDelta], weights: Sequence[float], size: int,
                 *, out: np.ndarray | None = None) -> np.ndarray:
    """``Σ_k w_k · dense(deltas[k])`` as float32 of length ``size``.

    With ``out`` given, the sum is added into it in place (``out += G``), so
    ``W -= lr · mean(S)`` is ``weighted_sum(S, [-lr / N] * N, P, out=W)``.
    """
    ws = _check_weights(len(deltas), weights)
    for d in deltas:
        if d.size != size:
            raise ValueError(f"delta size {d.size} does not match size {size}")
    acc = _output(size, out)
    for d, w in zip(deltas, ws):
        if d.nnz == size:  # a dense delta has indices arange(size)
            acc += w * d.values
        elif d.nnz:
            acc[d.indices] += w * d.values
    return acc


def merge(a: SparseDelta, b: SparseDelta) -> SparseDelta:
    """``a + b`` without densifying: union of supports, duplicates summed.

    For treeAggregate's combOp: commutative bitwise (float addition is), and
    associative up to float32 rounding. Scale deltas (``SparseDelta.scaled``)
    before merging to get a weighted sum.
    """
    if a.size != b.size:
        raise ValueError(f"cannot merge deltas of sizes {a.size} and {b.size}")
    if not a.nnz:
        return b
    if not b.nnz:
        return a
    idx = np.concatenate([a.indices, b.indices])
    val = np.concatenate([a.values, b.values])
    # Two sorted runs: the stable sort (timsort for int64) merges them in O(n).
    order = np.argsort(idx, kind="stable")
    idx, val = idx[order], val[order]
    first = np.empty(idx.size, dtype=bool)
    first[0] = True
    np.not_equal(idx[1:], idx[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    if starts.size == idx.size:  # disjoint supports
        return SparseDelta(a.size, idx, val)
    return SparseDelta(a.size, idx[starts], np.add.reduceat(val, starts))


def decode_and_sum(payloads: Sequence[bytes], weights: Sequence[float], layout: Layout,
                   *, out: np.ndarray | None = None) -> np.ndarray:
    """``Σ_k w_k · decode(payloads[k])`` as dense float32 (or added into ``out``).

    Every payload is decoded and validated before anything is added, so a
    malformed one raises CodecError ("payload k: …") and leaves ``out`` untouched.
    """
    ws = _check_weights(len(payloads), weights)
    size = int(sum(layout))  # each decode_parts below validates the layout itself
    parts: list[DecodedParts] = []
    for k, data in enumerate(payloads):
        try:
            parts.append(decode_parts(data, layout))
        except CodecError as e:
            raise CodecError(f"payload {k}: {e}") from None
    acc = _output(size, out)

    # Dense tensors (biases, BatchNorm, small kernels) are the same set in
    # most payloads: sum them compactly per set, scatter each set once.
    # Conversions go through one reused scratch buffer: a fresh ~0.5 MB
    # temporary per payload would be mapped and faulted in every time.
    dense_groups: dict[bytes, np.ndarray] = {}
    longest = max((max(p.sparse_values.size, p.dense_values.size) for p in parts), default=0)
    scratch = np.empty(longest, np.float32)
    for p, w in zip(parts, ws):
        n = p.sparse_values.size
        if n:
            acc[p.sparse_indices] += wire_to_float32(p.sparse_values, w, out=scratch[:n])
        n = p.dense_values.size
        if n:
            key = p.dense.tobytes()
            group = dense_groups.get(key)
            if group is None:
                dense_groups[key] = wire_to_float32(p.dense_values, w)
            else:
                group += wire_to_float32(p.dense_values, w, out=scratch[:n])
    for key, group in dense_groups.items():
        idx = dense_indices(layout, np.frombuffer(key, dtype=bool))
        if idx.size == size:
            acc += group
        else:
            acc[idx] += group
    return acc
