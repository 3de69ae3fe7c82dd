"""Parameter-server state: global weights, the workers' view, downlinks.

State (all flat over the model's ``layout``)::

    W        float32 [P]   global weights, moved only by the optimizer:
                           W = float32(W - float32(scale * update))
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

    sparse (density_down = d):    D = sparsify(float32(W - U), d) minus zeros    (ps_downlink)
                                  D.values = value_dtype(D.values)              (float16 codec: round first)
                                  U[D.idx] = float32(U[D.idx] + D.values)
    dense  (density_down = None): D = {i : W[i] != U[i] bitwise};  U[D.idx] = W[D.idx]   (so U == W exactly)

The dense downlink assigns instead of adding because ``U + float32(W - U)``
need not round back to ``W`` (e.g. across a sign change), and its support is
only what changed since the last downlink.

Where the state lives (``memory``): :class:`LocalMemory`, this process's own arrays and a
thread lock (the default); or a store shared by several server processes
(:class:`sparkcnn.server.sharedstore.SharedStore`), whose lock also excludes the other
processes and whose version counter is one word they all bump inside it. The server's
methods run unchanged on either.

Catching up: the engine ships the latest few downlinks with every task; a
replica that is missing, further behind or corrupt reloads ``U`` itself
(:meth:`replica.Replica.sync`), a dense copy the engine broadcasts. A
server-side snapshot plus a log of downlinks since could never cost fewer
bytes than that copy of ``U``, so the server keeps neither.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import operator
import threading

import numpy as np

from sparkcnn.compression.codec_format import VALUE_DTYPES
from sparkcnn.compression.delta import SparseDelta, layout_offsets
from sparkcnn.compression.sparsify import Sparsifier
from sparkcnn.errors import BadInput
from sparkcnn.ps_downlink import SparseDownlink
from sparkcnn.replica import (
    MASK64,
    MAX_SIZE,
    Downlink,
    apply_delta,
    checksum,
    format_checksum,
)

__all__ = ["Downlink", "LocalMemory", "ParameterServer"]


def _readonly(a: np.ndarray) -> np.ndarray:
    view = a.view()
    view.flags.writeable = False
    return view


class LocalMemory:
    """A parameter server's state in this process alone: ``W`` and ``U`` (copies of ``weights``),
    the version, the view's version, the checksum of ``U``, and the lock every method holds.

    ``candidate_set``: None, as only this process moves ``W``: the server keeps its own record of
    where ``W`` moved since the last downlink (the candidate set, :mod:`sparkcnn.ps_downlink`)."""

    candidate_set = None

    def __init__(self, weights: np.ndarray):
        self.lock = threading.RLock()
        self.W = weights.copy()
        self.U = weights.copy()
        self.version = 0        # bumped by every apply
        self.view_version = 0   # the version of the last downlink: the version U "is at"
        self.checksum = checksum(self.U)

    def bump(self) -> int:
        """One apply more; the new version (under the lock)."""
        self.version += 1
        return self.version

    def viewed(self, checksum_after: int) -> None:
        """A downlink moved U to the current version; ``checksum_after`` is U's (under the lock)."""
        self.view_version, self.checksum = self.version, checksum_after

    def load(self, version: int, view_version: int, checksum_u: int) -> None:
        """Versions and checksum of a restored state (under the lock)."""
        self.version, self.view_version, self.checksum = version, view_version, checksum_u


