"""Compiled loops for the hot paths: Rice index coding both ways, the blocked weighted add, the
support of the parameter server's residual, a downlink's apply with its checksum change, and the
worker's per-step passes (momentum, threshold, extrapolation).

numba compiles them on first use (cached on disk afterwards); importing this
module imports nothing heavy. Where numba is missing, or ``SPARKCNN_NATIVE=0``,
``enabled()`` is False and the codec and sparse_sum keep their numpy paths,
which are the reference: both paths give bitwise equal results
(tests/test_codec.py), and on bad input the compiled decoder only reports
*that* something is wrong, the numpy decoder then says what.

Why compiled: numpy needs ~10 passes over each index stream (unpack the bits,
find the ones, gather the remainders, cumulative sums, bound checks), and its
scattered add touches a new page per entry at density 0.001. One pass over
the bits, then an add that walks the output in cache-sized chunks (every
payload's entries in the chunk, payload by payload), make the driver's
whole apply of 256 × 25 M-parameter deltas 0.18 s against 0.27 s on the
numpy path on a 2-vCPU VM (bench/scale.py reports both side by side).

No fast-math: ``acc[i] += w * v`` rounds the product and the sum separately
(no fused multiply-add), as numpy does, which the bitwise tests check.
"""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np

_lock = threading.Lock()
_kernels = None  # the compiled kernels by name (see _compile) once compiled, False when unavailable

# Output floats per chunk of the blocked add: 64 Ki float32 = 256 KiB, which
# stays in L2 while every payload adds its entries of the chunk.
CHUNK = 1 << 16

OK, FAULT = 0, 1

# The checksum's mixing of one (index, float32 bits) word (replica.py), for both paths:
#   w *= C1; w ^= w >> S1; w *= C2; w ^= w >> S2   (uint64, wrapping)
MIX_C1, MIX_C2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
MIX_S1, MIX_S2 = np.uint64(29), np.uint64(32)


