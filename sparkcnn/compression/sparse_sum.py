"""Summing sparse deltas on the driver: decode a round's payloads once, then sum those that pass::

    batch = decode_batch(payloads, layout)   # parse + validate + float32, once each; failures kept
    G = batch.sum({k: w_k, ...})             # Σ_k w_k · decode(payloads[k]), float32

Decoding and summing are separate because the weights are known only after
the guard has seen each payload's norm (server/apply.py). Every element of
``G`` gets its float32 additions ``acc[i] += w_k · v`` in payload order,
whatever the thread count and whether the compiled kernels run, so ``G`` is
bitwise :func:`weighted_sum` of the decoded deltas, the numpy reference.

Measured (numpy 2.4, shared 2-vCPU VM; 256 distinct deltas of 25.5 k
entries into 25.6 M parameters): the per-delta buffered add
``out[idx] += w · values`` takes 140–200 ms, one concatenated
``np.bincount`` ~215 ms (and a float64 array of the model's size),
``np.add.at`` 160–180 ms; all bound by random memory access. ``np.add.at``
per delta is fastest on one thread but holds the GIL, so the numpy path uses
it alone and the buffered add (which releases the GIL) when several threads
each take a range of the output. With numba present (native.py) the sparse
entries go through a compiled decoder and a chunked add instead. The whole
engine apply of 256 such payloads (server/apply.py: decode, guard, sum,
``W -= G``) took 0.18 s with the compiled kernels and 2 threads, 0.21 s on
one thread, 0.27 s on the numpy path (bench/scale.py, quiet 2-vCPU VM).
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping, Sequence

import numpy as np

from ..errors import CodecError
from . import native, native_server
from .codec_format import layout_info
from .codec_frame import decode_frame, dense_indices, parse
from .codec_values import wire_to_float32
from .delta import Layout, SparseDelta

# Threads of decode_batch and DecodedBatch.sum: numpy drops the GIL inside
# most array loops (not np.add.at or np.repeat), which carry most of the
# decoding and scattering; per-call Python overhead (~30 % of a 25 M
# payload's decode) keeps it. They pay only with idle cores: on a 2-vCPU VM
# busy with other work, 2 threads gained no wall time and cost ~20 % more
# CPU than one (bench/scale.py reports both side by side).
DEFAULT_THREADS = min(4, os.cpu_count() or 1)
# Payload bytes below which a batch stays on one thread (4 MiB: ~12 payloads
# of a 25 M model at density 0.001, ~15 ms of work). Below it a pool costs
# more than it saves, and small payloads are mostly per-call Python
# overhead, which holds the GIL.
PARALLEL_MIN_BYTES = 1 << 22


def _output(size: int, out: np.ndarray | None) -> np.ndarray:
    if out is None:
        return np.zeros(size, dtype=np.float32)
    if out.dtype != np.float32 or out.shape != (size,):
        raise ValueError(f"out must be float32 of shape ({size},), got {out.dtype} {out.shape}")
    return out


def weighted_sum(deltas: Sequence[SparseDelta], weights: Sequence[float], size: int,
                 *, out: np.ndarray | None = None) -> np.ndarray:
    """``Σ_k w_k · dense(deltas[k])`` as float32 of length ``size`` (the numpy reference).

    Delta by delta: ``acc[indices] += float32(w_k) · values``. With ``out``
    given, the sum is added into it in place (``out += G``).
    """
    if len(weights) != len(deltas):
        raise ValueError(f"got {len(deltas)} deltas but {len(weights)} weights")
    for d in deltas:
        if d.size != size:
            raise ValueError(f"delta size {d.size} does not match size {size}")
    acc = _output(size, out)
    for d, w in zip(deltas, weights):
        w = np.float32(w)
        if d.nnz == size:  # a dense delta has indices arange(size)
            acc += w * d.values
        elif d.nnz:
            acc[d.indices] += w * d.values
    return acc


def _thread_count(threads: int | None, payload_bytes: int) -> int:
    threads = DEFAULT_THREADS if threads is None else threads
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads < 1:
        raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
    return int(threads) if payload_bytes >= PARALLEL_MIN_BYTES else 1


def _pool(threads: int):
    return ThreadPoolExecutor(threads, thread_name_prefix="sparse_sum") if threads > 1 else nullcontext()


def _map(pool: ThreadPoolExecutor | None, fn, items) -> list:
    return list(map(fn, items) if pool is None else pool.map(fn, items))


# Dense values converted per step of the norm and of the pre-sum: 1 Mi
# float32 = 4 MiB of scratch, which stays in cache while it is read again.
DENSE_STEP = 1 << 20


def _sum_squares(values: np.ndarray) -> float:
    return float(np.dot(values, values))


def values_norm(values: np.ndarray) -> float:
    """L2 norm of float32 values (a float32 dot, again in float64 if it overflowed)."""
    return _norm(values, values[:0])


def _norm(sparse: np.ndarray, dense_wire: np.ndarray) -> float:
    """L2 norm of a payload: its float32 sparse values and its dense values (still wire dtype)."""
    scratch = np.empty(min(dense_wire.size, DENSE_STEP), np.float32)
    sq = _sum_squares(sparse)
    for a in range(0, dense_wire.size, DENSE_STEP):
        part = dense_wire[a:a + DENSE_STEP]
        sq += _sum_squares(wire_to_float32(part, out=scratch[:part.size]))
    if not math.isfinite(sq):  # a float32 dot overflowed (values beyond ~1e19): again in float64
        sq = sum(_sum_squares(v.astype(np.float64)) for v in (sparse, dense_wire))
    return math.sqrt(sq)


@lru_cache(maxsize=256)
def _segments(layout: tuple, dense_mask: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start, end, first value's position among the dense values) of each non-empty dense tensor."""
    info = layout_info(layout)
    t = np.flatnonzero(np.frombuffer(dense_mask, bool) & (info.sizes > 0))
    sizes = info.sizes[t]
    value_at = np.zeros(t.size, np.int64)
    np.cumsum(sizes[:-1], out=value_at[1:])
    out = (info.offsets[t], info.offsets[t + 1], value_at)
    for a in out:
        a.setflags(write=False)  # shared through the cache
    return out


