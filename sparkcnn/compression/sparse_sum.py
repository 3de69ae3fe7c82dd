"""Summing sparse deltas on the driver::

    G = Σ_k w_k · S_k                     (dense float32, or added into `out`)

Each delta's indices are unique (the SparseDelta invariant), so the buffered
``out[idx] += w · values`` is exact per delta; summation follows the order of
the deltas, so results are deterministic. Measured (numpy 2.4, shared 2-vCPU
VM; 256 distinct deltas of 25.5 k entries into 25.6 M parameters): 140–200 ms
for this per-delta add, ~215 ms for one concatenated ``np.bincount`` (which
also allocates a float64 array of the model's size), 160–180 ms for
``np.add.at``. All three are bound by the random memory accesses. Run
interleaved (30 runs each, medians of CPU time), ``np.add.at`` per delta
took 162 ms against 214 ms for the buffered add, but it holds the GIL all
along: decode_and_sum uses it on one thread, while several threads each take
a range of the output and use the buffered add, which releases the GIL.

Those are the numpy path's figures. With numba present (native.py) the
sparse entries go through a compiled decoder and a chunked add instead
(~180 ms against ~300 ms for the whole 256 × 25 M decode+sum, bench/scale.py),
in the same order, so the sums are bitwise equal."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import CodecError
from . import native
from .codec import DecodedParts, _decode_frame, _parse, decode_parts, dense_indices, wire_to_float32
from .delta import Layout, SparseDelta

# decode_and_sum's threads: numpy drops the GIL inside most array loops
# (not np.add.at or np.repeat), which carry most of the decoding and
# scattering; per-call Python overhead (~30 % of a 25 M payload's decode)
# keeps it. They pay only with idle cores: on a 2-vCPU VM busy with other
# work, 2 threads gained no wall time and cost ~20 % more CPU than one
# (bench/scale.py reports both side by side).
DEFAULT_THREADS = min(4, os.cpu_count() or 1)
# Payload bytes below which decode_and_sum stays on one thread (4 MiB: ~12
# payloads of a 25 M model at density 0.001, ~15 ms of work). Below it a
# pool costs more than it saves, and small payloads are mostly per-call
# Python overhead, which holds the GIL.
PARALLEL_MIN_BYTES = 1 << 22


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


@dataclass(frozen=True)
class _Decoded:
    """One validated payload, ready to add."""

    parts: DecodedParts
    sparse_values: np.ndarray  # float32: w · the sparse values
    cuts: list[int]  # output range t gets sparse entries cuts[t]:cuts[t + 1]


def _decode(data: bytes, layout: Layout, w: np.float32, edges: np.ndarray) -> _Decoded:
    p = decode_parts(data, layout)
    idx = p.sparse_indices  # strictly increasing, so each range's entries are one slice
    cuts = [0, idx.size] if edges.size == 2 else np.searchsorted(idx, edges).tolist()
    return _Decoded(p, wire_to_float32(p.sparse_values, w), cuts)


def _map(pool: ThreadPoolExecutor | None, fn, items) -> list:
    return list(map(fn, items) if pool is None else pool.map(fn, items))


def _decode_all(n: int, decode_one, pool, threads: int, failure=None) -> list[_Decoded]:
    """``decode_one(k)`` for k < n, spread over the threads; or raise CodecError naming the
    first bad payload (``failure``: a (k, CodecError) found before, e.g. while parsing)."""
    decoded: list = [None] * n

    def decode_share(ks: range):
        for k in ks:
            try:
                decoded[k] = decode_one(k)
            except CodecError as e:
                return k, e  # the rest of this share could only fail later
        return None

    shares = [range(t, n, threads) for t in range(threads)]
    failures = [f for f in _map(pool, decode_share, shares) if f] + ([failure] if failure else [])
    if failures:
        k, e = min(failures, key=lambda f: f[0])
        raise CodecError(f"payload {k}: {e}") from None
    return decoded


def _dense_groups(decoded: list[_Decoded], ws, layout) -> list[tuple[np.ndarray, list]]:
    """(global indices, [(values, w), …]) per set of dense tensors, in order of first appearance.

    Dense tensors (biases, BatchNorm, small kernels) are the same set in
    most payloads: summed compactly per set, each set is scattered once.
    """
    groups: dict[bytes, list] = {}
    for d, w in zip(decoded, ws):
        if d.parts.dense_values.size:
            groups.setdefault(d.parts.dense.tobytes(), []).append((d.parts.dense_values, w))
    return [(dense_indices(layout, np.frombuffer(key, bool)), members) for key, members in groups.items()]


def _add_buffered(acc: np.ndarray, idx: np.ndarray, values: np.ndarray) -> None:
    acc[idx] += values  # exact for unique idx; numpy drops the GIL here, np.add.at keeps it


def _add_sparse_range(acc: np.ndarray, decoded: list[_Decoded], t: int, add) -> None:
    """Add every sparse entry that lands in range t of the output; ``add(acc, idx, values)``."""
    for d in decoded:
        a, b = d.cuts[t], d.cuts[t + 1]
        if a < b:
            add(acc, d.parts.sparse_indices[a:b], d.sparse_values[a:b])


def _add_dense_range(acc: np.ndarray, groups: list, edges: np.ndarray, t: int, add) -> None:
    """Add the dense sets' entries that land in ``acc[edges[t]:edges[t + 1]]``."""
    whole = edges.size == 2
    spans = [(0, idx.size) if whole else np.searchsorted(idx, edges[t:t + 2]).tolist() for idx, _ in groups]
    # Conversions go through one reused scratch buffer: a fresh ~0.5 MB
    # temporary per payload would be mapped and faulted in every time.
    scratch = np.empty(max((b - a for a, b in spans), default=0), np.float32)
    for (idx, members), (a, b) in zip(groups, spans):
        if a == b:
            continue
        (values, w), rest = members[0], members[1:]
        total = wire_to_float32(values[a:b], w)
        for values, w in rest:
            total += wire_to_float32(values[a:b], w, out=scratch[: b - a])
        if idx.size == acc.size:  # every tensor dense: idx is arange(size)
            acc[a:b] += total
        else:
            add(acc, idx[a:b], total)