class ParameterServer:
    """Driver-side state of the parameter server (see the module docstring).

    Thread-safe: every public method holds one lock, so results arriving on
    several scheduler threads can call :meth:`apply` and :meth:`downlink`. ``memory``: where
    the state lives (module docstring; default a :class:`LocalMemory` of ``weights``); a shared
    store holds its own, which ``weights`` is then only checked against.
    """

    def __init__(
        self,
        weights: np.ndarray,
        layout,
        *,
        density_down: float | None,
        sparsifier: Sparsifier | None = None,
        value_dtype: str = "float32",
        candidates: bool = True,
        memory=None,
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
        if density_down is not None and not (isinstance(density_down, numbers.Real)
                                             and 0 < density_down <= 1):
            raise BadInput(f"`density_down` must be in (0, 1] or None, got {density_down!r}")
        if value_dtype not in VALUE_DTYPES:
            raise BadInput(f"`value_dtype` must be one of {VALUE_DTYPES}, got {value_dtype!r}")
        self.density_down = None if density_down is None else float(density_down)
        self.sparsifier = sparsifier if sparsifier is not None else Sparsifier()
        # Values of sparse downlinks are rounded to this dtype before U moves,
        # matching a codec that ships them so (float16 halves downlink bytes).
        self.value_dtype = value_dtype
        self._mem = LocalMemory(weights) if memory is None else memory
        if self._mem.W.shape != weights.shape:
            raise BadInput(f"`memory` holds {self._mem.W.size} weights, `weights` has {weights.size}")
        self._lock = self._mem.lock
        self._W, self._U = self._mem.W, self._mem.U
        # sparse servers: the choice of D among R (see ps_downlink), over these same W and U, with
        # the memory's record of where W moved (a shared store's, which every process moves)
        self._sparse = (None if self.density_down is None
                        else SparseDownlink(self._W, self._U, self.layout, self.sparsifier, value_dtype,
                                            candidates=candidates, candidate_set=self._mem.candidate_set))

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
    def lock(self):
        """The lock every method holds (reentrant): a caller holds it across several calls that
        must see no other apply between them (a downlink's cadence check, D and its log entry)."""
        return self._lock

    def section(self):
        """A context in which the lock, once this thread takes it, is kept until the context ends
        (a shared store's: :meth:`sparkcnn.server.sharedstore.StoreLock.section`, one record lock
        per push); with this process's own memory, nothing (its thread lock costs little)."""
        section = getattr(self._lock, "section", None)
        return contextlib.nullcontext() if section is None else section()

    @property
    def version(self) -> int:
        """Number of applies so far (bumped by every :meth:`apply`)."""
        return self._mem.version

    @property
    def view_version(self) -> int:
        """Version that replicas reach by applying every downlink."""
        return self._mem.view_version

    @property
    def checksum(self) -> str:
        """Checksum of ``U`` (what ``Downlink.checksum_after`` of the last downlink says)."""
        return format_checksum(self._mem.checksum)

    # -- optimizer side --------------------------------------------------------------

    def apply(self, update: np.ndarray | SparseDelta, scale: float = 1.0, *, decoded: bool = False) -> int:
        """``W -= scale * update`` in float32; returns the new version (old + 1).

        ``update`` is a dense vector (cast to float32) or a SparseDelta; both
        give bit-identical ``W`` for the same entries. Updates reach the
        server only through the codec, whose decoder refuses non-finite
        values (:func:`sparkcnn.server.apply.apply_deltas`), and through the
        divergence guard, which refuses exploding ones; so this method checks
        shapes, not values. ``decoded``: a SparseDelta the codec's decoder made,
        whose indices it validated already (a second pass would cost O(nnz)
        again on every push).
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
                    if not decoded:
                        update.validate()
                except ValueError as err:
                    raise BadInput(f"malformed sparse update: {err}") from None
                idx, step = update.indices, update.values
                self._W[idx] -= step * s if scale != 1.0 else step
                if self._sparse is not None:
                    self._sparse.applied(idx)
            else:
                step = np.asarray(update, dtype=np.float32)
                if step.shape != self._W.shape:
                    raise BadInput(f"update has shape {step.shape}, weights have {self._W.shape}")
                np.subtract(self._W, step * s if scale != 1.0 else step, out=self._W)
                if self._sparse is not None:
                    self._sparse.forget()
            return self._mem.bump()

    # -- downlink side ---------------------------------------------------------------

    @property
    def select_cpu_s(self) -> float:
        """Thread CPU seconds of the last sparse downlink's scan choosing D (0: none scanned)."""
        return 0.0 if self._sparse is None else self._sparse.select_cpu_s

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
            mem = self._mem
            if mem.version == mem.view_version:
                return None
            if self.density_down is None:
                idx = np.flatnonzero(self._W.view(np.uint32) != self._U.view(np.uint32))
                delta = SparseDelta(self._W.size, idx, self._W[idx])
                assign = True
                change = apply_delta(self._U, delta, assign=True)
            else:
                delta, change = self._sparse.move(self.density_down if density is None else float(density))
                assign = False
            after = (mem.checksum + change) & MASK64
            dl = Downlink(mem.version, delta, format_checksum(after), mem.view_version, assign)
            mem.viewed(after)
            return dl

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
                "version": int(self._mem.version),
                "view_version": int(self._mem.view_version),
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
            if self._sparse is not None:
                self._sparse.forget()  # the next downlink scans
            self._mem.load(ints["version"], ints["view_version"], checksum(self._U))
