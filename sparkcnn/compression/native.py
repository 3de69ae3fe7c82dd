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

    @numba.njit(cache=cache, nogil=True, boundscheck=False, inline="always")
    def read_codes(unary, rem, b, size, base, out, lo, hi, st):
        """Codes ``lo .. hi - 1`` of one sparse tensor into ``out[lo:hi]``; OK, or FAULT.

        Each code is a unary quotient q (zeros then a one in ``unary``) and a
        ``b``-bit remainder in ``rem``; gap = q << b | r, local index = previous
        + gap + 1 (first from -1), global = ``base`` + local, every local below
        ``size``. ``st`` = (next unary bit, remainder bits not yet used, their
        count, next remainder byte) carries the two streams from tensor to tensor.
        """
        clz = clz8
        n_unary = unary.size
        n_rem = rem.size
        ubit, rword, rbits, rpos = st[0], st[1], st[2], st[3]
        mask = (np.int64(1) << b) - 1
        local = np.int64(-1)
        for k in range(lo, hi):
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
        st[0], st[1], st[2], st[3] = ubit, rword, rbits, rpos
        return OK

    @numba.njit(cache=cache, nogil=True, boundscheck=False, inline="always")
    def codes_end(unary, ubit, codes):
        """OK when the unary stream ends in the byte of its last code (bit ``ubit`` - 1), with
        zero padding; without codes it must be empty."""
        n_unary = unary.size
        if codes == 0:
            return OK if n_unary == 0 else FAULT
        if n_unary != ((ubit - 1) >> 3) + 1:
            return FAULT  # bytes after the one holding the last code
        if ubit & 7 and np.int64(unary[n_unary - 1]) & (0xFF >> (ubit & 7)):
            return FAULT  # a one bit after the last code
        return OK

    @numba.njit(cache=cache, nogil=True, boundscheck=False)
    def rice_indices(unary, rem, counts, rice, bases, sizes, out):
        """Global indices of every sparse entry into ``out`` (tensor t: ``counts[t]`` codes of
        Rice parameter ``rice[t]``, see read_codes); OK, or FAULT on any inconsistency."""
        st = np.zeros(4, np.int64)
        k = 0
        for t in range(counts.size):
            if read_codes(unary, rem, rice[t], sizes[t], bases[t], out, k, k + counts[t], st) != OK:
                return FAULT
            k += counts[t]
        return codes_end(unary, st[0], k)

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
    def velocity_step_at(w, prev, vel, s, moving, changed):
        """velocity_step where the view moved: ``vel[moving] = 0``, then at ``changed``
        ``vel = (w - prev) · s; prev = w`` (``changed`` may repeat an index: prev moves after)."""
        for j in range(moving.size):
            vel[moving[j]] = 0.0
        for j in range(changed.size):
            i = changed[j]
            vel[i] = (w[i] - prev[i]) * s
        for j in range(changed.size):
            prev[changed[j]] = w[changed[j]]

    @numba.njit(cache=cache, nogil=True, boundscheck=False)
    def axpy_at(a, x, y, out, idx):
        """axpy at ``idx`` only."""
        for j in range(idx.size):
            i = idx[j]
            out[i] = a * x[i] + y[i]

    @numba.njit(cache=cache, nogil=True, boundscheck=False)
    def axpy(a, x, y, out):
        """``out = a·x + y`` in one pass (float32; the product rounded, then the sum: no FMA)."""
        for i in range(x.size):
            out[i] = a * x[i] + y[i]

    ln2 = float(np.log(2))  # numpy's, as codec._rice_start multiplies by it
    magic = np.frombuffer(b"SKCD", np.uint8).copy()

    @numba.njit(cache=cache, nogil=True, boundscheck=False, inline="always")
    def f16_bits(b):
        """float16 bits of a finite float32 (bits ``b``) of magnitude <= 65504, rounded to the
        nearest, ties to even, as numpy's cast."""
        sign = (b >> 16) & 0x8000
        a = b & 0x7FFFFFFF
        if a >= 0x38800000:  # normal in float16: rebias the exponent, keep 10 mantissa bits
            h = (a - 0x38000000) >> 13
            r = a & 0x1FFF
            if r > 0x1000 or (r == 0x1000 and h & 1):
                h += 1
            return sign | h
        e = a >> 23
        shift = 126 - e  # a subnormal float16 counts units of 2**-24
        if shift > 24:
            return sign  # below 2**-25: rounds to zero
        m = (a & 0x7FFFFF) | 0x800000
        h = m >> shift
        r = m & ((np.int64(1) << shift) - 1)
        half = np.int64(1) << (shift - 1)
        if r > half or (r == half and h & 1):
            h += 1
        return sign | h

    @numba.njit(cache=cache, nogil=True, boundscheck=False, inline="always")
    def f32_bits(h):
        """float32 bits of the float16 with bits ``h`` (finite), exactly."""
        sign = (h & 0x8000) << 16
        e = (h >> 10) & 0x1F
        m = h & 0x3FF
        if e:
            return sign | ((e + 112) << 23) | (m << 13)
        if m == 0:
            return sign
        p = 0  # highest set bit of m: the value m * 2**-24 = 1.x * 2**(p - 24)
        while (m >> (p + 1)) != 0:
            p += 1
        return sign | ((p + 103) << 23) | ((m << (23 - p)) & 0x7FFFFF)

    @numba.njit(cache=cache, nogil=True, boundscheck=False)
    def encode_delta(idx, vbits, offsets, max_rice, code, limit):
        """codec.encode in one call: (OK, the payload's bytes), or (FAULT, empty) when ``idx``
        is not strictly increasing within [0, P) or a value's magnitude bits exceed ``limit``
        (not finite, or beyond the float16 range). ``vbits``: the float32 values' bits;
        ``code``: 1 float16, 2 float32 on the wire. Bitwise what codec's numpy path writes."""
        T = offsets.size - 1
        n = idx.size
        none = np.zeros(0, np.uint8)
        prev = np.int64(-1)
        for j in range(n):
            if idx[j] <= prev:
                return FAULT, none
            prev = idx[j]
        if n and idx[n - 1] >= offsets[T]:
            return FAULT, none
        for j in range(n):
            if (np.int64(vbits[j]) & 0x7FFFFFFF) > limit:
                return FAULT, none
        bounds = np.empty(T + 1, np.int64)
        j = 0
        for t in range(T + 1):
            while j < n and idx[j] < offsets[t]:
                j += 1
            bounds[t] = j
        rice = np.zeros(T, np.int64)
        sparse = np.zeros(T, np.bool_)
        ubits = 0
        rbits = 0
        for t in range(T):
            lo = bounds[t]
            hi = bounds[t + 1]
            c = hi - lo
            if c == 0 or c == offsets[t + 1] - offsets[t]:
                continue
            sparse[t] = True
            mean = np.float64(idx[hi - 1] - offsets[t] - c + 1) / np.float64(c)
            b0 = np.int64(np.floor(np.log2(max(mean * ln2, 1.0))))
            best_b = -1
            best_bits = 0
            for shift in range(-1, 2):
                b = min(max(b0 + shift, 0), max_rice[t])
                bits = c * (1 + b)
                p = offsets[t] - 1
                for k in range(lo, hi):
                    bits += (idx[k] - p - 1) >> b
                    p = idx[k]
                if best_b < 0 or bits < best_bits:
                    best_b = b
                    best_bits = bits
            rice[t] = best_b
            ubits += best_bits - c * best_b
            rbits += c * best_b
        width = 2 if code == 1 else 4
        ulen = (ubits + 7) >> 3
        pos = 16 + 5 * T
        upos = pos + n * width
        rpos = upos + ulen
        out = np.zeros(rpos + ((rbits + 7) >> 3), np.uint8)
        out[:4] = magic
        out[4] = 1
        out[5] = code
        for s in range(4):
            out[8 + s] = (T >> (8 * s)) & 0xFF
            out[12 + s] = (ulen >> (8 * s)) & 0xFF
        for t in range(T):
            c = bounds[t + 1] - bounds[t]
            for s in range(4):
                out[16 + 4 * t + s] = (c >> (8 * s)) & 0xFF
            out[16 + 4 * T + t] = rice[t]
        for part in range(2):  # values: the dense tensors' first, then the sparse ones'
            for t in range(T):
                if sparse[t] != (part == 1):
                    continue
                for k in range(bounds[t], bounds[t + 1]):
                    v = np.int64(vbits[k])
                    if code == 1:
                        v = f16_bits(v)
                    for s in range(width):
                        out[pos + s] = (v >> (8 * s)) & 0xFF
                    pos += width
        ubit = upos * 8
        rbit = rpos * 8
        for t in range(T):
            if not sparse[t]:
                continue
            b = rice[t]
            mask = (np.int64(1) << b) - 1
            p = offsets[t] - 1
            for k in range(bounds[t], bounds[t + 1]):
                gap = idx[k] - p - 1
                p = idx[k]
                ubit += gap >> b  # q zeros, then a one
                out[ubit >> 3] |= np.uint8(0x80 >> (ubit & 7))
                ubit += 1
                r = gap & mask
                for i in range(b - 1, -1, -1):  # b bits, most significant first
                    if (r >> i) & 1:
                        out[rbit >> 3] |= np.uint8(0x80 >> (rbit & 7))
                    rbit += 1
        return OK, out

    @numba.njit(cache=cache, nogil=True, boundscheck=False)
    def decode_delta(buf, offsets, max_rice):
        """codec.decode in one call: (OK, indices, float32 bits of the values) in tensor order, or
        (FAULT, empty, empty) on anything codec's numpy path refuses (which then says what)."""
        T = offsets.size - 1
        L = buf.size
        no_i = np.zeros(0, np.int64)
        no_v = np.zeros(0, np.uint32)
        if L < 16 + 5 * T:
            return FAULT, no_i, no_v
        for s in range(4):
            if buf[s] != magic[s]:
                return FAULT, no_i, no_v
        code = buf[5]
        if buf[4] != 1 or (code != 1 and code != 2) or buf[6] or buf[7]:
            return FAULT, no_i, no_v
        nt = np.int64(0)
        ulen = np.int64(0)
        for s in range(4):
            nt |= np.int64(buf[8 + s]) << (8 * s)
            ulen |= np.int64(buf[12 + s]) << (8 * s)
        if nt != T:
            return FAULT, no_i, no_v
        counts = np.empty(T, np.int64)
        n = np.int64(0)
        n_dense = np.int64(0)
        rbits = np.int64(0)
        for t in range(T):
            c = np.int64(0)
            for s in range(4):
                c |= np.int64(buf[16 + 4 * t + s]) << (8 * s)
            size = offsets[t + 1] - offsets[t]
            b = np.int64(buf[16 + 4 * T + t])
            if c > size or b > max_rice[t] or (b and (c == 0 or c == size)):
                return FAULT, no_i, no_v
            counts[t] = c
            n += c
            if c == size:
                n_dense += c
            rbits += c * b
        width = 2 if code == 1 else 4
        pos = 16 + 5 * T
        upos = pos + n * width
        rpos = upos + ulen
        if L != rpos + ((rbits + 7) >> 3):
            return FAULT, no_i, no_v
        idx = np.empty(n, np.int64)
        vals = np.empty(n, np.uint32)
        dpos = pos  # the dense tensors' values, then the sparse ones'
        spos = pos + n_dense * width
        unary = buf[upos:rpos]
        rem = buf[rpos:]
        st = np.zeros(4, np.int64)
        k = 0
        for t in range(T):
            c = counts[t]
            size = offsets[t + 1] - offsets[t]
            dense = c == size
            vp = dpos if dense else spos
            for j in range(c):
                v = np.int64(0)
                for s in range(width):
                    v |= np.int64(buf[vp + s]) << (8 * s)
                vp += width
                if code == 1:
                    if (v & 0x7C00) == 0x7C00:
                        return FAULT, no_i, no_v
                    v = f32_bits(v)
                elif (v & 0x7F800000) == 0x7F800000:
                    return FAULT, no_i, no_v
                vals[k + j] = v
            if dense:
                dpos = vp
                for j in range(c):
                    idx[k + j] = offsets[t] + j
            else:
                spos = vp
                if read_codes(unary, rem, np.int64(buf[16 + 4 * T + t]), size, offsets[t], idx, k, k + c, st) != OK:
                    return FAULT, no_i, no_v
            k += c
        if codes_end(unary, st[0], n - n_dense) != OK:
            return FAULT, no_i, no_v
        return OK, idx, vals

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

    f16_zero = np.float32(2.0**-25)  # the largest magnitude that rounds to 0 in float16
    f16_max = np.float32(65504.0)

    @numba.njit(cache=cache, nogil=True, boundscheck=False)
    def candidate_downlink(cands, w, u, ubits, offsets, limits, keep, vals, vbits, idx):
        """ps.ParameterServer's downlink from its candidate set (``_from_candidates``, the float16
        rounding, the apply to ``u``; ps.py is the reference), bitwise the same.

        ``cands``: the candidate indices (repeats allowed). The entries of ``w - u`` among them
        that do not round to 0 in float16 go to ``keep`` (the next candidate set), ascending.
        If tensor t has more than ``limits[t]`` of them, returns (FAULT, ...): the selector must
        choose, the caller scans. Else their float16-rounded non-zero values (``vals``, with
        ``vbits`` its uint32 view) and indices (``idx``) are added to ``u``: returns (OK, kept,
        sent, the checksum change mod 2**64)."""
        c = np.sort(cands)
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
        m = 0
        for j in range(n):
            vals[j] = min(max(vals[j], -f16_max), f16_max)
            h = f16_bits(np.int64(vbits[j]))
            if h & 0x7FFF == 0:
                continue  # underflowed to 0: would cost bytes and move nothing
            vbits[m] = f32_bits(h)
            idx[m] = keep[j]
            m += 1
        return OK, n, m, apply_delta(u, ubits, idx[:m], vals[:m], False)

    return SimpleNamespace(rice_indices=rice_indices, scatter_runs=scatter_runs, residual_support=residual_support,
                           momentum_step=momentum_step, abs_at_least=abs_at_least,
                           velocity_step=velocity_step, axpy=axpy, candidate_downlink=candidate_downlink, velocity_step_at=velocity_step_at,
                           axpy_at=axpy_at, apply_delta=apply_delta,
                           encode_delta=encode_delta, decode_delta=decode_delta)


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


