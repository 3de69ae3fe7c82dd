"""One key-range shard of the parameter server (:mod:`sparkcnn.shards`): its range's W and U,
moved only by the coordinator's log, and its part of every reply.

    piece(P)   a task's part of a push: kept until the log entry that answers it is applied
    step(E)    the log, in order: wait for the pieces it applies; W_k -= factor . S_k (one version
               for all of them, as apply_deltas does); a downlink of the given density; then
               answer each piece it names with the range's weights part, chosen as the
               coordinator's own reply chooses (dense W, the downlinks since ``have``, or the
               dense view when the push is to be trained again or the replica cannot follow)

The coordinator decides; a shard only checks that it agrees: each step's version must be
the one it reaches, and each piece's squared norm the one the task declared to the
coordinator's guard (:class:`ShardDisagrees` otherwise: the run stops, it does not drift).
"""

from __future__ import annotations

import math
import threading

import numpy as np

from sparkcnn.compression import codec
from sparkcnn.compression.sparsify import Sparsifier
from sparkcnn.server.apply import apply_decoded, apply_deltas
from sparkcnn.errors import CodecError
from sparkcnn.protocol import DownlinkMsg, Piece, ShardReply, ShardStep
from sparkcnn.ps import ParameterServer
from sparkcnn.shards import outside_checksum, range_checksum, sum_squares

SUMSQ_RTOL = 1e-5  # a piece's declared squared norm against the one its payload decodes to


class ShardDisagrees(RuntimeError):
    """A shard's state or a piece does not match what the coordinator's log says."""