@dataclass(frozen=True)
class _DenseTerms:
    """The dense tensors' share of a sum: ``acc[dense tensors of masks[i]] += weights[i] · values[i]``.

    One pre-summed term (weight 1) when every chosen payload sends the same
    tensors whole, the usual case (small tensors always go whole); else one
    term per payload, in payload order.
    """

    per_payload: bool
    masks: list  # bool [T] per term
    values: list  # float32 per term: the mask's dense tensors' values, tensor order
    weights: np.ndarray  # float32 per term


@dataclass(frozen=True, eq=False)
class DecodedBatch:
    """Payloads decoded and validated once: values not yet weighted.

    Payload k's sparse entries are ``idx/vals[sparse_at[k]:sparse_at[k + 1]]``
    (float32); its dense tensors' values stay in the payload, ``dense_wire[k]``
    (wire dtype, tensor order).
    """

    layout: tuple[int, ...]
    size: int  # P
    errors: dict[int, CodecError]  # payload -> why it could not be decoded (ascending)
    norms: np.ndarray  # float64 [n]: ‖decode(payloads[k])‖₂; NaN where it failed
    dense: list  # per payload: bool [T], the tensors sent whole (None where it failed)
    dense_wire: list  # per payload: the dense tensors' values, wire dtype (None where it failed)
    idx: np.ndarray  # int64: sparse flat indices, payload after payload
    vals: np.ndarray  # float32
    sparse_at: np.ndarray  # int64 [n + 1]
    threads: int  # for sum(): 1 below PARALLEL_MIN_BYTES of payloads

    def __len__(self) -> int:
        return len(self.dense)

    def delta(self, k: int) -> SparseDelta:
        """Payload ``k`` as one SparseDelta (float32 values, ascending indices): what
        ``sum({k: 1})`` holds at its non-zero entries, without a P-sized vector."""
        if not 0 <= k < len(self) or self.dense[k] is None:
            raise ValueError(f"payload {k} is not a decoded payload of this batch")
        a, b = self.sparse_at[k], self.sparse_at[k + 1]
        d_idx = dense_indices(self.layout, self.dense[k])
        idx = np.concatenate([d_idx, self.idx[a:b]])
        vals = np.concatenate([wire_to_float32(self.dense_wire[k]), self.vals[a:b]])
        order = np.argsort(idx, kind="stable")
        return SparseDelta(self.size, idx[order], vals[order])

    def sum(self, weights: Mapping[int, float]) -> np.ndarray:
        """``G = Σ_k float32(weights[k]) · decode(payloads[k])`` over the payloads in ``weights``,
        float32, bitwise :func:`weighted_sum` of the decoded payloads in payload order.

        Into fresh zeros, so the dense tensors of payloads that all send the
        same tensors whole can be summed compactly first (in payload order:
        those elements get no other addition, and ``0 + t == 0 + a_1 + … + a_n``
        term by term). Threads (``self.threads``) each take a range of ``G``.
        """
        chosen = sorted(weights)
        for k in chosen:
            if not 0 <= k < len(self) or self.dense[k] is None:
                raise ValueError(f"payload {k} is not a decoded payload of this batch")
        ws = np.array([weights[k] for k in chosen], np.float32)
        acc = np.zeros(self.size, np.float32)
        if not chosen:
            return acc
        threads = self.threads
        edges = np.arange(threads + 1) * self.size // threads  # thread t adds into acc[edges[t]:edges[t + 1]]
        with _pool(threads) as pool:
            dense = self._dense_terms(chosen, ws, pool, threads)
            if native.enabled():
                runs = self._runs(chosen, ws, dense)

                def add_range(t: int) -> None:
                    native_server.scatter_runs(acc, runs, edges[t], edges[t + 1])
            else:
                add = np.add.at if threads == 1 else _add_buffered  # np.add.at: fastest, but holds the GIL

                def add_range(t: int) -> None:
                    self._add_numpy(acc, chosen, ws, dense, int(edges[t]), int(edges[t + 1]), add)

            _map(pool, add_range, range(threads))
        return acc

    def _dense_terms(self, chosen: list[int], ws: np.ndarray, pool, threads: int) -> _DenseTerms:
        masks = {self.dense[k].tobytes() for k in chosen}
        if len(masks) > 1:  # a rare round: per payload, float32 values, weighted in the add
            return _DenseTerms(True, [self.dense[k] for k in chosen],
                               [wire_to_float32(self.dense_wire[k]) for k in chosen], ws)
        wires = [self.dense_wire[k] for k in chosen]
        total = np.empty(wires[0].size, np.float32)
        steps = range(0, total.size, DENSE_STEP)

        def presum(t: int) -> None:  # Σ_k w_k · wire_k in payload order, one cache-sized step at a time
            scratch = np.empty(min(total.size, DENSE_STEP), np.float32)
            for a in steps[t::threads]:
                part = total[a:a + DENSE_STEP]
                wire_to_float32(wires[0][a:a + DENSE_STEP], ws[0], out=part)
                for wire, w in zip(wires[1:], ws[1:]):
                    part += wire_to_float32(wire[a:a + DENSE_STEP], w, out=scratch[:part.size])

        _map(pool, presum, range(min(threads, len(steps))))
        return _DenseTerms(False, [self.dense[chosen[0]]], [total], np.ones(1, np.float32))

    def _runs(self, chosen: list[int], ws: np.ndarray, dense: _DenseTerms) -> native_server.Runs:
        """Payload k's sparse entries, and the dense terms: with each payload, or after them all."""
        segs = [_segments(self.layout, m.tobytes()) for m in dense.masks]
        counts = np.array([s[0].size for s in segs], np.int64)
        value_at = np.concatenate([[0], np.cumsum([v.size for v in dense.values])]).astype(np.int64)
        chosen_at = np.asarray(chosen, np.int64)
        sparse_lo, sparse_hi = self.sparse_at[chosen_at], self.sparse_at[chosen_at + 1]
        if dense.per_payload:
            weights, seg_count = ws, counts
        else:  # one more run after the payloads: no sparse entries, the pre-summed dense values
            weights = np.append(ws, dense.weights)
            sparse_lo, sparse_hi = np.append(sparse_lo, 0), np.append(sparse_hi, 0)
            seg_count = np.append(np.zeros(len(chosen), np.int64), counts)
        seg_hi = np.cumsum(seg_count)
        return native_server.Runs(
            weights, self.idx, self.vals, sparse_lo, sparse_hi,
            np.concatenate([s[0] for s in segs]), np.concatenate([s[1] for s in segs]),
            np.concatenate([s[2] + at for s, at in zip(segs, value_at)]),
            np.concatenate(dense.values), seg_hi - seg_count, seg_hi)

    def _add_numpy(self, acc: np.ndarray, chosen: list[int], ws: np.ndarray, dense: _DenseTerms,
                   lo: int, hi: int, add) -> None:
        """The numpy path (the reference for the compiled one), into acc[lo:hi]."""
        whole = lo == 0 and hi == self.size
        terms = iter(zip(dense.masks, dense.values, dense.weights))
        for k, w in zip(chosen, ws):
            a = self.sparse_at[k]
            idx = self.idx[a:self.sparse_at[k + 1]]
            i, j = (0, idx.size) if whole else np.searchsorted(idx, (lo, hi)).tolist()
            if i < j:
                add(acc, idx[i:j], w * self.vals[a + i:a + j])
            if dense.per_payload:
                self._add_dense(acc, *next(terms), lo, hi, add)
        for term in terms:  # the pre-summed term, if any
            self._add_dense(acc, *term, lo, hi, add)

    def _add_dense(self, acc, mask, values, w, lo: int, hi: int, add) -> None:
        d_idx = dense_indices(self.layout, mask)
        if d_idx.size == self.size:  # every tensor dense: d_idx is arange(size)
            acc[lo:hi] += w * values[lo:hi]
            return
        i, j = np.searchsorted(d_idx, (lo, hi)).tolist()
        if i < j:
            add(acc, d_idx[i:j], w * values[i:j])


