"""The one path from block payloads to the global weights (sync rounds and async results alike)::

    good = {k : samples[k] > 0, payload k decodes, and the guard passes its norm}
    G    = Σ_{k ∈ good} float32(factors[k] · samples[k] / Σ_{j ∈ good} samples[j]) · decode(payloads[k])
    W   -= G                                      # ps.apply: one version bump, if good is not empty

Each payload is decoded and validated once (the codec refuses malformed
and non-finite ones); the guard then sees each norm in payload order on
the calling thread; a payload that fails either is rejected with its
reason, and never keeps the others from being applied. ``G`` is summed
into a fresh float32 zero vector in payload order per element, so it is
bitwise ``weighted_sum([decode(p_k) for k in good], [w_k], P)``. A lone
payload (async, the stream: one per call) skips the batch: one decode call,
the guard on its norm, and ``W -= float32(factor) · delta``, in place when
sparse, bitwise the same.

The engines choose the factors: sync rounds pass all blocks of a round with
``factors[k] = server_scale(lr)``; async passes one payload with
``factors = [staleness_scale(τ) · server_scale(lr) / N]``.

numpy, the compression package, ps and guard only: no Spark, no TensorFlow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from sparkcnn.compression.codec import decode
from sparkcnn.compression.sparse_sum import decode_batch, values_norm
from sparkcnn.errors import CodecError
from sparkcnn.guard import DivergenceGuard
from sparkcnn.ps import ParameterServer


SPARSE_APPLY_BELOW = 8  # a lone payload with fewer than P / 8 entries is applied in place


@dataclass(frozen=True)
class Applied:
    """What :func:`apply_deltas` did with each payload (indices into its ``payloads``)."""

    applied: tuple[int, ...]  # applied to W, ascending
    rejected: dict[int, str]  # one-line reason: the codec's error or the guard's verdict
    # payloads with samples <= 0 are in neither: nothing was trained, nothing to apply


def apply_deltas(ps: ParameterServer, payloads: Sequence[bytes], samples: Sequence[int],
                 factors: Sequence[float], *, guard: DivergenceGuard | None = None,
                 steps: Sequence[int] | None = None, threads: int | None = None) -> Applied:
    """``W -= Σ_{k good} factors[k] · samples[k] / (Σ_{j good} samples[j]) · decode(payloads[k])``.

    ``steps[k]``: local steps behind payload k, for the guard's per-step
    norm (default 1 each). ``threads``: decode and sum threads (default
    sparse_sum.DEFAULT_THREADS; small batches run on the caller's thread).
    """
    n = len(payloads)
    steps = [1] * n if steps is None else steps
    for name, seq in (("samples", samples), ("factors", factors), ("steps", steps)):
        if len(seq) != n:
            raise ValueError(f"got {n} payloads but {len(seq)} {name}")
    live = [k for k in range(n) if samples[k] > 0]
    if len(live) == 1:  # one payload (async, the stream): one decode call, nothing to sum
        return _apply_one(ps, payloads[live[0]], live[0], factors[live[0]], guard, steps[live[0]])
    batch = decode_batch([payloads[k] for k in live], ps.layout, threads=threads)
    rejected: dict[int, str] = {}
    good: list[tuple[int, int]] = []  # (position in batch, payload)
    for j, k in enumerate(live):
        why = batch.errors.get(j)
        if why is None and guard is not None:
            why = guard.check_norm(float(batch.norms[j]), steps[k])
        if why is None:
            good.append((j, k))
        else:
            rejected[k] = str(why)
    if good:
        total = sum(samples[k] for _, k in good)
        ps.apply(batch.sum({j: factors[k] * samples[k] / total for j, k in good}))
    return Applied(tuple(k for _, k in good), rejected)


def _apply_one(ps: ParameterServer, payload: bytes, k: int, factor: float, guard: DivergenceGuard | None,
               steps: int) -> Applied:
    """:func:`apply_deltas` of payload ``k`` alone: ``W -= float32(factor) · decode(payload)``.

    A sparse one (fewer than P / SPARSE_APPLY_BELOW entries) moves ``W[idx]``
    in place, bitwise what the dense subtraction gives, without a P-sized
    vector; the guard sees the L2 norm of its decoded values."""
    try:
        delta = decode(payload, ps.layout)
    except CodecError as e:
        return Applied((), {k: str(e)})
    why = guard.check_norm(values_norm(delta.values), steps) if guard is not None else None
    if why is not None:
        return Applied((), {k: str(why)})
    apply_decoded(ps, delta, factor)
    return Applied((k,), {})


def apply_decoded(ps: ParameterServer, delta, factor: float) -> None:
    """``W -= float32(factor) · delta`` for one payload the codec decoded (and so validated): in
    place when sparse, bitwise the dense subtraction (what :func:`apply_deltas` does with a lone
    payload)."""
    if delta.nnz * SPARSE_APPLY_BELOW < ps.W.size:
        ps.apply(delta, scale=float(np.float32(factor)), decoded=True)
    else:
        ps.apply(delta.to_dense() * np.float32(factor))
