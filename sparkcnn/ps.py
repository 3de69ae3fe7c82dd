"""Parameter-server state: global weights, the workers' view, downlinks, snapshots.

State (all flat over the model's ``layout``)::

    W        float32 [P]   global weights, moved only by the optimizer: W = float32(W - float32(scale * update))
    U        float32 [P]   the view every worker replica holds, moved only by downlinks
    R        = W - U       residual still to send, never stored: R := float64(W) - float64(U)
    version  int           bumped by every accepted apply()

Why R is derived: storing ``R`` in float32 and updating it alongside ``W`` and
``U`` drifts (float32 sums round), so ``U + R == W`` would hold only
approximately. Keeping ``W`` and ``U`` as the two float32 primaries and
defining ``R`` from them makes ``U + R == W`` an identity: the float64
difference of two float32 numbers is exact whenever neither is nonzero and
more than 2**28 times smaller than the other (weights near 1e-9 next to
weights near 1; below that, ``R`` is correctly rounded). ``W`` stays exactly
what the optimizer computed.

Downlink (``D``, applied by server and replicas with :func:`replica.apply_downlink`)::

    sparse (density_down = d):  D = sparsify(float32(W - U), d);  U[D.idx] = float32(U[D.idx] + D.values)
    dense  (density_down = None): D = {i : W[i] != U[i] bitwise}; U[D.idx] = W[D.idx]   (so U == W exactly)

The dense downlink assigns instead of adding because ``U + float32(W - U)``
need not round back to ``W`` (e.g. across a sign change), and its support is
only what changed since the last downlink. Every downlink goes to a log of
``max_log`` entries; every ``snapshot_every`` versions a dense copy of ``U`` is
kept, so a replica that is missing or behind the log restarts from the
snapshot plus the log since (:meth:`ParameterServer.sync_payload`).
"""

from __future__ import annotations

import logging
import math
import threading
from collections import deque

import numpy as np

from sparkcnn.compression.delta import SparseDelta, layout_offsets
from sparkcnn.compression.sparsify import Sparsifier
from sparkcnn.errors import BadInput
from sparkcnn.replica import (
    MAX_SIZE,
    Downlink,
    Snapshot,
    SyncPayload,
    apply_downlink,
    checksum,
    format_checksum,
)

__all__ = ["Downlink", "ParameterServer", "Snapshot"]

log = logging.getLogger(__name__)

VALUE_DTYPES = ("float32", "float16")
_F16_MAX = float(np.finfo(np.float16).max)