def encode_delta(idx: np.ndarray, vals: np.ndarray, offsets: np.ndarray, max_rice: np.ndarray, code: int,
                 limit: int) -> bytes | None:
    """A whole payload from the compiled encoder (see _compile), or None when the delta is refused
    (indices not strictly increasing in range, or a value whose magnitude bits exceed ``limit``)."""
    status, out = _load().encode_delta(idx, vals.view(np.uint32), offsets, max_rice, code, limit)
    return out.tobytes() if status == OK else None


def decode_delta(data, offsets: np.ndarray, max_rice: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(indices, float32 values) of a payload from the compiled decoder (see _compile), or None
    when anything in it is refused (the codec's numpy path then says what)."""
    status, idx, bits = _load().decode_delta(np.frombuffer(data, np.uint8), offsets, max_rice)
    return (idx, bits.view(np.float32)) if status == OK else None


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


def velocity_step_at(w: np.ndarray, prev: np.ndarray, vel: np.ndarray, s: float, moving: np.ndarray,
                     changed: np.ndarray) -> None:
    """``vel[moving] = 0``, then ``velocity_step`` at the indices ``changed`` (int64) only."""
    _load().velocity_step_at(w, prev, vel, np.float32(s), moving, changed)


def axpy_at(a: float, x: np.ndarray, y: np.ndarray, out: np.ndarray, idx: np.ndarray) -> None:
    """``out[idx] = float32(a) · x[idx] + y[idx]``, bitwise as numpy's."""
    _load().axpy_at(np.float32(a), x, y, out, idx)


def candidate_downlink(cands: np.ndarray, w: np.ndarray, u: np.ndarray, offsets: np.ndarray,
                       limits: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int] | None:
    """A float16 downlink from candidate indices, applied to ``u`` (see _compile): (the next
    candidates, its indices, its float32 values, the checksum change), or None when a tensor
    has more candidates than its limit (the caller scans; nothing changed)."""
    keep = np.empty(cands.size, np.int64)
    vals = np.empty(cands.size, np.float32)
    idx = np.empty(cands.size, np.int64)
    status, n, m, change = _load().candidate_downlink(cands, w, u, u.view(np.uint32), offsets, limits, keep, vals,
                                                      vals.view(np.uint32), idx)
    if status != OK:
        return None
    return keep[:n], idx[:m], vals[:m], int(change)


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