def _decode_native(payloads, ws, layout, pool, threads: int):
    """Decode for the compiled scatter: (decoded payloads, ``scatter(acc, lo, hi)``).

    Every payload's sparse indices and scaled values go into two shared
    arrays (no per-payload temporaries), which the compiled add then walks
    range by range in cache-sized chunks, payload order kept.
    """
    frames, failure = [], None
    for k, data in enumerate(payloads):
        try:
            frames.append(_parse(data, layout))  # sizes the shared arrays
        except CodecError as e:
            failure = (k, e)  # a bad stream in an earlier payload still comes first
            break
    starts = np.zeros(len(frames) + 1, np.int64)
    np.cumsum([f.n_sparse for f in frames], out=starts[1:])
    idx = np.empty(int(starts[-1]), np.int64)
    vals = np.empty(idx.size, np.float32)

    def decode_one(k: int) -> _Decoded:
        a, b = starts[k], starts[k + 1]
        parts = _decode_frame(frames[k], idx[a:b])
        return _Decoded(parts, wire_to_float32(parts.sparse_values, ws[k], out=vals[a:b]), [])

    decoded = _decode_all(len(frames), decode_one, pool, threads, failure)
    return decoded, lambda acc, lo, hi: native.scatter_runs(acc, idx, vals, starts, int(lo), int(hi))


def decode_and_sum(payloads: Sequence[bytes], weights: Sequence[float], layout: Layout,
                   *, out: np.ndarray | None = None, threads: int | None = None) -> np.ndarray:
    """``Σ_k w_k · decode(payloads[k])`` as dense float32 (or added into ``out``).

    Every payload is decoded and validated before anything is added, so a
    malformed one raises CodecError ("payload k: …") and leaves ``out`` untouched.

    ``threads`` (default DEFAULT_THREADS) decode payloads side by side, then
    each adds into its own range of the output; ``threads=1``, or payloads of
    fewer than PARALLEL_MIN_BYTES in all, run on the caller's thread alone.
    Every output element gets the same float32 additions in the same order
    whatever the thread count, so results are bitwise equal: its sparse
    entries in payload order, then the sum of each set of dense tensors
    (itself summed in payload order), sets in order of first appearance.
    """
    ws = _check_weights(len(payloads), weights)
    threads = DEFAULT_THREADS if threads is None else threads
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads < 1:
        raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
    threads = int(threads) if sum(len(data) for data in payloads) >= PARALLEL_MIN_BYTES else 1
    size = int(sum(layout))  # each decode_parts below validates the layout itself
    edges = np.arange(threads + 1) * size // threads  # thread t adds into acc[edges[t]:edges[t + 1]]
    add = np.add.at if threads == 1 else _add_buffered  # np.add.at: fastest, but holds the GIL
    with ThreadPoolExecutor(threads, thread_name_prefix="decode_and_sum") if threads > 1 else nullcontext() as pool:
        if native.enabled():
            decoded, scatter = _decode_native(payloads, ws, layout, pool, threads)
        else:
            decoded = _decode_all(len(payloads), lambda k: _decode(payloads[k], layout, ws[k], edges), pool,
                                  threads)
            scatter = None
        acc = _output(size, out)
        groups = _dense_groups(decoded, ws, layout)

        def add_range(t: int) -> None:  # sparse entries first, then the dense sets
            if scatter is None:
                _add_sparse_range(acc, decoded, t, add)
            else:
                scatter(acc, edges[t], edges[t + 1])
            _add_dense_range(acc, groups, edges, t, add)

        _map(pool, add_range, range(threads))
    return acc
