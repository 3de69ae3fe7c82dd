"""Compiled loops for the driver's hot path: Rice index decoding and the blocked scatter-add.

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
payload's entries in the chunk, payload by payload), cut the driver's
decode+sum of 256 × 25 M-parameter deltas from ~0.3 s to well under 0.1 s on
a 2-vCPU VM (bench/scale.py reports both paths side by side).
"""

from __future__ import annotations

import os
import threading

import numpy as np

_lock = threading.Lock()
_kernels = None  # (rice_indices, scatter_runs) once compiled, False when unavailable

# Output floats per chunk of the blocked add: 64 Ki float32 = 256 KiB, which
# stays in L2 while every payload adds its entries of the chunk.
CHUNK = 1 << 16

OK, FAULT = 0, 1


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
    def scatter_runs(acc, idx, vals, starts, lo, hi, chunk):
        """``acc[idx[j]] += vals[j]`` for every j with lo <= idx[j] < hi.

        ``idx[starts[k]:starts[k + 1]]`` is payload k's run, strictly
        increasing. Each output element gets its additions in payload order
        (as the numpy path), while the output is walked chunk by chunk.
        """
        n = starts.size - 1
        cur = np.empty(n, np.int64)
        end = np.empty(n, np.int64)
        for k in range(n):
            s = starts[k]
            e = starts[k + 1]
            cur[k] = s + np.searchsorted(idx[s:e], lo)
            end[k] = s + np.searchsorted(idx[s:e], hi)
        c0 = lo
        while c0 < hi:
            c1 = min(c0 + chunk, hi)
            for k in range(n):
                j = cur[k]
                e = end[k]
                while j < e and idx[j] < c1:
                    acc[idx[j]] += vals[j]
                    j += 1
                cur[k] = j
            c0 = c1

    return rice_indices, scatter_runs


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
    return _load()[0](unary, rem, counts, rice, bases, sizes, out) == OK


def scatter_runs(acc, idx, vals, starts, lo: int, hi: int, chunk: int = CHUNK) -> None:
    _load()[1](acc, idx, vals, starts, lo, hi, chunk)