def _add_buffered(acc: np.ndarray, idx: np.ndarray, values: np.ndarray) -> None:
    acc[idx] += values  # exact for unique idx; numpy drops the GIL here, np.add.at keeps it


def decode_batch(payloads: Sequence[bytes], layout: Layout, *, threads: int | None = None) -> DecodedBatch:
    """Parse, validate and convert every payload once; a bad one lands in ``errors``, never raises.

    ``threads`` (default DEFAULT_THREADS) decode payloads side by side;
    ``threads=1``, or payloads of fewer than PARALLEL_MIN_BYTES in all, run
    on the caller's thread alone. The batch keeps that count for its sum.
    """
    layout = layout if isinstance(layout, tuple) else tuple(layout)
    n = len(payloads)
    threads = _thread_count(threads, sum(len(data) for data in payloads))
    frames: list = [None] * n
    errors: dict[int, CodecError] = {}
    for k, data in enumerate(payloads):
        try:
            frames[k] = parse(data, layout)  # header and lengths: sizes the shared arrays
        except CodecError as e:
            errors[k] = e
    sparse_at = np.zeros(n + 1, np.int64)
    np.cumsum([0 if f is None else f.n_sparse for f in frames], out=sparse_at[1:])
    idx = np.empty(int(sparse_at[-1]), np.int64)
    vals = np.empty(idx.size, np.float32)
    norms = np.full(n, np.nan)
    dense: list = [None] * n
    dense_wire: list = [None] * n

    def decode_share(ks: range) -> dict[int, CodecError]:
        failed = {}
        for k in ks:
            if frames[k] is None:
                continue
            a, b = sparse_at[k], sparse_at[k + 1]
            try:
                parts = decode_frame(frames[k], idx[a:b])  # index stream and values checked
            except CodecError as e:
                failed[k] = e
                continue
            norms[k] = _norm(wire_to_float32(parts.sparse_values, out=vals[a:b]), parts.dense_values)
            dense[k], dense_wire[k] = parts.dense, parts.dense_values
        return failed

    with _pool(threads) as pool:
        for failed in _map(pool, decode_share, [range(t, n, threads) for t in range(threads)]):
            errors.update(failed)
    return DecodedBatch(layout, int(sum(layout)), dict(sorted(errors.items())), norms, dense, dense_wire,
                        idx, vals, sparse_at, threads)
