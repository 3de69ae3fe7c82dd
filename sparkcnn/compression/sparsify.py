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


def _kth_largest(a: np.ndarray, k: int) -> float:
    """The k-th largest entry of ``a`` (1 <= k <= a.size), O(a.size)."""
    return float(np.partition(a, a.size - k)[a.size - k])


def topk_indices(x: np.ndarray, density: float) -> np.ndarray:
    """Exact top-k by magnitude: sorted int64 indices local to ``x``."""
    a = np.abs(np.ravel(x))
    k = target_count(a.size, density)
    if k >= a.size:
        return np.arange(a.size, dtype=np.int64)
    keep = np.argpartition(a, a.size - k)[a.size - k:]
    keep.sort()
    return keep.astype(np.int64, copy=False)


def _largest_sorted(a: np.ndarray, r: int) -> np.ndarray:
    """The ``r`` largest entries of ``a`` in descending order, O(a.size + r log r)."""
    r = min(r, a.size)
    part = np.partition(a, a.size - r)[a.size - r:]
    part.sort()
    return part[::-1]


def _trim(x: np.ndarray, keep: np.ndarray, k: int) -> np.ndarray:
    """Exactly the k largest of ``|x[keep]|``; ``keep`` sorted, stays sorted."""
    vals = np.abs(x[keep])
    top = np.argpartition(vals, vals.size - k)[vals.size - k:]
    top.sort()
    return keep[top]


def threshold_indices(x: np.ndarray, density: float, *, rng=None) -> np.ndarray:
    """Sampled-threshold selection: sorted int64 indices local to ``x``.

    The count lands within ±20% of ``k``; ``rng`` (a numpy Generator) only
    moves the start of the strided sample, so ``rng=None`` is deterministic.
    """
    x = np.ravel(x)
    n = x.size
    k = target_count(n, density)
    if k >= n:
        return np.arange(n, dtype=np.int64)
    lo, hi = (1 - TOLERANCE) * k, (1 + TOLERANCE) * k

    m = max(math.ceil(SAMPLE_FRACTION * n), math.ceil(SAMPLE_HITS / density))
    if m >= n:
        # The "sample" would be the whole tensor: exact is as cheap.
        return topk_indices(x, density)
    stride = n // m  # n / stride >= m, so the sample has >= m entries
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
        offsets = layout_offsets(layout)
        if offsets[-1] != flat.size:
            raise ValueError(f"layout covers {int(offsets[-1])} entries, vector has {flat.size}")
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