def _readonly(a: np.ndarray) -> np.ndarray:
    view = a.view()
    view.flags.writeable = False
    return view


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise BadInput(f"`{name}` must be an int >= 1, got {value!r}")
    return int(value)


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
        snapshot_every: int,
        max_log: int,
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
        if density_down is not None and not (0.0 < float(density_down) <= 1.0):
            raise BadInput(f"`density_down` must be in (0, 1] or None, got {density_down!r}")
        if value_dtype not in VALUE_DTYPES:
            raise BadInput(f"`value_dtype` must be one of {VALUE_DTYPES}, got {value_dtype!r}")
        self.density_down = None if density_down is None else float(density_down)
        self.snapshot_every = _positive_int("snapshot_every", snapshot_every)  # versions
        self.max_log = _positive_int("max_log", max_log)  # downlinks kept for catching up
        self.sparsifier = sparsifier if sparsifier is not None else Sparsifier()
        # Values of sparse downlinks are rounded to this dtype before U moves,
        # matching a codec that ships them so (float16 halves downlink bytes).
        self.value_dtype = value_dtype
        self._lock = threading.RLock()
        self._W = weights.copy()
        self._reset_view(self._W.copy(), version=0, view_version=0)
        self.rejected_updates = 0  # non-finite updates refused by apply()

    def _reset_view(self, U: np.ndarray, *, version: int, view_version: int) -> None:
        self._U = U
        self.version = version
        self._view_version = view_version  # version of the last downlink: U "is at" it
        self._checksum = checksum(U)
        self._log: deque[Downlink] = deque(maxlen=self.max_log)
        self._take_snapshot()

    def _take_snapshot(self) -> None:
        self._snapshot_version = self._view_version
        self._snapshot = _readonly(self._U.copy())

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

    @property
    def log_versions(self) -> list[int]:
        return [dl.version for dl in self._log]

    # -- optimizer side --------------------------------------------------------------

    def apply(self, update: np.ndarray | SparseDelta, scale: float = 1.0) -> bool:
        """``W -= scale * update`` in float32; version += 1. False if refused.

        ``update`` is a dense vector (cast to float32) or a SparseDelta; both
        give bit-identical ``W`` for the same entries. An update whose result
        would not be finite (NaN/inf in it, or overflow) is refused whole:
        ``W`` and ``version`` do not change and ``rejected_updates`` counts it.
        """
        scale = float(scale)
        if not (math.isfinite(scale) and scale > 0):
            raise BadInput(f"`scale` must be finite and > 0, got {scale!r}")
        s = np.float32(scale)
        with self._lock, np.errstate(over="ignore", invalid="ignore"):  # caught by the isfinite check
            if isinstance(update, SparseDelta):
                if update.size != self._W.size:
                    raise BadInput(f"update has size {update.size}, weights have {self._W.size}")
                try:
                    update.validate()
                except ValueError as err:
                    raise BadInput(f"malformed sparse update: {err}") from None
                idx, step = update.indices, update.values
                new = self._W[idx] - (step * s if scale != 1.0 else step)
            else:
                step = np.asarray(update, dtype=np.float32)
                if step.shape != self._W.shape:
                    raise BadInput(f"update has shape {step.shape}, weights have {self._W.shape}")
                idx = None
                new = self._W - (step * s if scale != 1.0 else step)
            if not np.isfinite(new).all():
                self.rejected_updates += 1
                log.warning(
                    "refused a non-finite update at version %s (%s refused so far)",
                    self.version,
                    self.rejected_updates,
                )
                return False
            if idx is None:
                np.copyto(self._W, new)
            else:
                self._W[idx] = new
            self.version += 1
            return True

    # -- downlink side ---------------------------------------------------------------

    def downlink(self) -> Downlink | None:
        """Move ``U`` towards ``W`` and return the downlink that does it.

        None when nothing was applied since the previous downlink (``U`` is
        already at this version). See the module docstring for ``D``.
        """
        with self._lock:
            if self.version == self._view_version:
                return None
            if self.density_down is None:
                idx = np.flatnonzero(self._W.view(np.uint32) != self._U.view(np.uint32))
                delta = SparseDelta(self._W.size, idx, self._W[idx])
                assign = True
            else:
                residual = self._W - self._U  # float32; zero exactly where W == U
                sel = self.sparsifier.select(residual, self.layout, self.density_down)
                values = sel.values
                if self.value_dtype == "float16":
                    values = np.clip(values, -_F16_MAX, _F16_MAX).astype(np.float16).astype(np.float32)
                keep = values != 0  # top-k may pick zeros; they would only cost bytes
                delta = SparseDelta(self._W.size, sel.indices[keep], values[keep])
                assign = False
            base = self._view_version
            pending = Downlink(self.version, delta, "", base, assign)
            self._checksum = (self._checksum + apply_downlink(self._U, pending)) & ((1 << 64) - 1)
            dl = Downlink(self.version, delta, format_checksum(self._checksum), base, assign)
            self._log.append(dl)
            self._view_version = self.version
            if self.version // self.snapshot_every > self._snapshot_version // self.snapshot_every:
                self._take_snapshot()
            return dl

    def sync_payload(self, from_version: int | None) -> SyncPayload:
        """What a replica at ``from_version`` (None: no replica) needs to reach ``U``.

        - ``[]`` if it is already there;
        - the list of logged downlinks after ``from_version`` if the log reaches back to it;
        - else ``Snapshot(version, U_copy, downlinks since)`` from the latest
          snapshot, taking a fresh one when the log no longer reaches back to it.
        """
        with self._lock:
            cur = self._view_version
            if from_version is not None and from_version == cur:
                return []
            start = self._log_position(from_version)
            if start is not None:
                return list(self._log)[start:]
            if self._snapshot_version == cur:
                return Snapshot(cur, self._snapshot, [])
            start = self._log_position(self._snapshot_version)
            if start is None:
                log.debug("log no longer covers snapshot %s: new snapshot at %s", self._snapshot_version, cur)
                self._take_snapshot()
                return Snapshot(cur, self._snapshot, [])
            return Snapshot(self._snapshot_version, self._snapshot, list(self._log)[start:])

    def _log_position(self, version: int | None) -> int | None:
        """Index of the logged downlink that starts at ``version``, if any."""
        if version is None:
            return None
        for i, dl in enumerate(self._log):
            if dl.base_version == version:
                return i
        return None

    # -- checkpoints -----------------------------------------------------------------

    def state_dict(self) -> dict:
        """State as numpy arrays and plain ints/strs (copies; no pickle needed).

        ``R`` is not stored: it is ``W - U`` by definition. The log is flattened:
        downlink ``j`` owns ``log_indices/log_values[log_offsets[j]:log_offsets[j+1]]``.
        """
        with self._lock:
            dls = list(self._log)
            sizes = [dl.delta.nnz for dl in dls]
            offsets = np.zeros(len(dls) + 1, np.int64)
            np.cumsum(sizes, out=offsets[1:])
            return {
                "W": self._W.copy(),
                "U": self._U.copy(),
                "layout": np.asarray(self.layout, np.int64),
                "version": int(self.version),
                "view_version": int(self._view_version),
                "rejected_updates": int(self.rejected_updates),
                "snapshot_version": int(self._snapshot_version),
                "snapshot": self._snapshot.copy(),
                "log_versions": np.asarray([dl.version for dl in dls], np.int64),
                "log_base_versions": np.asarray([dl.base_version for dl in dls], np.int64),
                "log_assign": np.asarray([dl.assign for dl in dls], np.bool_),
                "log_checksums": np.asarray([int(dl.checksum_after, 16) for dl in dls], np.uint64),
                "log_offsets": offsets,
                "log_indices": np.concatenate([dl.delta.indices for dl in dls] or [np.empty(0, np.int64)]),
                "log_values": np.concatenate([dl.delta.values for dl in dls] or [np.empty(0, np.float32)]),
            }

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned; BadInput names the faulty key."""

        def arr(key: str, dtype, shape=None) -> np.ndarray:
            if key not in state:
                raise BadInput(f"parameter-server state lacks `{key}`")
            a = np.asarray(state[key])
            if a.dtype != dtype or a.ndim != 1 or (shape is not None and a.shape != shape):
                raise BadInput(f"parameter-server state `{key}`: expected {np.dtype(dtype)} {shape or '1-D'}, "
                               f"got {a.dtype} {a.shape}")
            return a

        P = self._W.shape
        W, U, snap = arr("W", np.float32, P), arr("U", np.float32, P), arr("snapshot", np.float32, P)
        if tuple(arr("layout", np.int64).tolist()) != self.layout:
            raise BadInput("parameter-server state `layout` differs from this model's layout")
        if not (np.isfinite(W).all() and np.isfinite(U).all()):
            raise BadInput("parameter-server state `W`/`U` must be finite")
        ints = {}
        for key in ("version", "view_version", "rejected_updates", "snapshot_version"):
            try:
                ints[key] = int(state[key])
            except (KeyError, TypeError, ValueError):
                raise BadInput(f"parameter-server state `{key}` must be an int") from None
        n = arr("log_versions", np.int64).size
        versions, bases = arr("log_versions", np.int64), arr("log_base_versions", np.int64, (n,))
        assign, sums = arr("log_assign", np.bool_, (n,)), arr("log_checksums", np.uint64, (n,))
        offsets = arr("log_offsets", np.int64, (n + 1,))
        indices, values = arr("log_indices", np.int64), arr("log_values", np.float32)
        dls = []
        for j in range(n):
            a, b = int(offsets[j]), int(offsets[j + 1])
            delta = SparseDelta(P[0], indices[a:b].copy(), values[a:b].copy())
            dls.append(Downlink(int(versions[j]), delta, format_checksum(int(sums[j])), int(bases[j]), bool(assign[j])))
        sum_U = checksum(U)
        if dls and (dls[-1].checksum_after != format_checksum(sum_U) or dls[-1].version != ints["view_version"]):
            raise BadInput("parameter-server state: `U` does not match the last logged downlink")
        if not ints["snapshot_version"] <= ints["view_version"] <= ints["version"]:
            raise BadInput("parameter-server state: expected snapshot_version <= view_version <= version")
        with self._lock:
            self._W, self._U, self._checksum = W.copy(), U.copy(), sum_U
            self.version, self._view_version = ints["version"], ints["view_version"]
            self._log = deque(dls, maxlen=self.max_log)
            self._snapshot_version, self._snapshot = ints["snapshot_version"], _readonly(snap.copy())
            self.rejected_updates = ints["rejected_updates"]
