"""The parameter server's sparse downlink: which entries of the residual it sends.

Per tensor t of size n_t, with ``R = float32(W - U)`` and ``k_t = target_count(n_t, d)``
(see :meth:`SparseDownlink._select`), ``D`` is the k_t largest ``|R|`` among ``R != 0``, as
``sparsifier.select(R, layout, d)`` would choose them, minus its zeros; a float16 server
rounds the values and drops those that round to 0 (:meth:`SparseDownlink._round_f16`).
``U[D.idx] = float32(U[D.idx] + D.values)`` then moves the view.

The choice is made on the support of ``R`` only, not on all P entries: right after a
downlink ``R`` is zero except where updates landed. A float16 server goes further and keeps
a candidate set, the indices applied since (and sent in) the last downlink, which often
settles the choice alone (:meth:`SparseDownlink._from_candidates`): outside it every entry
is a crumb that float16 rounds to 0. Both short cuts send what the full scan sends, bitwise.
"""

from __future__ import annotations

import math
import time

import numpy as np

from sparkcnn.compression import native, native_server
from sparkcnn.compression.codec_format import FLOAT16_MAX
from sparkcnn.compression.delta import SparseDelta, layout_offsets
from sparkcnn.compression.sparsify import TOLERANCE, Sparsifier, target_count
from sparkcnn.replica import apply_delta

# The largest magnitude that rounds to 0 in float16: 2**-25 lies halfway between 0 and the
# smallest subnormal 2**-24 and rounds to the even one, 0.
FLOAT16_ZERO = np.float32(2.0**-25)


class CandidateSet:
    """Where ``W`` moved since the last downlink: sorted runs of indices, or unknown (the next
    downlink scans). Kept in this process; a :class:`~sparkcnn.server.sharedstore.SharedStore`
    keeps one for every process that moves the same ``W``. ``limit``: more entries than this
    (repeats counted) and a scan is cheaper: the set becomes unknown."""

    def __init__(self, limit: int):
        self.limit = limit
        self._runs: list[np.ndarray] | None = None
        self._count = 0  # entries in the runs (with repeats)

    @property
    def known(self) -> bool:
        return self._runs is not None

    @property
    def runs(self) -> int:
        return len(self._runs)

    def add(self, idx: np.ndarray) -> None:
        """A sparse update moved ``W`` at ``idx`` (sorted)."""
        if self._runs is not None:
            self._runs.append(idx.copy())  # the caller's buffer may be reused
            self._count += idx.size
            if self._count > self.limit:
                self._runs = None

    def forget(self) -> None:
        self._runs = None

    def restart(self, c: np.ndarray) -> None:
        """The set is ``c`` (sorted, unique) and what later updates add."""
        self._runs, self._count = [c], c.size

    def indices(self) -> np.ndarray:
        """The runs, one after another (not merged)."""
        return np.concatenate(self._runs)


