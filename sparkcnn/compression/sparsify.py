"""Choosing which coordinates to send: sampled threshold, exact top-k, none.

All selectors keep about ``k = max(1, round(density · n))`` entries of largest
magnitude of a tensor of ``n`` entries and return their indices sorted.

- exact top-k::

      keep = argpartition(|x|, n - k)[n - k:]

- sampled threshold (DGC, Lin et al. 2018, §3 "sampling")::

      s   = |x|[start::stride]                  # >= max(1% of n, 2 / density) entries
      thr = quantile(s, 1 - density)
      keep = flatnonzero(|x| >= thr)            # corrected until 0.8 k <= len(keep) <= 1.2 k

  It reads ``x`` once per correction (one compare pass, compiled where numba
  is present; only the sample's magnitudes are computed) and sorts nothing
  of size ``n``: a few ms for 1 M entries where a full sort costs ~60 ms.
"""

from __future__ import annotations

import logging
import math

import numpy as np

from . import native, native_step
from .delta import Layout, SparseDelta, layout_offsets

log = logging.getLogger(__name__)

METHODS = ("threshold", "topk", "none")

# Accept a threshold whose selection is within ±20% of k: the wire and the
# error feedback do not care about the exact count, only about its order.
TOLERANCE = 0.2
# Correction passes over the tensor before falling back to exact top-k.
MAX_CORRECTIONS = 4
# The sample holds at least this share of the tensor …
SAMPLE_FRACTION = 0.01
# … and at least this many expected entries above the threshold (2 / density).
SAMPLE_HITS = 2.0


def target_count(n: int, density: float) -> int:
    """``k = max(1, round(density · n))``, capped at ``n``."""
    _check_density(density)
    return min(n, max(1, int(round(density * n))))


def _check_density(density: float) -> None:
    if not (0.0 < density <= 1.0) or math.isnan(density):
        raise ValueError(f"density must be in (0, 1], got {density}")


def topk_indices(x: np.ndarray, density: float) -> np.ndarray:
    """Exact top-k by magnitude: sorted int64 indices local to ``x``; ties to the lower index
    (a fixed rule, which argpartition lacks, so that the compiled selection keeps the same
    entries), NaN above every number."""
    a = np.abs(np.ravel(x))
    k = target_count(a.size, density)
    if k >= a.size:
        return np.arange(a.size, dtype=np.int64)
    kth = np.partition(a, a.size - k)[a.size - k]
    if np.isnan(kth):  # k or more NaN: the lowest k of them
        return np.flatnonzero(np.isnan(a))[:k].astype(np.int64, copy=False)
    take = ~(a <= kth)  # above the k-th largest, NaN included
    tied = np.flatnonzero(a == kth)
    take[tied[:k - int(np.count_nonzero(take))]] = True
    return np.flatnonzero(take).astype(np.int64, copy=False)


def _largest_sorted(a: np.ndarray, r: int) -> np.ndarray:
    """The ``r`` largest entries of ``a`` in descending order, O(a.size + r log r)."""
    r = min(r, a.size)
    part = np.partition(a, a.size - r)[a.size - r:]
    part.sort()
    return part[::-1]


def _trim(x: np.ndarray, keep: np.ndarray, k: int) -> np.ndarray:
    """Exactly the k largest of ``|x[keep]|``, ties to the lower index; ``keep`` sorted, stays
    sorted. (A fixed rule for ties, which argpartition lacks, so that the compiled selection
    keeps the same entries.)"""
    vals = np.abs(x[keep])
    kth = np.partition(vals, vals.size - k)[vals.size - k]
    take = vals > kth
    tied = np.flatnonzero(vals == kth)
    take[tied[:k - int(np.count_nonzero(take))]] = True
    return keep[take]


def _sampling(n: int, density: float) -> tuple[int, int] | None:
    """(k, stride) of threshold_indices' sample of a tensor of ``n`` entries; None where it
    selects without one (all entries, or exact top-k when the sample would be the whole)."""
    k = target_count(n, density)
    if k >= n:
        return None
    m = max(math.ceil(SAMPLE_FRACTION * n), math.ceil(SAMPLE_HITS / density))
    if m >= n:
        return None
    return k, n // m  # n / stride >= m, so the sample has >= m entries


