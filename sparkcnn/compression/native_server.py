"""Compiled passes of the driver and its parameter server: the blocked weighted add, the support
of the residual, a downlink's apply with its checksum change, and the downlink from the
candidate set.

    scatter_runs        acc[lo:hi] += Σ_k w_k · payload_k     (sparse_sum's decode+sum)
    residual_support    {i : float32(W[i] - U[i]) != 0}       (ps_downlink.py's residual), and where
                        in it |W[i] - U[i]| > 2**-25 (the entries float16 does not round to 0)
    apply_delta         U[idx] = U[idx] + vals (or = vals), and the change of
                        Σ_i mix64((i << 32) | bits(U[i])) mod 2**64   (replica.py's checksum)
    checksum            that sum over all of U (a replica's full check, a snapshot's load)
    candidate_downlink  ps_downlink.py's float16 downlink from its candidate set, applied to U
    round_f16           a chosen downlink's values rounded to float16, the zeros left out


The float16 rounding of the downlink is the codec's kernel (native_codec.f16_bits).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .native_compile import FAULT, OK, kernel, kernels
from .native_codec import f16_bits, f32_bits

# Output floats per chunk of the blocked add: 64 Ki float32 = 256 KiB, which
# stays in L2 while every payload adds its entries of the chunk.
CHUNK = 1 << 16

f16_zero = np.float32(2.0**-25)  # the largest magnitude that rounds to 0 in float16
f16_max = np.float32(65504.0)

# The checksum's mixing of one (index, float32 bits) word (replica.py), for both paths:
#   w *= C1; w ^= w >> S1; w *= C2; w ^= w >> S2   (uint64, wrapping)
MIX_C1, MIX_C2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
MIX_S1, MIX_S2 = np.uint64(29), np.uint64(32)


@kernel(nogil=True, boundscheck=False)
def k_scatter_runs(acc, weights, idx, vals, sparse_lo, sparse_hi, seg_start, seg_end, seg_value, dense_vals,
                 seg_lo, seg_hi, lo, hi, chunk):
    """``acc[i] += weights[k] * v`` for every entry (i, v) of every payload k with lo <= i < hi.

    Payload k's sparse entries are ``idx/vals[sparse_lo[k]:sparse_hi[k]]``
    (indices strictly increasing); its dense segments g in
    ``[seg_lo[k], seg_hi[k])`` (ascending) cover ``acc[seg_start[g]:seg_end[g]]``
    with values from ``dense_vals[seg_value[g]]`` on. The output is walked
    chunk by chunk, payload by payload in each, so every element gets its
    additions in payload order (as the numpy path).
    """
    n = weights.size
    cur = np.empty(n, np.int64)
    end = np.empty(n, np.int64)
    seg = np.empty(n, np.int64)
    for k in range(n):
        s = sparse_lo[k]
        e = sparse_hi[k]
        cur[k] = s + np.searchsorted(idx[s:e], lo)
        end[k] = s + np.searchsorted(idx[s:e], hi)
        g = seg_lo[k]
        while g < seg_hi[k] and seg_end[g] <= lo:
            g += 1
        seg[k] = g
    c0 = lo
    while c0 < hi:
        c1 = min(c0 + chunk, hi)
        for k in range(n):
            w = weights[k]
            j = cur[k]
            e = end[k]
            while j < e and idx[j] < c1:
                acc[idx[j]] += w * vals[j]
                j += 1
            cur[k] = j
            g = seg[k]
            while g < seg_hi[k] and seg_start[g] < c1:
                shift = seg_value[g] - seg_start[g]
                for i in range(max(seg_start[g], c0), min(seg_end[g], c1)):
                    acc[i] += w * dense_vals[shift + i]
                if seg_end[g] > c1:
                    break  # the segment goes on in the next chunk
                g += 1
            seg[k] = g
        c0 = c1


@kernel(nogil=True, boundscheck=False)
def k_residual_support(w, u, idx, vals):
    """Every i with ``float32(w[i] - u[i]) != 0``, ascending, into ``idx``, and that difference
    into ``vals``; returns how many. One pass where numpy needs a subtraction, a comparison,
    a scan and a gather over all P entries; branch-free (every entry is written at the next
    free place, which only a nonzero one keeps): twice as fast as a branch on a sparse support."""
    c = 0
    for i in range(w.size):
        d = w[i] - u[i]  # float32 - float32 rounds in float32, as numpy does
        idx[c] = i
        vals[c] = d
        c += d != 0
    return c


@kernel(nogil=True, boundscheck=False)
def k_residual_support_sendable(w, u, idx, vals, pos):
    """:func:`k_residual_support`, and the positions in it of the entries that do not round to 0
    in float16 (``|d| > 2**-25``) into ``pos``; returns both counts. Branch-free as it is."""
    c = 0
    m = 0
    for i in range(w.size):
        d = w[i] - u[i]
        idx[c] = i
        vals[c] = d
        pos[m] = c
        m += abs(d) > f16_zero
        c += d != 0
    return c, m


c1, c2, s29, s32 = MIX_C1, MIX_C2, MIX_S1, MIX_S2


@kernel(nogil=True, boundscheck=False)
def mix64(i, bits):
    w = (np.uint64(i) << s32) | np.uint64(bits)
    w *= c1
    w ^= w >> s29
    w *= c2
    return w ^ (w >> s32)


@kernel(nogil=False, boundscheck=False)
def k_apply_delta(u, ubits, idx, vals, assign):
    """``u[idx] = u[idx] + vals`` (float32, rounded once) or ``= vals``; returns the change of
    ``sum_i mix64((i << 32) | bits(u[i]))`` mod 2**64 (replica.py's checksum; ``ubits`` is
    ``u`` viewed as uint32)."""
    change = np.uint64(0)
    for j in range(idx.size):
        i = idx[j]
        change -= mix64(i, ubits[i])
        if assign:
            u[i] = vals[j]
        else:
            u[i] = u[i] + vals[j]
        change += mix64(i, ubits[i])
    return change


@kernel(nogil=True, boundscheck=False)
def k_candidate_downlink(cands, w, u, ubits, offsets, limits, keep, vals, vbits, idx):
    """ps_downlink.SparseDownlink's downlink from its candidate set (``_from_candidates``, the float16
    rounding, the apply to ``u``; ps_downlink.py is the reference), bitwise the same.

    ``cands``: the candidate indices, ascending (repeats allowed). The entries of ``w - u`` among them
    that do not round to 0 in float16 go to ``keep`` (the next candidate set), ascending.
    If tensor t has more than ``limits[t]`` of them, returns (FAULT, ...): the selector must
    choose, the caller scans. Else their float16-rounded non-zero values (``vals``, with
    ``vbits`` its uint32 view) and indices (``idx``) are added to ``u``: returns (OK, kept,
    sent, the checksum change mod 2**64)."""
    c = cands
    n = 0
    prev = -1
    for j in range(c.size):
        i = c[j]
        if i == prev:
            continue
        prev = i
        r = w[i] - u[i]
        if abs(r) > f16_zero:
            keep[n] = i
            vals[n] = r
            n += 1
    t = 0
    count = 0  # kept entries of tensor t
    for j in range(n):
        while keep[j] >= offsets[t + 1]:
            if count > limits[t]:
                return FAULT, 0, 0, np.uint64(0)
            count = 0
            t += 1
        count += 1
    if count > limits[t]:
        return FAULT, 0, 0, np.uint64(0)
    m = k_round_f16_to(keep, vals, vbits, idx, n)
    return OK, n, m, k_apply_delta(u, ubits, idx[:m], vals[:m], False)


@kernel(nogil=True, boundscheck=False)
def k_round_f16_to(src, vals, vbits, dst, n):
    """The first ``n`` values (finite; ``vbits`` their uint32 view) clipped to ±65504 and rounded
    to float16, in place; an entry that rounds to 0 is left out (it would cost bytes and move
    nothing), the others moved to the front in order, their indices ``src[j]`` into ``dst``
    (``dst`` may be ``src``). Returns how many are kept."""
    m = 0
    for j in range(n):
        vals[j] = min(max(vals[j], -f16_max), f16_max)
        h = f16_bits(np.int64(vbits[j]))
        if h & 0x7FFF == 0:
            continue
        vbits[m] = f32_bits(h)
        dst[m] = src[j]
        m += 1
    return m


@kernel(nogil=True, boundscheck=False)
def k_round_f16(idx, vals, vbits):
    """ps_downlink.SparseDownlink's float16 rounding of a chosen downlink, in place: each value clipped
    to ±65504 and rounded to float16 (``vbits``: ``vals``' uint32 view); an entry that rounds to 0
    is left out, the others moved to the front in order. Returns their count, or -1 (nothing
    changed) when a value is not finite."""
    for j in range(vals.size):
        if not np.isfinite(vals[j]):
            return -1
    return k_round_f16_to(idx, vals, vbits, idx, vals.size)


def round_f16(idx: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """``vals`` (float32, finite) rounded to float16 and back, and ``idx`` (int64), without the
    entries that round to 0: views of the two arrays, changed in place; None when a value is
    not finite (nothing changed; the caller's numpy path clips and says what)."""
    m = int(kernels().round_f16(idx, vals, vals.view(np.uint32)))
    return None if m < 0 else (idx[:m], vals[:m])


def residual_support_sendable(w: np.ndarray, u: np.ndarray, idx: np.ndarray, vals: np.ndarray,
                              pos: np.ndarray) -> tuple[int, int]:
    """:func:`residual_support` and, into ``pos`` (int64, ``w.size`` long), the positions in it of the
    entries that do not round to 0 in float16; returns both counts."""
    n, m = kernels().residual_support_sendable(w, u, idx, vals, pos)
    return int(n), int(m)


def residual_support(w: np.ndarray, u: np.ndarray, idx: np.ndarray, vals: np.ndarray) -> int:
    """Indices where ``float32(w - u) != 0`` (ascending) into ``idx``, the differences into ``vals``
    (each at least ``w.size`` long); returns their count."""
    return int(kernels().residual_support(w, u, idx, vals))


def candidate_downlink(cands: np.ndarray, w: np.ndarray, u: np.ndarray, offsets: np.ndarray,
                       limits: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int] | None:
    """A float16 downlink from candidate indices, applied to ``u`` (see build): (the next
    candidates, its indices, its float32 values, the checksum change), or None when a tensor
    has more candidates than its limit (the caller scans; nothing changed)."""
    # the candidates are a few ascending runs (the last kept set, each push's indices): numpy's
    # stable sort (timsort for int64) merges them in O(n), where a quicksort, numba's included,
    # took ~0.2 ms of every push at one step per exchange (fmnist_cnn, ~7 k candidates)
    cands = np.sort(cands, kind="stable")
    keep = np.empty(cands.size, np.int64)
    vals = np.empty(cands.size, np.float32)
    idx = np.empty(cands.size, np.int64)
    status, n, m, change = kernels().candidate_downlink(cands, w, u, u.view(np.uint32), offsets, limits, keep,
                                                        vals, vals.view(np.uint32), idx)
    if status != OK:
        return None
    return keep[:n], idx[:m], vals[:m], int(change)


@kernel(nogil=False, boundscheck=False)
def k_checksum(ubits):
    """``sum_i mix64((i << 32) | ubits[i])`` mod 2**64 (``ubits``: a float32 vector as uint32)."""
    total = np.uint64(0)
    for i in range(ubits.size):
        total += mix64(i, ubits[i])
    return total


def checksum(u: np.ndarray) -> int:
    """``replica.checksum`` in one pass (a C-contiguous float32 ``u``), the same value."""
    return int(kernels().checksum(u.view(np.uint32)))


def apply_delta(u: np.ndarray, idx: np.ndarray, vals: np.ndarray, assign: bool) -> int:
    """``replica.apply_delta`` in one pass (float32 ``u``, int64 ``idx`` unique, float32 ``vals``):
    updates ``u`` in place, returns the checksum change mod 2**64."""
    return int(kernels().apply_delta(u, u.view(np.uint32), idx, vals, bool(assign)))


class Runs(NamedTuple):
    """Weighted payloads for :func:`scatter_runs`, in the order their additions are made."""

    weights: np.ndarray  # float32 [n]: payload k's factor
    idx: np.ndarray  # int64: every payload's sparse flat indices, payload after payload
    vals: np.ndarray  # float32: their values, not yet weighted
    sparse_lo: np.ndarray  # int64 [n]: payload k's sparse entries are idx[sparse_lo[k]:sparse_hi[k]]
    sparse_hi: np.ndarray  # int64 [n]
    seg_start: np.ndarray  # int64 [S]: dense segment g is acc[seg_start[g]:seg_end[g]] (a whole tensor)
    seg_end: np.ndarray  # int64 [S]
    seg_value: np.ndarray  # int64 [S]: position in dense_vals of segment g's first value
    dense_vals: np.ndarray  # float32: the dense segments' values, not yet weighted
    seg_lo: np.ndarray  # int64 [n]: payload k's segments are seg_lo[k] .. seg_hi[k] - 1
    seg_hi: np.ndarray  # int64 [n]


def scatter_runs(acc: np.ndarray, runs: Runs, lo: int, hi: int, chunk: int = CHUNK) -> None:
    """``acc[lo:hi] += Σ_k runs.weights[k] · payload k`` (see build), payload order per element."""
    kernels().scatter_runs(acc, *runs, int(lo), int(hi), int(chunk))