class SparseDownlink:
    """The sparse downlink of one :class:`~sparkcnn.ps.ParameterServer`: chooses ``D`` and moves ``U``.

    ``W`` and ``U`` are the server's own arrays, moved in place (by the server's applies and
    by :meth:`move`), never copied; the server calls under its lock.
    """

    def __init__(self, W: np.ndarray, U: np.ndarray, layout: tuple[int, ...], sparsifier: Sparsifier,
                 value_dtype: str, *, candidates: bool = True, candidate_set=None) -> None:
        self._W, self._U = W, U
        self.layout = layout
        self._offsets = layout_offsets(layout)
        self.sparsifier = sparsifier
        # The same method on the support of one tensor, whose size says nothing about dense_below.
        self._on_support = Sparsifier(sparsifier.method, 0, rng=sparsifier.rng)
        # Values are rounded to this dtype before U moves, matching a codec that ships them so
        # (float16 halves downlink bytes).
        self.value_dtype = value_dtype
        # whether the candidate set may settle a downlink (False: every downlink scans, the same D;
        # ``ps.downlink_candidates``, for benchmarks of what the short cut saves)
        self.candidates = candidates
        self.select_cpu_s = 0.0  # thread CPU of the last downlink's scan in _select (0: none)
        self._support_buf: tuple[np.ndarray, np.ndarray] | None = None  # for _residual_support
        self._sendable_buf: np.ndarray | None = None  # for _residual_support(sendable=True)
        # float16 downlinks: every i with float16(W[i] - U[i]) != 0 is in this set (unknown: the
        # next downlink scans; see _from_candidates). ``candidate_set``: one that every process
        # moving this W keeps (its creator started it, when W == U); else this one's, with W == U
        self._limits: tuple[float, np.ndarray] | None = None  # (density, _candidate_limits of it)
        if candidate_set is not None and self._tracks_candidates():
            self._candidates = candidate_set
        else:
            self._candidates = CandidateSet(W.size // 4)
            if self._tracks_candidates():
                self._restart_candidates(np.empty(0, np.int64))

    def applied(self, idx: np.ndarray) -> None:
        """A sparse update moved ``W`` at ``idx`` (sorted): they join the candidate set."""
        self._candidates.add(idx)  # no downlink for long: unknown, a scan is cheaper

    def forget(self) -> None:
        """``W`` moved anywhere (a dense update, a reload): the next downlink scans."""
        self._candidates.forget()

    def move(self, density_down: float) -> tuple[SparseDelta, int]:
        """``D`` at ``density_down``, applied to ``U``: (D, the change of U's checksum)."""
        self.select_cpu_s = 0.0
        if not self.candidates:
            return self._sparse_downlink(density_down, candidates=False)
        # the compiled candidate path settles it, or tells that the candidate set cannot
        # (numpy's _from_candidates would then say the same): the scan chooses
        compiled = self._candidates.known and native.enabled()
        return ((self._compiled_candidates(density_down) if compiled else None)
                or self._sparse_downlink(density_down, candidates=not compiled))

    def _sparse_downlink(self, density_down: float, candidates: bool = True) -> tuple[SparseDelta, int]:
        """``D`` (see the module docstring) applied to ``U``: (D, the checksum change).
        ``candidates``: whether :meth:`_select` may try the candidate set first."""
        idx, values = self._select(density_down, candidates)
        if self.value_dtype == "float16":
            idx, values = self._round_f16(idx, values)
        delta = SparseDelta(self._W.size, idx, values)
        return delta, apply_delta(self._U, delta, assign=False)

    @staticmethod
    def _round_f16(idx: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``values`` rounded to float16 (clipped to its range) and back, without the entries that
        underflow to 0 (they would cost bytes and move nothing). Compiled, in place, where it can:
        in the density warm-up a downlink has ~50 k entries, and numpy's three passes took ~0.8 ms
        of each push (fmnist_cnn, density 0.25). ``idx`` and ``values`` are the caller's own."""
        if native.enabled():
            got = native_server.round_f16(idx, values)
            if got is not None:
                return got
        values = np.clip(values, -FLOAT16_MAX, FLOAT16_MAX).astype(np.float16).astype(np.float32)
        keep = values != 0
        return idx[keep], values[keep]

    def _compiled_candidates(self, density_down: float) -> tuple[SparseDelta, int] | None:
        """:meth:`_sparse_downlink` when :meth:`_from_candidates` settles it, in one compiled call
        (``native_server.candidate_downlink``, bitwise the same); None otherwise (nothing changed).
        The caller checks that there is a candidate set and that the kernels are enabled."""
        got = native_server.candidate_downlink(self._candidates.indices(), self._W, self._U,
                                               self._offsets, self._candidate_limits(density_down))
        if got is None:
            return None
        kept, idx, values, change = got
        self._restart_candidates(kept)
        return SparseDelta(self._W.size, idx, values), change

    def _select(self, density_down: float, candidates: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Indices and float32 values of ``D``: per tensor t of size n_t, the k_t largest |R| among R != 0.

            R_t   = float32(W - U)_t,  k_t = target_count(n_t, density_down)
            idx_t = support(R_t)                      if |support(R_t)| <= k_t (or the tensor is sent whole)
                    sparsifier on R_t[support(R_t)]   with density k_t / |support(R_t)| otherwise
            D     = R[idx]

        The same choice as ``sparsifier.select(float32(W - U), layout, d)``
        minus its zeros, computed on the support of ``R`` only: right after a
        downlink ``R`` is zero except where updates landed, and a sampled
        threshold over mostly-zero tensors degrades to a full partition
        (measured at 25 M parameters: 3 s per downlink that way, 0.1 s this way).
        """
        fast = self._from_candidates(density_down) if candidates else None
        if fast is not None:
            return fast
        c0 = time.thread_time()  # the scan's CPU, for the exchange record (select_cpu_s)
        sendable = None  # float16 downlinks: positions in the support of the entries that do not round to 0
        if self._tracks_candidates():
            support, r, sendable = self._residual_support(sendable=True)
            self._restart_candidates(support[sendable])  # what the next downlink can send is among these
        else:
            support, r = self._residual_support()
        bounds = np.searchsorted(support, self._offsets)
        if sendable is not None:
            sendable_bounds = np.searchsorted(sendable, bounds)
        idx, vals = [], []
        for t, n in enumerate(self.layout):
            lo, hi = int(bounds[t]), int(bounds[t + 1])
            k = target_count(n, density_down)
            if hi - lo > k and not self.sparsifier.sends_whole(n, density_down):
                keep = None
                if sendable is not None:
                    keep = self._sendable(sendable[sendable_bounds[t]:sendable_bounds[t + 1]], k)
                if keep is None:
                    keep = self._on_support.indices(r[lo:hi], (hi - lo,), k / (hi - lo)) + lo
                idx.append(support[keep])
                vals.append(r[keep])
            else:
                idx.append(support[lo:hi])
                vals.append(r[lo:hi])
        out = np.concatenate(idx), np.concatenate(vals)
        self.select_cpu_s = time.thread_time() - c0
        return out

    @staticmethod
    def _sendable(sendable: np.ndarray, k: int) -> np.ndarray | None:
        """``sendable``, the positions in the residual support of one tensor's entries whose
        float16 rounding is not 0, when there are at most ``(1 - TOLERANCE) k`` of them; else None.

        Every selector keeps the c largest ``|r|`` for some c >= (1 - TOLERANCE) k, so it keeps
        all of these and only entries that round to 0, which the float16 downlink then drops:
        this is what it would send, bitwise. It matters because each float16 downlink leaves
        its rounding error behind: after a few hundred downlinks most of the support is such
        crumbs (measured at one step per exchange, fmnist_cnn: 60 k of the 61 k entries of the
        largest tensor; selecting among them was 0.7 ms of the driver's 4 ms per push).
        With a sampling generator the selector's draws must stay in step: no short cut
        (``_select`` has no mask then, as for float32 downlinks).
        """
        return sendable if sendable.size <= (1 - TOLERANCE) * k else None

    def _tracks_candidates(self) -> bool:
        """Whether entries that round to 0 can be left out of the choice (the candidate set and
        ``_sendable``): float16 downlinks and no sampling generator."""
        return self.value_dtype == "float16" and self._on_support.rng is None

    def _from_candidates(self, density_down: float) -> tuple[np.ndarray, np.ndarray] | None:
        """``_select``'s result from the candidate set alone, when it settles it; else None.

            C = candidates with float16(float32(W - U)) != 0      (|R| > 2**-25)
            per tensor t: |C_t| <= (1 - TOLERANCE) k_t, or t is sent whole (Sparsifier.sends_whole:
                          n_t < dense_below, k_t >= n_t, method none)  ->  _select sends C_t, bitwise

        Outside C every entry is a crumb that rounds to 0 in float16, so these are the
        entries _select would send after the float16 filter, found in O(|C|) instead of a
        scan of all P entries: at one step per exchange the scan was the largest part of the
        driver's work per push (0.2 of 1.8 ms), and C is about one uplink plus one downlink.
        After the downlink C is what was sent (their rounding error may still be sendable)
        plus the indices of every later sparse apply.
        """
        if not self._candidates.known:
            return None
        c = self._candidates.indices()
        if self._candidates.runs > 1:  # sorted runs: a stable sort merges them in O(|C|)
            c.sort(kind="stable")  # (np.unique hashes: 5x slower here)
            c = c[np.concatenate(([True], c[1:] != c[:-1]))]
        r = self._W[c] - self._U[c]
        keep = np.abs(r) > FLOAT16_ZERO
        c, r = c[keep], r[keep]
        if (np.diff(np.searchsorted(c, self._offsets)) > self._candidate_limits(density_down)).any():
            return None  # the selector may have to choose among the whole support: scan
        self._restart_candidates(c)
        return c, r

    def _candidate_limits(self, density_down: float) -> np.ndarray:
        """Per tensor, the most sendable candidates the candidate set settles alone: ``(1 -
        TOLERANCE) k_t`` (every selector keeps them all), unbounded for a tensor sent whole.
        Kept for the last density asked: a downlink per push asks the same one."""
        last = self._limits
        if last is None or last[0] != density_down:
            limits = np.array([math.inf if self.sparsifier.sends_whole(n, density_down)
                               else (1 - TOLERANCE) * target_count(n, density_down) for n in self.layout])
            self._limits = last = (density_down, limits)
        return last[1]

    def _restart_candidates(self, c: np.ndarray) -> None:
        """The candidate set is ``c`` (sorted, unique) and what later sparse applies add."""
        self._candidates.restart(c)

    def _residual_support(self, sendable: bool = False) -> tuple[np.ndarray, ...]:
        """``(i, float32(W - U)[i])`` for every i where they differ, ascending (views of buffers
        reused by the next call). +0.0 vs -0.0 differ in bits, not in value: not in the support.
        ``sendable``: and, third, the positions in it of the entries that do not round to 0 in
        float16 (|R| > 2**-25), found in the same pass."""
        if native.enabled():
            if self._support_buf is None:
                self._support_buf = (np.empty(self._W.size, np.int64), np.empty(self._W.size, np.float32))
            idx, vals = self._support_buf
            if not sendable:
                n = native_server.residual_support(self._W, self._U, idx, vals)
                return idx[:n], vals[:n]
            if self._sendable_buf is None:  # only float16 servers ask: 8 bytes per parameter
                self._sendable_buf = np.empty(self._W.size, np.int64)
            n, m = native_server.residual_support_sendable(self._W, self._U, idx, vals, self._sendable_buf)
            return idx[:n], vals[:n], self._sendable_buf[:m]
        r = self._W - self._U
        idx = np.flatnonzero(r != 0)  # on a bool array: 4x faster than on the floats
        if not sendable:
            return idx, r[idx]
        r = r[idx]
        return idx, r, np.flatnonzero(np.abs(r) > FLOAT16_ZERO)