def threshold_indices(x: np.ndarray, density: float, *, rng=None, start: int | None = None) -> np.ndarray:
    """Sampled-threshold selection: sorted int64 indices local to ``x``.

    The count lands within ±20% of ``k``; ``rng`` (a numpy Generator) only
    moves the start of the strided sample, so ``rng=None`` is deterministic;
    ``start`` gives that start instead (a draw already made).
    """
    x = np.ravel(x)
    n = x.size
    if target_count(n, density) >= n:
        return np.arange(n, dtype=np.int64)
    sampling = _sampling(n, density)
    if sampling is None:
        # The "sample" would be the whole tensor: exact is as cheap.
        return topk_indices(x, density)
    k, stride = sampling
    lo, hi = (1 - TOLERANCE) * k, (1 + TOLERANCE) * k
    if start is None:
        start = int(rng.integers(stride)) if rng is not None else 0
    sample = np.abs(x[start::stride])  # >= m entries
    # Rank in the sample whose value is the (1 - density) quantile.
    rank = max(1, math.ceil(density * sample.size))
    top = _largest_sorted(sample, 4 * rank)

    for _ in range(MAX_CORRECTIONS):
        if rank > top.size:
            top = _largest_sorted(sample, 4 * rank)
        thr = top[rank - 1]
        keep = _at_least(x, thr)
        c = keep.size
        if lo <= c <= hi:
            return keep.astype(np.int64, copy=False)
        if c > hi:
            # Too many: the k largest are all among `keep`, so finish exactly
            # on the candidates (O(c), c is a small multiple of k here).
            return _trim(x, keep, k).astype(np.int64, copy=False)
        # Too few: the sample over-estimated the tail. Move down in the sample
        # by the observed ratio k / c, plus a margin so that the next pass
        # overshoots and is trimmed rather than undershoots again.
        new_rank = min(sample.size, max(rank + 1, math.ceil(rank * 1.25 * k / max(c, 1))))
        if new_rank == rank:  # already at the smallest sampled value
            break
        rank = new_rank
    log.debug("threshold selection did not converge (n=%s, k=%s); exact top-k", n, k)
    return topk_indices(x, density)


def _at_least(x: np.ndarray, thr) -> np.ndarray:
    """``flatnonzero(|x| >= thr)``: one compiled pass on a float32 vector, else numpy's three."""
    if x.dtype == np.float32 and x.flags.c_contiguous and native.enabled():
        return native_step.abs_at_least(x, thr)
    return np.flatnonzero(np.abs(x) >= thr)


class _Plan:
    """What the compiled selection needs of a layout at a density, tensor by tensor: bounds
    ``[a, b)``, sent whole or not, and for the others the sample's stride, the rank of the
    threshold in a sample from start 0, and the accepted count ``[lo, hi]``. A tensor on the
    exact path (sample as large as the tensor) gets an impossible range and its ``k``: the
    compiled pass selects its k largest as :func:`topk_indices` does."""

    def __init__(self, sparsifier: Sparsifier, offsets: np.ndarray, density: float):
        t = len(offsets) - 1
        self.a = np.asarray(offsets[:-1], np.int64).copy()
        self.b = np.asarray(offsets[1:], np.int64).copy()
        self.whole = np.zeros(t, np.bool_)
        self.stride = np.zeros(t, np.int64)
        self.rank = np.ones(t, np.int64)
        self.lo = np.zeros(t, np.float64)
        self.hi = np.zeros(t, np.float64)
        self.k = np.zeros(t, np.int64)
        for i in range(t):
            n = int(self.b[i] - self.a[i])
            if sparsifier.sends_whole(n, density):
                self.whole[i] = True
                continue
            sampling = _sampling(n, density)
            if sampling is None:  # exact top-k (marked by an impossible range): the k largest
                self.stride[i], self.lo[i], self.hi[i] = 1, 1.0, 0.0
                self.k[i] = target_count(n, density)
                continue
            k, stride = sampling
            self.k[i], self.stride[i] = k, stride
            self.rank[i] = max(1, math.ceil(density * math.ceil(n / self.stride[i])))
            self.lo[i], self.hi[i] = (1 - TOLERANCE) * k, (1 + TOLERANCE) * k
        self.start0 = np.zeros(t, np.int64)
        self.size = int(offsets[-1])
        # whether tensor i draws a sample start
        self.sampled = [bool(self.hi[i] >= self.lo[i] and not self.whole[i]) for i in range(t)]


