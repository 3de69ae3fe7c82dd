"""Compiled wire codec: Rice index coding both ways, float16 rounding, whole payloads.

One compiled call per direction (``encode_delta``, ``decode_delta``) writes
and reads the bytes of codec_format.py's layout, bitwise what codec's numpy
path writes and reads; ``rice_indices`` decodes just the index stream, for
the driver's batched decode (codec_frame.py). A sparse tensor's local indices
are coded as gaps ``gap_0 = i_0``, ``gap_j = i_j - i_{j-1} - 1``, each gap as
a unary quotient ``q = gap >> b`` (q zeros, then a one) and a ``b``-bit
remainder ``r = gap & (2**b - 1)``, MSB first.

The float16 rounding (``f16_bits``, ``f32_bits``) is also the parameter
server's (native_server.candidate_downlink): it is compiled once, here.
"""

from __future__ import annotations

import numpy as np

from .native_compile import FAULT, OK, kernel, kernels


# Leading zeros of a byte: position of its first one bit, MSB first (8 for 0).
clz8 = np.array([8] + [7 - int(v).bit_length() + 1 for v in range(1, 256)], dtype=np.int64)


@kernel(nogil=True, boundscheck=False, inline="always")
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


@kernel(nogil=True, boundscheck=False, inline="always")
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


@kernel(nogil=True, boundscheck=False)
def k_rice_indices(unary, rem, counts, rice, bases, sizes, out):
    """Global indices of every sparse entry into ``out`` (tensor t: ``counts[t]`` codes of
    Rice parameter ``rice[t]``, see read_codes); OK, or FAULT on any inconsistency."""
    st = np.zeros(4, np.int64)
    k = 0
    for t in range(counts.size):
        if read_codes(unary, rem, rice[t], sizes[t], bases[t], out, k, k + counts[t], st) != OK:
            return FAULT
        k += counts[t]
    return codes_end(unary, st[0], k)


ln2 = float(np.log(2))  # numpy's, as codec_format._rice_start multiplies by it
magic = np.frombuffer(b"SKCD", np.uint8).copy()


@kernel(nogil=True, boundscheck=False, inline="always")
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


@kernel(nogil=True, boundscheck=False, inline="always")
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


@kernel(nogil=False, boundscheck=False)
def k_encode_delta(idx, vbits, offsets, max_rice, code, limit):
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


@kernel(nogil=False, boundscheck=False)
def k_decode_delta(buf, offsets, max_rice):
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
            b = np.int64(buf[16 + 4 * T + t])  # the tensor's Rice parameter
            if read_codes(unary, rem, b, size, offsets[t], idx, k, k + c, st) != OK:
                return FAULT, no_i, no_v
        k += c
    if codes_end(unary, st[0], n - n_dense) != OK:
        return FAULT, no_i, no_v
    return OK, idx, vals


def rice_indices(unary, rem, counts, rice, bases, sizes, out) -> bool:
    """Run the compiled decoder (see build); True when the stream is consistent."""
    return kernels().rice_indices(unary, rem, counts, rice, bases, sizes, out) == OK


def encode_delta(idx: np.ndarray, vals: np.ndarray, offsets: np.ndarray, max_rice: np.ndarray, code: int,
                 limit: int) -> bytes | None:
    """A whole payload from the compiled encoder (see build), or None when the delta is refused
    (indices not strictly increasing in range, or a value whose magnitude bits exceed ``limit``)."""
    status, out = kernels().encode_delta(idx, vals.view(np.uint32), offsets, max_rice, code, limit)
    return out.tobytes() if status == OK else None


def decode_delta(data, offsets: np.ndarray, max_rice: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(indices, float32 values) of a payload from the compiled decoder (see build), or None
    when anything in it is refused (the codec's numpy path then says what)."""
    status, idx, bits = kernels().decode_delta(np.frombuffer(data, np.uint8), offsets, max_rice)
    return (idx, bits.view(np.float32)) if status == OK else None
