"""Parameter-server state: global weights, the workers' view, downlinks.

State (all flat over the model's ``layout``)::

    W        float32 [P]   global weights, moved only by the optimizer: W = float32(W - float32(scale * update))
    U        float32 [P]   the view every worker replica holds, moved only by downlinks
    R        = W - U       residual still to send, never stored: R := float64(W) - float64(U)
    version  int           bumped by every apply()

Why R is derived: storing ``R`` in float32 and updating it alongside ``W`` and
``U`` drifts (float32 sums round), so ``U + R == W`` would hold only
approximately. Keeping ``W`` and ``U`` as the two float32 primaries and
defining ``R`` from them makes ``U + R == W`` an identity: the float64
difference of two float32 numbers is exact whenever neither is nonzero and
more than 2**28 times smaller than the other (weights near 1e-9 next to
weights near 1; below that, ``R`` is correctly rounded). ``W`` stays exactly
what the optimizer computed.

Downlink (``D``, applied by server and replicas with :func:`replica.apply_delta`)::

    sparse (density_down = d):    D = sparsify(float32(W - U), d) minus zeros    (see _select)
                                  D.values = value_dtype(D.values)              (float16 codec: round first)
                                  U[D.idx] = float32(U[D.idx] + D.values)
    dense  (density_down = None): D = {i : W[i] != U[i] bitwise};  U[D.idx] = W[D.idx]   (so U == W exactly)

The dense downlink assigns instead of adding because ``U + float32(W - U)``
need not round back to ``W`` (e.g. across a sign change), and its support is
only what changed since the last downlink.

Catching up: the engine ships the latest few downlinks with every task; a
replica that is missing, further behind or corrupt reloads ``U`` itself
(:meth:`replica.Replica.sync`), a dense copy the engine broadcasts. A
server-side snapshot plus a log of downlinks since could never cost fewer
bytes than that copy of ``U``, so the server keeps neither.
"""

from __future__ import annotations

import math
import numbers
import operator
import threading

import numpy as np

from sparkcnn.compression import native, native_server
from sparkcnn.compression.codec_format import FLOAT16_MAX, VALUE_DTYPES
from sparkcnn.compression.delta import SparseDelta, layout_offsets
from sparkcnn.compression.sparsify import TOLERANCE, Sparsifier, target_count
from sparkcnn.errors import BadInput
from sparkcnn.replica import (
    MASK64,
    MAX_SIZE,
    Downlink,
    apply_delta,
    checksum,
    format_checksum,
)

__all__ = ["Downlink", "ParameterServer"]

# The largest magnitude that rounds to 0 in float16: 2**-25 lies halfway between 0 and the
# smallest subnormal 2**-24 and rounds to the even one, 0.
FLOAT16_ZERO = np.float32(2.0**-25)


def _readonly(a: np.ndarray) -> np.ndarray:
    view = a.view()
    view.flags.writeable = False
    return view