class Sparsifier:
    """Per-tensor selection over a flat vector cut by a layout.

    Tensors with fewer than ``dense_below`` entries are sent whole (biases,
    BatchNorm: tiny, and their updates are not sparse); the others keep about
    ``density · size`` entries chosen by ``method``; ``"none"`` sends all.
    """

    def __init__(self, method: str = "threshold", dense_below: int = 16384, *, rng=None):
        if method not in METHODS:
            raise ValueError(f"compression.method must be one of {METHODS}, got {method!r}")
        if int(dense_below) < 0:
            raise ValueError(f"compression.dense_below must be >= 0, got {dense_below}")
        self.method = method
        self.dense_below = int(dense_below)  # elements
        self.rng = rng  # numpy Generator for the sample offset, or None
        self._plans: dict[tuple, _Plan] = {}  # (layout, density) -> the compiled path's plan

    def sends_whole(self, n: int, density: float) -> bool:
        """Whether a tensor of ``n`` entries goes whole at ``density``: no selection (method
        ``"none"``, fewer than ``dense_below`` entries, or ``k >= n``)."""
        return self.method == "none" or n < self.dense_below or target_count(n, density) >= n

    def _local(self, tensor: np.ndarray, density: float) -> np.ndarray | None:
        """Local indices, or None for "the whole tensor"."""
        n = tensor.size
        if self.sends_whole(n, density):
            return None
        if self.method == "topk":
            return topk_indices(tensor, density)
        return threshold_indices(tensor, density, rng=self.rng)

    def indices(self, flat: np.ndarray, layout: Layout, density: float) -> np.ndarray:
        """Sorted int64 global indices of the entries to send."""
        _check_density(density)
        if flat.dtype == np.float32 and flat.ndim == 1 and flat.flags.c_contiguous:  # compiled where it can
            plan = self.compiled_plan(layout, density, flat.size)
            if plan is not None:
                return self._compiled_indices(flat, plan, density)
        offsets = layout_offsets(layout)
        if offsets[-1] != flat.size:
            raise ValueError(f"layout covers {int(offsets[-1])} entries, vector has {flat.size}")
        return self._indices(flat, offsets, density)

    def compiled_plan(self, layout: Layout, density: float, size: int) -> _Plan | None:
        """The compiled selection's plan of ``layout`` at ``density`` (kept: a run meets a few
        densities), or None where selection is not compiled (another method, no numba);
        ValueError when the layout does not cover ``size`` entries."""
        if self.method != "threshold" or not native.enabled():
            return None
        plan = self._plans.get((layout, density))  # a plan is made of a valid density only
        if plan is None:
            _check_density(density)
            if len(self._plans) >= 8:  # densities of a warm-up: a few distinct values at a time
                self._plans.clear()
            plan = self._plans[(layout, density)] = _Plan(self, layout_offsets(layout), density)
        if plan.size != size:
            raise ValueError(f"layout covers {plan.size} entries, vector has {size}")
        return plan

    def _compiled_indices(self, flat: np.ndarray, plan: _Plan, density: float) -> np.ndarray:
        """:meth:`_indices` with every tensor's threshold selection, its trim and corrections
        included, in one compiled call (``native_step.threshold_select``), exact top-k too where
        the sample would be the whole tensor; a tensor the call leaves (NaN, no settling
        correction) is selected by :func:`threshold_indices` from the same sample start. Bitwise
        :meth:`_indices`. At one step per exchange the per-tensor numpy calls of :meth:`_indices`
        cost more than its passes over the vector (in a task, 0.25 of its 0.32 ms per step,
        fmnist_cnn)."""
        if self.rng is None:
            starts, ranks = plan.start0, plan.rank
        else:  # the draws threshold_indices makes, tensor by tensor
            starts = np.array([int(self.rng.integers(st)) if sampled else 0
                               for st, sampled in zip(plan.stride, plan.sampled)], np.int64)
            sizes = (plan.b - plan.a - starts + plan.stride - 1) // np.maximum(plan.stride, 1)
            ranks = np.maximum(1, np.ceil(density * sizes)).astype(np.int64)
        out = np.empty(flat.size, np.int64)  # per call: the server's threads may share a sparsifier
        found = np.empty(plan.a.size, np.int64)
        c = native_step.threshold_select(flat, plan, starts, ranks, MAX_CORRECTIONS, out, found)
        if (found >= 0).all():
            return out[:c].copy()
        parts, at = [], 0
        for t in range(plan.a.size):
            n = int(found[t])
            if n < 0:  # as threshold_indices ends (exact top-k)
                a, b = int(plan.a[t]), int(plan.b[t])
                parts.append(threshold_indices(flat[a:b], density, start=int(starts[t])) + a)
            else:
                parts.append(out[at:at + n].copy())
                at += n
        return np.concatenate(parts) if parts else np.empty(0, np.int64)

    def _indices(self, flat: np.ndarray, offsets: np.ndarray, density: float) -> np.ndarray:
        parts = []
        for t in range(len(offsets) - 1):
            start, stop = int(offsets[t]), int(offsets[t + 1])
            local = self._local(flat[start:stop], density)
            if local is None:
                parts.append(np.arange(start, stop, dtype=np.int64))
            elif local.size:
                parts.append(local + start)
        return np.concatenate(parts) if parts else np.empty(0, np.int64)

    def select(self, flat: np.ndarray, layout: Layout, density: float) -> SparseDelta:
        """The selected entries of ``flat`` as a SparseDelta (values unquantised)."""
        idx = self.indices(flat, layout, density)
        return SparseDelta(flat.size, idx, flat[idx])