def _compile(cache: bool):
    import numba

    # Leading zeros of a byte: position of its first one bit, MSB first (8 for 0).
    clz8 = np.array([8] + [7 - int(v).bit_length() + 1 for v in range(1, 256)], dtype=np.int64)

    @numba.njit(cache=cache, nogil=True, boundscheck=False)
    def rice_indices(unary, rem, counts, rice, bases, sizes, out):
        """Global indices of every sparse entry into ``out``; OK, or FAULT on any inconsistency.

        Per sparse tensor t: ``counts[t]`` codes, each a unary quotient q
        (zeros then a one in ``unary``) and a ``rice[t]``-bit remainder in
        ``rem``; gap = q << b | r, local index = previous + gap + 1 (first
        from -1), global = ``bases[t]`` + local, every local below ``sizes[t]``.
        The unary stream must end in the byte of its last code, with zero padding.
        """
        clz = clz8
        n_unary = unary.size
        n_rem = rem.size
        ubit = 0
        rword = np.int64(0)  # remainder bits not yet used: the low rbits of rword
        rbits = 0
        rpos = 0
        k = 0
        for t in range(counts.size):
            b = rice[t]
            size = sizes[t]
            base = bases[t]
            mask = (np.int64(1) << b) - 1
            local = np.int64(-1)
            for _ in range(counts[t]):
                byte_i = ubit >> 3
                if byte_i >= n_unary:
                    return FAULT
                cur = np.int64(unary[byte_i]) & (0xFF >> (ubit & 7))
                while cur == 0:
                    byte_i += 1
                    if byte_i >= n_unary:
                        return FAULT
                    cur = np.int64(unary[byte_i])
                one = byte_i * 8 + clz[cur]
                q = one - ubit
                ubit = one + 1
                if q >= size:
                    return FAULT
                r = np.int64(0)
                if b:
                    while rbits < b:  # refill the remainder bit buffer a byte at a time
                        rword = (rword << 8) | (np.int64(rem[rpos]) if rpos < n_rem else 0)
                        rpos += 1
                        rbits += 8
                    rbits -= b
                    r = (rword >> rbits) & mask
                    rword &= (np.int64(1) << rbits) - 1
                local += ((q << b) | r) + 1
                if local >= size:
                    return FAULT
                out[k] = base + local
                k += 1
        if k == 0:
            return OK if n_unary == 0 else FAULT
        if n_unary != ((ubit - 1) >> 3) + 1:
            return FAULT  # bytes after the one holding the last code
        if ubit & 7 and np.int64(unary[n_unary - 1]) & (0xFF >> (ubit & 7)):
            return FAULT  # a one bit after the last code
        return OK

    @numba.njit(cache=cache, nogil=True, boundscheck=False)
    def scatter_runs(acc, weights, idx, vals, sparse_lo, sparse_hi, seg_start, seg_end, seg_value, dense_vals,
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

    @numba.njit(cache=cache, nogil=True, boundscheck=False)
    def residual_support(w, u, idx, vals):
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

    @numba.njit(cache=cache, nogil=True, boundscheck=False)
    def rice_encode(idx, vals, bounds, offsets, sparse, b0, max_rice, out_vals, rice):
        """The encoder's streams in one pass per sparse tensor (codec.encode is the reference).

        Per tensor t, ``idx[bounds[t]:bounds[t + 1]]`` are its entries; ``sparse[t]`` says it
        is coded by gaps. Its Rice parameter: of ``b0[t] + (-1, 0, 1)``, each clipped to
        ``[0, max_rice[t]]``, the first with the fewest bits ``count (1 + b) + sum(gap >> b)``,
        into ``rice[t]``. ``out_vals``: the dense tensors' values, then the sparse ones, in
        tensor order. Returns the unary and remainder streams (MSB first, zero-padded).
        """
        T = sparse.size
        ubits = 0
        rbits = 0
        for t in range(T):
            if not sparse[t]:
                continue
            lo = bounds[t]
            hi = bounds[t + 1]
            best_b = -1
            best_bits = 0
            for shift in range(-1, 2):
                b = min(max(b0[t] + shift, 0), max_rice[t])
                bits = (hi - lo) * (1 + b)
                prev = offsets[t] - 1
                for j in range(lo, hi):
                    bits += (idx[j] - prev - 1) >> b
                    prev = idx[j]
                if best_b < 0 or bits < best_bits:
                    best_b = b
                    best_bits = bits
            rice[t] = best_b
            ubits += best_bits - (hi - lo) * best_b
            rbits += (hi - lo) * best_b
        unary = np.zeros((ubits + 7) >> 3, np.uint8)
        rem = np.zeros((rbits + 7) >> 3, np.uint8)
        ubit = 0
        rbit = 0
        k = 0
        for t in range(T):  # dense tensors' values first
            if not sparse[t]:
                for j in range(bounds[t], bounds[t + 1]):
                    out_vals[k] = vals[j]
                    k += 1
        for t in range(T):
            if not sparse[t]:
                continue
            b = rice[t]
            mask = (np.int64(1) << b) - 1
            prev = offsets[t] - 1
            for j in range(bounds[t], bounds[t + 1]):
                out_vals[k] = vals[j]
                k += 1
                gap = idx[j] - prev - 1
                prev = idx[j]
                ubit += gap >> b  # q zeros, then a one
                unary[ubit >> 3] |= np.uint8(0x80 >> (ubit & 7))
                ubit += 1
                r = gap & mask
                for i in range(b - 1, -1, -1):  # b bits, most significant first
                    if (r >> i) & 1:
                        rem[rbit >> 3] |= np.uint8(0x80 >> (rbit & 7))
                    rbit += 1
        return unary, rem

    @numba.njit(cache=cache, nogil=True, boundscheck=False)
    def momentum_step(u, v, g, m):
        """``u = m·u + g; v += u`` in one pass (DGC's momentum correction), rounding the
        product, then each sum, in float32 as numpy's three passes do."""
        for i in range(u.size):
            ui = u[i] * m
            ui = ui + g[i]
            u[i] = ui
            v[i] = v[i] + ui

    @numba.njit(cache=cache, nogil=True, boundscheck=False)
    def abs_at_least(x, thr, out):
        """Every i with ``|x[i]| >= thr``, ascending, into ``out``; returns how many."""
        c = 0
        for i in range(x.size):
            if abs(x[i]) >= thr:  # rare (density <= a few %): a branch that predicts well
                out[c] = i
                c += 1
        return c

    @numba.njit(cache=cache, nogil=True, boundscheck=False)
    def velocity_step(w, prev, vel, s):
        """``vel = (w - prev) · s; prev = w`` in one pass (float32, each operation rounded)."""
        for i in range(w.size):
            vel[i] = (w[i] - prev[i]) * s
            prev[i] = w[i]

    @numba.njit(cache=cache, nogil=True, boundscheck=False)
    def axpy(a, x, y, out):
        """``out = a·x + y`` in one pass (float32; the product rounded, then the sum: no FMA)."""
        for i in range(x.size):
            out[i] = a * x[i] + y[i]

    c1, c2, s29, s32 = MIX_C1, MIX_C2, MIX_S1, MIX_S2

    @numba.njit(cache=cache, nogil=True, boundscheck=False)
    def mix64(i, bits):
        w = (np.uint64(i) << s32) | np.uint64(bits)
        w *= c1
        w ^= w >> s29
        w *= c2
        return w ^ (w >> s32)

    @numba.njit(cache=cache, nogil=True, boundscheck=False)
    def apply_delta(u, ubits, idx, vals, assign):
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

    return SimpleNamespace(rice_indices=rice_indices, scatter_runs=scatter_runs, residual_support=residual_support,
                           rice_encode=rice_encode, momentum_step=momentum_step, abs_at_least=abs_at_least,
                           velocity_step=velocity_step, axpy=axpy, apply_delta=apply_delta)


def _load():
    global _kernels
    if _kernels is None:
        with _lock:
            if _kernels is None:
                try:
                    try:
                        _kernels = _compile(cache=True)
                    except RuntimeError:  # no writable cache directory: compile each run
                        _kernels = _compile(cache=False)
                except ImportError:
                    _kernels = False
    return _kernels


def enabled() -> bool:
    """True when the compiled kernels are in use (numba importable, ``SPARKCNN_NATIVE`` not 0)."""
    if os.environ.get("SPARKCNN_NATIVE", "1") == "0":
        return False
    return bool(_load())


def rice_indices(unary, rem, counts, rice, bases, sizes, out) -> bool:
    """Run the compiled decoder (see _compile); True when the stream is consistent."""
    return _load().rice_indices(unary, rem, counts, rice, bases, sizes, out) == OK


def rice_encode(idx, vals, bounds, offsets, sparse, b0, max_rice, out_vals, rice) -> tuple[np.ndarray, np.ndarray]:
    """Run the compiled encoder (see _compile): fills ``out_vals`` and ``rice``, returns the
    unary and remainder streams as uint8 arrays."""
    return _load().rice_encode(idx, vals, bounds, offsets, sparse, b0, max_rice, out_vals, rice)


def residual_support(w: np.ndarray, u: np.ndarray, idx: np.ndarray, vals: np.ndarray) -> int:
    """Indices where ``float32(w - u) != 0`` (ascending) into ``idx``, the differences into ``vals``
    (each at least ``w.size`` long); returns their count."""
    return int(_load().residual_support(w, u, idx, vals))


def momentum_step(u: np.ndarray, v: np.ndarray, g: np.ndarray, m: np.float32) -> None:
    """``u = m·u + g; v += u`` in place (float32 arrays of one size), bitwise as numpy."""
    _load().momentum_step(u, v, g, np.float32(m))


def abs_at_least(x: np.ndarray, thr: np.float32) -> np.ndarray:
    """``np.flatnonzero(np.abs(x) >= thr)`` in one pass, without the temporaries."""
    out = np.empty(x.size, np.int64)
    return out[:_load().abs_at_least(x, np.float32(thr), out)]


def velocity_step(w: np.ndarray, prev: np.ndarray, vel: np.ndarray, s: float) -> None:
    """``vel = (w - prev) · s; prev[:] = w`` in place (float32 arrays), bitwise as numpy."""
    _load().velocity_step(w, prev, vel, np.float32(s))


def axpy(a: float, x: np.ndarray, y: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out = float32(a) · x + y`` (float32 arrays), bitwise as numpy's multiply then add."""
    _load().axpy(np.float32(a), x, y, out)
    return out


def apply_delta(u: np.ndarray, idx: np.ndarray, vals: np.ndarray, assign: bool) -> int:
    """``replica.apply_delta`` in one pass (float32 ``u``, int64 ``idx`` unique, float32 ``vals``):
    updates ``u`` in place, returns the checksum change mod 2**64."""
    return int(_load().apply_delta(u, u.view(np.uint32), idx, vals, bool(assign)))


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
    """``acc[lo:hi] += Σ_k runs.weights[k] · payload k`` (see _compile), payload order per element."""
    _load().scatter_runs(acc, *runs, int(lo), int(hi), int(chunk))
