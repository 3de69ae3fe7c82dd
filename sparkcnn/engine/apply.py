"""The one path from block payloads to the global weights (sync rounds and async results alike)::

    good = {k : samples[k] > 0, payload k decodes, and the guard passes its norm}
    G    = Σ_{k ∈ good} float32(factors[k] · samples[k] / Σ_{j ∈ good} samples[j]) · decode(payloads[k])
    W   -= G                                      # ps.apply: one version bump, if good is not empty

Each payload is decoded and validated once (the codec refuses malformed
and non-finite ones); the guard then sees each norm in payload order on
the calling thread; a payload that fails either is rejected with its
reason, and never keeps the others from being applied. ``G`` is summed
into a fresh float32 zero vector in payload order per element, so it is
bitwise ``weighted_sum([decode(p_k) for k in good], [w_k], P)``.

The engines choose the factors: sync rounds pass all blocks of a round with
``factors[k] = server_scale(lr)``; async passes one payload with
``factors = [staleness_scale(τ) · server_scale(lr) / N]``.

numpy, the compression package, ps and guard only: no Spark, no TensorFlow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from sparkcnn.compression.sparse_sum import decode_batch
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
    if len(good) == 1 and batch.nnz(good[0][0]) * SPARSE_APPLY_BELOW < ps.W.size:
        # one sparse payload (async, the stream): W[idx] -= float32(factor) · values, bitwise what
        # the sum below gives, without a P-sized zero vector and a dense subtraction
        j, k = good[0]
        ps.apply(batch.delta(j), scale=float(np.float32(factors[k])))
    elif good:
        total = sum(samples[k] for _, k in good)
        ps.apply(batch.sum({j: factors[k] * samples[k] / total for j, k in good}))
    return Applied(tuple(k for _, k in good), rejected)
