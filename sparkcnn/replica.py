"""A worker's replica of the server view ``U``, kept in step by downlinks.

The parameter server (:mod:`sparkcnn.ps`) and every replica hold the same
float32 vector ``U``. The server moves it with downlinks and the replica
repeats each one with the same float32 operation, :func:`apply_delta`::

    assign=False:  U[d.indices] = float32(U[d.indices] + d.values)   # sparse downlink
    assign=True:   U[d.indices] = d.values                           # dense downlink

so a replica that applied the same downlinks in order is bit-identical to the
server's ``U``. Each downlink names the version it starts from and the version
it reaches, and carries ``checksum(U)`` after it; a replica that skipped one,
applied one twice or had its ``U`` altered raises :class:`ReplicaOutOfSync`,
and :meth:`Replica.sync` reloads it from a dense copy of ``U``.

Checksum (order-sensitive, additive, so a sparse downlink updates it in O(nnz))::

    checksum(U) = sum_i mix64((i << 32) | bits(U[i]))  mod 2**64

``mix64`` is a bijection on 64-bit words (multiply by odd constants and
xor-shifts, as in splitmix64), so changing any single entry always changes the
checksum, and unrelated changes collide with probability about 2**-64.
Measured on 25 M parameters (numpy, one shared core): full checksum 70-85 ms
(zlib.crc32 46 ms, blake2b 196 ms, neither updatable), update for 25 K changed
entries 0.5 ms. So the server pays O(nnz) per downlink, and a replica pays one
full pass per :meth:`Replica.apply` call (``full_check``), not per downlink.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np

from sparkcnn.buffers import aligned_copy
from sparkcnn.compression import native, native_server
from sparkcnn.compression.delta import SparseDelta
from sparkcnn.errors import SparkCNNError

log = logging.getLogger(__name__)

MASK64 = (1 << 64) - 1
# mix64's constants, shared with the compiled path
_C1, _C2, _S29, _S32 = native_server.MIX_C1, native_server.MIX_C2, native_server.MIX_S1, native_server.MIX_S2
_CHUNK = 1 << 16  # 64 K entries: the uint64 work buffers stay in L2 (4x faster than 1 M)
MAX_SIZE = 1 << 32  # the index must fit the high half of the mixed word


class ReplicaOutOfSync(SparkCNNError):
    """The replica cannot follow the downlinks: a version gap or a checksum mismatch."""


@dataclass(frozen=True, eq=False)
class Downlink:
    """One server-to-worker update of ``U``: version ``base_version`` → ``version``."""

    version: int  # server version that U reaches with this downlink
    delta: SparseDelta  # increments (assign=False) or new values (assign=True) of U
    checksum_after: str  # checksum(U) after applying, 16 hex digits
    base_version: int  # server version of the U this downlink applies to
    assign: bool = False  # True for the dense downlink: U[idx] = values, so U == W exactly


def _mix_sum(values: np.ndarray, indices: np.ndarray | None = None) -> int:
    """``sum_j mix64((i_j << 32) | bits(values[j])) mod 2**64``, in chunks.

    ``i_j = indices[j]``, or ``j`` when ``indices`` is None (a whole vector).
    """
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    total = 0
    w = np.empty(min(_CHUNK, bits.size), np.uint64)
    t = np.empty_like(w)
    if indices is None:  # keys (j << 32) for the current chunk, advanced by (CHUNK << 32)
        key = np.arange(w.size, dtype=np.uint64) << _S32
        step = np.uint64(w.size) << _S32
    for s in range(0, bits.size, _CHUNK):
        m = min(_CHUNK, bits.size - s)
        ww, tt = w[:m], t[:m]
        if indices is None:
            np.bitwise_or(key[:m], bits[s : s + m], out=ww)
            key += step
        else:
            np.copyto(ww, indices[s : s + m], casting="unsafe")  # int64 index >= 0 -> uint64
            np.left_shift(ww, _S32, out=ww)
            np.bitwise_or(ww, bits[s : s + m], out=ww)
        np.multiply(ww, _C1, out=ww)
        np.right_shift(ww, _S29, out=tt)
        np.bitwise_xor(ww, tt, out=ww)
        np.multiply(ww, _C2, out=ww)
        np.right_shift(ww, _S32, out=tt)
        np.bitwise_xor(ww, tt, out=ww)
        total += int(ww.sum(dtype=np.uint64))
    return total & MASK64


def checksum(U: np.ndarray) -> int:
    """Full checksum of a float32 vector, O(P); see the module docstring. Compiled where it can
    (the same value: a replica's full check cost ~0.6 ms in numpy's chunks, 0.2 M entries)."""
    if U.size >= MAX_SIZE:
        raise ValueError(f"checksum supports at most 2**32 - 1 entries, got {U.size}")
    if U.dtype == np.float32 and U.flags.c_contiguous and native.enabled():
        return native_server.checksum(U)
    return _mix_sum(U)


def format_checksum(value: int) -> str:
    return f"{value:016x}"


def apply_delta(U: np.ndarray, delta: SparseDelta, *, assign: bool = False) -> int:
    """Apply a downlink's delta to ``U`` in place; return the checksum change mod 2**64.

        assign=False:  U[idx] = float32(U[idx] + values)
        assign=True:   U[idx] = values

    The one float32 operation that server and replicas share (bit-identity
    rests on it). ``delta.indices`` are unique (a SparseDelta invariant).
    """
    idx = delta.indices
    if U.dtype == np.float32 and U.flags.c_contiguous and native.enabled():
        return native_server.apply_delta(U, idx, delta.values, assign)  # one pass, bitwise the same
    before = _mix_sum(U[idx], idx)
    if assign:
        U[idx] = delta.values
    else:
        U[idx] += delta.values  # float32 + float32, rounded once, elementwise
    return (_mix_sum(U[idx], idx) - before) & MASK64


class Replica:
    """Executor-side copy of ``U`` at ``version``; empty until a dense copy is loaded."""

    def __init__(self) -> None:
        self._U: np.ndarray | None = None
        self.version: int | None = None
        self._checksum = 0
        self.resyncs = 0  # reloads of U done by sync() (a worker reports them as replica_resyncs)

    @property
    def U(self) -> np.ndarray | None:
        """Read-only view of the replica's weights (None while empty)."""
        if self._U is None:
            return None
        view = self._U.view()
        view.flags.writeable = False
        return view

    @property
    def checksum(self) -> str | None:
        return None if self._U is None else format_checksum(self._checksum)

    def invalidate(self) -> None:
        """Forget the weights; the next sync reloads them."""
        self._U, self.version, self._checksum = None, None, 0

    def load_snapshot(self, version: int, weights: np.ndarray) -> None:
        """``U := copy(weights)`` at ``version`` (full checksum recomputed)."""
        U = aligned_copy(np.ravel(weights))  # aligned: a task's gradient call reads it in place
        self._U, self.version, self._checksum = U, int(version), checksum(U)

    def apply(self, downlinks: Iterable[Downlink], *, full_check: bool = True) -> int:
        """Apply ``downlinks`` in order; return how many changed ``U``.

        Downlinks at or below the replica's version are skipped (already
        applied); each other one must start at the replica's version and end
        with the checksum it carries. ``full_check`` then recomputes the full
        checksum once (O(P)), which also catches changes to entries no downlink
        touched. On any failure the replica is invalidated and
        :class:`ReplicaOutOfSync` is raised.
        """
        if self._U is None:
            raise ReplicaOutOfSync("replica is empty: load a dense copy of U first")
        applied = 0
        last: Downlink | None = None
        for dl in downlinks:
            if dl.version <= self.version:
                continue
            if dl.base_version != self.version:
                at = self.version
                self.invalidate()
                raise ReplicaOutOfSync(
                    f"version gap: replica at {at}, downlink {dl.version} starts at {dl.base_version}"
                )
            if dl.delta.size != self._U.size:
                self.invalidate()
                raise ReplicaOutOfSync(
                    f"downlink {dl.version} is for {dl.delta.size} parameters, not {self._U.size}"
                )
            self._checksum = (self._checksum + apply_delta(self._U, dl.delta, assign=dl.assign)) & MASK64
            self.version = dl.version
            applied += 1
            last = dl
            if format_checksum(self._checksum) != dl.checksum_after:
                self.invalidate()
                raise ReplicaOutOfSync(f"checksum mismatch after downlink {dl.version}")
        if full_check and last is not None and checksum(self._U) != self._checksum:
            at = self.version
            self.invalidate()
            raise ReplicaOutOfSync(f"replica weights at version {at} differ from the server's")
        return applied

    def sync(self, downlinks: list[Downlink], reload: Callable[[], tuple[int, np.ndarray]]) -> bool:
        """Bring the replica to the end of ``downlinks``, reloading ``U`` if it must.

        The replica first follows ``downlinks`` (:meth:`apply`). If it is
        empty, behind them or corrupt, it calls ``reload()`` for a dense copy
        ``(version, weights)`` of the server's view (lazily: e.g. it reads a
        Spark broadcast), loads it and follows the downlinks after that
        version. Returns True when ``U`` was reloaded; raises
        ReplicaOutOfSync when even the reloaded copy cannot follow them.
        """
        downlinks = list(downlinks)
        if self._U is not None:
            try:
                self.apply(downlinks)
                return False
            except ReplicaOutOfSync as err:
                log.info("replica resync: %s", err)
        version, weights = reload()
        self.load_snapshot(version, weights)
        self.resyncs += 1
        self.apply(downlinks, full_check=False)  # a fresh copy: the per-downlink checks suffice
        return True
