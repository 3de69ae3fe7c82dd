"""Key-range shards of the parameter server: the flat weights cut into K contiguous ranges of
whole tensors, each range's W and U kept by its own process (``ps.shards``).

    ranges      = shard_ranges(layout, K)       K spans of whole tensors, the largest as small as can be
    task        S  ->  S_k = S on range k       one codec payload per shard (global indices)
    coordinator decides each push once, from its header: dedup, staleness, drop, and the guard on
                ||S|| = sqrt(sum_k ||S_k||^2); numbers the applied pushes and sends every shard the
                same ordered log of what to apply, with which factor, and when to make a downlink
    shard k     W_k -= factor . S_k in log order; D_k(v) = its part of downlink v; answers the task
    task        D(v) = union_k D_k(v);  checksum_after(v) = sum_k c_k(v)  (mod 2**64)

Why K shards give bitwise the weights and downlinks of one server: apply is per entry, the
downlink's selection is per tensor (a range holds whole tensors), and the checksum of U is a
sum over entries, so each shard's part ``c_k`` (its entries, at their global indices) adds up to
the whole. A shard keeps full-length W and U of which only its range ever moves: the parameter
server, codec and replica then work on it unchanged, and the entries outside its range add a
constant to its checksum, which :func:`range_checksum` takes off.

numpy, the compression package and the replica only.
"""

from __future__ import annotations

import numpy as np

from sparkcnn.compression.delta import SparseDelta, layout_offsets
from sparkcnn.errors import BadInput
from sparkcnn.replica import MASK64, Downlink, _mix_sum, format_checksum


def shard_ranges(layout, k: int) -> tuple[tuple[int, int], ...]:
    """K contiguous ``(lo, hi)`` flat ranges of whole tensors covering ``layout``, none empty,
    minimising the largest (the shard that holds it bounds the others' gain)."""
    sizes = [int(n) for n in layout]
    if not 1 <= k <= len(sizes):
        raise BadInput(f"ps.shards={k}: must be between 1 and the model's {len(sizes)} tensors")
    off = [int(x) for x in layout_offsets(sizes)]
    n = len(sizes)
    inf = float("inf")
    # best[j][t]: the smallest largest-range cutting tensors 0..t-1 into j ranges; cut[j][t] its last cut
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0
    for j in range(1, k + 1):
        for t in range(j, n - (k - j) + 1):
            for s in range(j - 1, t):
                cost = max(best[j - 1][s], off[t] - off[s])
                if cost < best[j][t]:
                    best[j][t], cut[j][t] = cost, s
    bounds, t = [n], n
    for j in range(k, 0, -1):
        t = cut[j][t]
        bounds.append(t)
    bounds.reverse()
    return tuple((off[a], off[b]) for a, b in zip(bounds[:-1], bounds[1:]))


def split_delta(delta: SparseDelta, ranges) -> list[SparseDelta]:
    """``delta`` on each range: full-length deltas with their global indices (indices are sorted)."""
    cuts = np.searchsorted(delta.indices, [lo for lo, _ in ranges] + [ranges[-1][1]])
    return [SparseDelta(delta.size, delta.indices[a:b], delta.values[a:b])
            for a, b in zip(cuts[:-1], cuts[1:])]


def sum_squares(delta: SparseDelta) -> float:
    """``||delta||^2`` in float64: what the coordinator's guard adds up over the pieces."""
    v = delta.values.astype(np.float64)
    return float(np.dot(v, v))


def outside_checksum(U: np.ndarray, lo: int, hi: int) -> int:
    """The checksum part of the entries of ``U`` outside ``[lo, hi)``: a shard's constant."""
    return (_mix_sum(U[:lo]) + _mix_sum(U[hi:], np.arange(hi, U.size, dtype=np.int64))) & MASK64


def range_checksum(full: str, outside: int) -> int:
    """A shard's part of the checksum of U: its whole-vector checksum less the constant outside part."""
    return (int(full, 16) - outside) & MASK64


def merge_downlinks(parts: list[list[Downlink]], partial: list[list[int]]) -> list[Downlink]:
    """The downlinks of the whole vector from every shard's parts of the same versions:
    ``parts[k][i]`` is shard k's part of the i-th downlink, ``partial[k][i]`` its checksum part."""
    if len({len(p) for p in parts}) != 1:
        raise ValueError(f"shards sent {[len(p) for p in parts]} downlinks: they must send the same versions")
    out = []
    for i, same in enumerate(zip(*parts)):
        head = same[0]
        if any((d.version, d.base_version, d.assign) != (head.version, head.base_version, head.assign)
               for d in same):
            raise ValueError(f"downlink {i}: the shards' parts are of different versions")
        total = sum(p[i] for p in partial) & MASK64
        idx = np.concatenate([d.delta.indices for d in same])
        vals = np.concatenate([d.delta.values for d in same])
        out.append(Downlink(head.version, SparseDelta(head.delta.size, idx, vals), format_checksum(total),
                            head.base_version, head.assign))
    return out