class RangeShard:
    """W and U of the flat range ``[lo, hi)`` (full-length vectors; only the range moves)."""

    def __init__(self, lo: int, hi: int, weights: np.ndarray, layout, *, density_down: float | None,
                 index: int = 0,
                 selector: str = "threshold", dense_below: int = 16384, value_dtype: str = "float32",
                 keep_downlinks: int = 8, timeout_s: float = 60.0):
        self.span = range(int(lo), int(hi))   # its keys: [lo, hi)
        self.index = int(index)               # its place among the shards
        self.ps = ParameterServer(np.array(weights, np.float32, copy=True), tuple(layout),
                                  density_down=density_down, sparsifier=Sparsifier(selector, dense_below),
                                  value_dtype=value_dtype)
        self.outside = outside_checksum(self.ps.U, self.lo, self.hi)
        self.keep_downlinks, self.timeout_s = int(keep_downlinks), float(timeout_s)
        self.downlinks: list[DownlinkMsg] = []  # the latest, with this range's checksum parts
        self.pieces: dict[tuple[int, int], Piece] = {}
        self.replies: dict[tuple[int, int], ShardReply] = {}
        self.failure: BaseException | None = None
        # the lock, and the log's wait for its pieces (only the coordinator's stream waits on it)
        self.cond = threading.Condition()
        # each waiting piece's own event, set when its reply is in ``replies`` or the shard fails:
        # with every piece waiting on ``cond``, each notify woke all N streams' threads to
        # re-check (at 64 workers, 3x a push's CPU on the shard)
        self.ready: dict[tuple[int, int], threading.Event] = {}

    @property
    def lo(self) -> int:
        return self.span.start

    @property
    def hi(self) -> int:
        return self.span.stop

    @property
    def layout(self) -> tuple:
        return self.ps.layout

    @property
    def value_dtype(self) -> str:
        return self.ps.value_dtype

    @property
    def sparse_down(self) -> bool:
        return self.ps.density_down is not None

    # -- the task's side ------------------------------------------------------------------------
    def piece(self, p: Piece) -> ShardReply:
        """Keep ``p`` and wait for the log entry that answers it; its reply."""
        key = (p.stream, p.ordinal)
        with self.cond:
            if key in self.pieces or key in self.replies:
                raise ShardDisagrees(f"piece {key} arrived twice")
            self.pieces[key] = p
            ready = self.ready[key] = threading.Event()
            if self.failure is not None:
                ready.set()
            self.cond.notify_all()
        ready.wait(timeout=self.timeout_s)
        with self.cond:
            self.ready.pop(key, None)
            if key not in self.replies:
                if self.failure is not None:
                    raise self.failure
                raise TimeoutError(f"shard [{self.lo}, {self.hi}): piece {key} was not answered in time")
            self.pieces.pop(key, None)
            return self.replies.pop(key)

    # -- the coordinator's side -----------------------------------------------------------------
    def step(self, e: ShardStep) -> None:
        """Apply one log entry (the entries come in the coordinator's order)."""
        try:
            with self.cond:
                self._step(e)
        except BaseException as err:
            with self.cond:
                self.failure = err
                for ready in self.ready.values():
                    ready.set()
                self.cond.notify_all()
            raise

    def _step(self, e: ShardStep) -> None:
        need = [(r.stream, r.ordinal) for r in e.apply] + [(a.stream, a.ordinal) for a in e.answer]
        if not self.cond.wait_for(lambda: all(k in self.pieces for k in need), timeout=self.timeout_s):
            missing = [k for k in need if k not in self.pieces]
            raise TimeoutError(f"shard [{self.lo}, {self.hi}): pieces {missing} of version {e.version} "
                               "never came")
        if e.apply:
            payloads = [self.pieces[(r.stream, r.ordinal)].payload for r in e.apply]
            deltas = [self._checked(r, payload) for r, payload in zip(e.apply, payloads)]
            if len(deltas) == 1:  # decoded once: what apply_deltas does with a lone payload
                apply_decoded(self.ps, deltas[0], e.apply[0].factor)
            else:
                apply_deltas(self.ps, payloads, [r.samples for r in e.apply], [r.factor for r in e.apply])
        if self.ps.version != e.version:
            raise ShardDisagrees(f"shard [{self.lo}, {self.hi}) is at version {self.ps.version}, the log at "
                                 f"{e.version}")
        if e.downlink > 0 and self.sparse_down:
            self._downlink(e.downlink)
        for a in e.answer:
            key = (a.stream, a.ordinal)
            have = -1 if a.retrain else self.pieces[key].have
            self.replies[key] = self.reply(have)
            ready = self.ready.get(key)
            if ready is not None:
                ready.set()

    def _checked(self, r, payload: bytes):
        """The piece decoded, its squared norm the one the coordinator's guard judged."""
        try:
            delta = codec.decode(payload, self.layout)
        except CodecError as err:
            raise ShardDisagrees(f"piece {(r.stream, r.ordinal)} was accepted but does not decode: "
                                 f"{err}") from None
        got, declared = sum_squares(delta), r.sumsq[self.index]
        if not math.isclose(got, declared, rel_tol=SUMSQ_RTOL, abs_tol=1e-30):
            raise ShardDisagrees(f"piece {(r.stream, r.ordinal)}: squared norm {got:.6g}, "
                                 f"declared {declared:.6g}")
        return delta

    def _downlink(self, density: float) -> None:
        dl = self.ps.downlink(density)
        if dl is None:
            return
        enc = codec.encode(dl.delta, self.layout, value_dtype="float32" if dl.assign else self.value_dtype)
        part = range_checksum(dl.checksum_after, self.outside)
        msg = DownlinkMsg(version=dl.version, base_version=dl.base_version, checksum_after=f"{part:016x}",
                          assign=dl.assign, payload=enc)
        self.downlinks = (self.downlinks + [msg])[-self.keep_downlinks:]

    def reply(self, have: int) -> ShardReply:
        """The range's weights part for a replica at ``have`` (-1: none), as the coordinator's reply
        chooses: W when the downlink is dense; nothing, the downlinks since ``have``, or U."""
        ps = self.ps
        if not self.sparse_down:
            return ShardReply(dense=ps.W[self.lo:self.hi].tobytes(), dense_version=ps.version)
        v = ps.view_version
        if have == v:
            return ShardReply(dense=b"", dense_version=v)
        dls = tuple(m for m in self.downlinks if m.version > have)
        if have >= 0 and dls and dls[0].base_version == have:
            return ShardReply(dense=b"", dense_version=v, downlinks=dls)
        return ShardReply(dense=ps.U[self.lo:self.hi].tobytes(), dense_version=v)

    # -- checkpoints ------------------------------------------------------------------------------
    def state(self) -> dict:
        """The range of W and U and the versions: this shard's part of a consistent cut."""
        with self.cond:
            st = self.ps.state_dict()
            return {"W": st["W"][self.lo:self.hi].copy(), "U": st["U"][self.lo:self.hi].copy(),
                    "version": st["version"], "view_version": st["view_version"]}

    def load(self, W: np.ndarray, U: np.ndarray, version: int, view_version: int) -> None:
        """Restore from full-length W and U (a checkpoint); the downlinks kept are forgotten.
        Outside the range W is taken as U: a residual there is another shard's to send."""
        W = np.array(W, np.float32, copy=True)
        W[:self.lo], W[self.hi:] = U[:self.lo], U[self.hi:]
        with self.cond:
            self.ps.load_state_dict({"W": W, "U": np.asarray(U, np.float32),
                                     "layout": np.asarray(self.layout, np.int64), "version": version,
                                     "view_version": view_version})
            self.outside = outside_checksum(self.ps.U, self.lo, self.hi)
            self.downlinks = []