class ParameterServer:
    """Driver-side state of the parameter server (see the module docstring).

    Thread-safe: every public method holds one lock, so results arriving on
    several scheduler threads can call :meth:`apply` and :meth:`downlink`.
    """

    def __init__(
        self,
        weights: np.ndarray,
        layout,
        *,
        density_down: float | None,
        sparsifier: Sparsifier | None = None,
        value_dtype: str = "float32",
    ) -> None:
        weights = np.asarray(weights)
        if weights.ndim != 1 or weights.dtype != np.float32:
            raise BadInput(f"`weights` must be a 1-D float32 array, got {weights.dtype} {weights.shape}")
        if not 0 < weights.size < MAX_SIZE:
            raise BadInput(f"`weights` must have 1 to 2**32 - 1 entries, got {weights.size}")
        if not np.isfinite(weights).all():
            raise BadInput("`weights` must be finite")
        self.layout = tuple(int(n) for n in layout)
        if int(layout_offsets(self.layout)[-1]) != weights.size:
            raise BadInput(f"`layout` covers {sum(self.layout)} entries, `weights` has {weights.size}")
        if density_down is not None and not (isinstance(density_down, numbers.Real) and 0 < density_down <= 1):
            raise BadInput(f"`density_down` must be in (0, 1] or None, got {density_down!r}")
        if value_dtype not in VALUE_DTYPES:
            raise BadInput(f"`value_dtype` must be one of {VALUE_DTYPES}, got {value_dtype!r}")
        self.density_down = None if density_down is None else float(density_down)
        self.sparsifier = sparsifier if sparsifier is not None else Sparsifier()
        # The same method on the support of one tensor, whose size says nothing about dense_below.
        self._on_support = Sparsifier(self.sparsifier.method, 0, rng=self.sparsifier.rng)
        # Values of sparse downlinks are rounded to this dtype before U moves,
        # matching a codec that ships them so (float16 halves downlink bytes).
        self.value_dtype = value_dtype
        self._lock = threading.RLock()
        self._W = weights.copy()
        self._U = weights.copy()
        self.version = 0  # bumped by every apply()
        self._view_version = 0  # version of the last downlink: the version U "is at"
        self._checksum = checksum(self._U)
        self._support_buf: tuple[np.ndarray, np.ndarray] | None = None  # for _residual_support
        self._sendable_buf: np.ndarray | None = None  # for _residual_support(sendable=True)
        self._offsets = layout_offsets(self.layout)
        # float16 downlinks: every i with float16(W[i] - U[i]) != 0 is in one of these index arrays
        # (None: unknown, the next downlink scans; see _from_candidates). W == U: none.
        self._candidates: list[np.ndarray] | None = None
        self._candidate_count = 0  # entries in _candidates (with repeats)
        self._limits: tuple[float, np.ndarray] | None = None  # (density, _candidate_limits of it)
        if self._tracks_candidates():
            self._restart_candidates(np.empty(0, np.int64))

    # -- read-only state -------------------------------------------------------------

    @property
    def W(self) -> np.ndarray:
        """Global weights (read-only view); the final model."""
        return _readonly(self._W)

    @property
    def U(self) -> np.ndarray:
        """The workers' view (read-only view)."""
        return _readonly(self._U)

    @property
    def R(self) -> np.ndarray:
        """Residual ``float64(W) - float64(U)`` (a new float64 array, O(P))."""
        with self._lock:
            return self._W.astype(np.float64) - self._U.astype(np.float64)

    @property
    def view_version(self) -> int:
        """Version that replicas reach by applying every downlink."""
        return self._view_version

    @property
    def checksum(self) -> str:
        """Checksum of ``U`` (what ``Downlink.checksum_after`` of the last downlink says)."""
        return format_checksum(self._checksum)

    # -- optimizer side --------------------------------------------------------------

    def apply(self, update: np.ndarray | SparseDelta, scale: float = 1.0) -> int:
        """``W -= scale * update`` in float32; returns the new version (old + 1).

        ``update`` is a dense vector (cast to float32) or a SparseDelta; both
        give bit-identical ``W`` for the same entries. Updates reach the
        server only through the codec, whose decoder refuses non-finite
        values (:func:`sparkcnn.server.apply.apply_deltas`), and through the
        divergence guard, which refuses exploding ones; so this method checks
        shapes, not values.
        """
        scale = float(scale)
        if not (math.isfinite(scale) and scale > 0):
            raise BadInput(f"`scale` must be finite and > 0, got {scale!r}")
        s = np.float32(scale)
        with self._lock:
            if isinstance(update, SparseDelta):
                if update.size != self._W.size:
                    raise BadInput(f"update has size {update.size}, weights have {self._W.size}")
                try:
                    update.validate()
                except ValueError as err:
                    raise BadInput(f"malformed sparse update: {err}") from None
                idx, step = update.indices, update.values
                self._W[idx] -= step * s if scale != 1.0 else step
                if self._candidates is not None:
                    self._candidates.append(idx.copy())  # the caller's buffer may be reused
                    self._candidate_count += idx.size
                    if self._candidate_count > self._W.size // 4:  # no downlink for long: a scan is cheaper
                        self._candidates = None
            else:
                step = np.asarray(update, dtype=np.float32)
                if step.shape != self._W.shape:
                    raise BadInput(f"update has shape {step.shape}, weights have {self._W.shape}")
                np.subtract(self._W, step * s if scale != 1.0 else step, out=self._W)
                self._candidates = None
            self.version += 1
            return self.version

    # -- downlink side ---------------------------------------------------------------

    def downlink(self, density: float | None = None) -> Downlink | None:
        """Move ``U`` towards ``W`` and return the downlink that does it.

        None when nothing was applied since the previous downlink (``U`` is
        already at this version). See the module docstring for ``D``.
        ``density``: this downlink's density in place of ``density_down``
        (the density warm-up); sparse servers only.
        """
        if density is not None and not (isinstance(density, numbers.Real) and 0 < density <= 1):
            raise BadInput(f"`density` must be in (0, 1], got {density!r}")
        with self._lock:
            if self.version == self._view_version:
                return None
            if self.density_down is None:
                idx = np.flatnonzero(self._W.view(np.uint32) != self._U.view(np.uint32))
                delta = SparseDelta(self._W.size, idx, self._W[idx])
                assign = True
                change = apply_delta(self._U, delta, assign=True)
            else:
                d = self.density_down if density is None else float(density)
                # the compiled candidate path settles it, or tells that the candidate set cannot
                # (numpy's _from_candidates would then say the same): the scan chooses
                compiled = self._candidates is not None and native.enabled()
                delta, change = ((self._compiled_candidates(d) if compiled else None)
                                 or self._sparse_downlink(d, candidates=not compiled))
                assign = False
            self._checksum = (self._checksum + change) & MASK64
            dl = Downlink(self.version, delta, format_checksum(self._checksum), self._view_version, assign)
            self._view_version = self.version
            return dl

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
        got = native_server.candidate_downlink(np.concatenate(self._candidates), self._W, self._U, self._offsets,
                                               self._candidate_limits(density_down))
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
        return np.concatenate(idx), np.concatenate(vals)

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
        ``_sendable``): sparse float16 downlinks and no sampling generator."""
        return self.density_down is not None and self.value_dtype == "float16" and self._on_support.rng is None

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
        if self._candidates is None:
            return None
        c = np.concatenate(self._candidates)
        if len(self._candidates) > 1:  # sorted runs: a stable sort merges them in O(|C|)
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
        self._candidates, self._candidate_count = [c], c.size

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

    # -- checkpoints -----------------------------------------------------------------

    def state_dict(self) -> dict:
        """State as numpy arrays and plain ints (copies; no pickle needed).

        ``R`` is not stored: it is ``W - U`` by definition.
        """
        with self._lock:
            return {
                "W": self._W.copy(),
                "U": self._U.copy(),
                "layout": np.asarray(self.layout, np.int64),
                "version": int(self.version),
                "view_version": int(self._view_version),
            }

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned; BadInput names the faulty key.

        Other keys are ignored (checkpoints of earlier versions also held a
        downlink log and a snapshot of ``U``).
        """
        P = self._W.size
        for key in ("W", "U"):
            a = state.get(key)
            if not (isinstance(a, np.ndarray) and a.dtype == np.float32 and a.shape == (P,)):
                raise BadInput(f"parameter-server state `{key}` must be float32 [{P}]")
            if not np.isfinite(a).all():
                raise BadInput(f"parameter-server state `{key}` must be finite")
        if tuple(np.asarray(state.get("layout", ())).tolist()) != self.layout:
            raise BadInput("parameter-server state `layout` differs from this model's layout")
        ints = {}
        for key in ("version", "view_version"):
            try:
                ints[key] = operator.index(state[key])
            except (KeyError, TypeError):
                raise BadInput(f"parameter-server state `{key}` must be an int") from None
        if not 0 <= ints["view_version"] <= ints["version"]:
            raise BadInput("parameter-server state: expected 0 <= view_version <= version")
        with self._lock:
            np.copyto(self._W, state["W"])  # in place: views handed out stay live
            np.copyto(self._U, state["U"])
            self._checksum = checksum(self._U)
            self._candidates = None  # the next downlink scans
            self.version, self._view_version = ints["version"], ints["view_version"]
