"""What a stream task computes from: its view of the server's weights and the lookahead.

``View`` holds W (dense downlink) or a checksummed replica of U and applies each reply's
weights part (with ``ps.shards`` > 1, the shards' parts merged); ``Lookahead`` extrapolates
the view by the measured staleness. Nothing here imports Spark.
"""

from __future__ import annotations

import numpy as np

from sparkcnn.buffers import aligned_empty
from sparkcnn.compression import native
from sparkcnn.protocol import Reply
from sparkcnn.worker.task import downlinks

FULL_CHECK_EVERY = 64  # replies between full checksums of the replica (each downlink is checked alone)


class ViewError(RuntimeError):
    """The shards' parts of one reply do not fit together."""


class View:
    """The weights this block computes from: W (dense downlink) or a checksummed replica of U."""

    def __init__(self, sparse: bool, layout):
        from sparkcnn.replica import Replica

        self.sparse, self.layout = sparse, layout
        self.replica = Replica() if sparse else None
        self.w: np.ndarray | None = None
        self.version = 0
        self.resyncs = 0
        self.replies = 0
        self.changed: np.ndarray | None = None  # what the last take moved: indices, or None (all of it)

    def take(self, reply: Reply, parts: list | None = None) -> int:
        """Apply a reply's weights part (with shards: their ``parts``, merged); returns the bytes."""
        if parts is not None:
            return self._take_parts(reply, parts)
        nbytes = len(reply.dense) + sum(len(m.payload) for m in reply.downlinks)
        self.changed = _NOTHING
        if reply.dense:  # W itself, or a dense copy of U (start, resync)
            self.changed = None
            w = np.frombuffer(reply.dense, np.float32)
            if self.sparse:
                self.replica.load_snapshot(reply.dense_version, w.copy())
                if reply.plan is None:
                    self.resyncs += 1
            else:
                self.w = w
            self.version = reply.dense_version
        if self.sparse and reply.downlinks:
            dls = downlinks(reply.downlinks, self.layout)
            # each downlink is checked by its O(nnz) checksum; the full O(P) pass only every
            # FULL_CHECK_EVERY replies (at H = 1 it would cost ~1 ms of every step)
            self.replies += 1
            self.replica.apply(dls, full_check=self.replies % FULL_CHECK_EVERY == 0)
            self.version = self.replica.version
            if self.changed is not None:
                self.changed = np.concatenate([d.delta.indices for d in dls])
        return nbytes

    def _take_parts(self, reply: Reply, parts: list) -> int:
        """The shards' parts of one reply: dense ranges, concatenated, or the parts of the same
        downlinks, merged (:func:`sparkcnn.shards.merge_downlinks`), at the coordinator's version."""
        from sparkcnn.shards import merge_downlinks

        if any(p.dense_version != reply.dense_version for p in parts):
            raise ViewError(f"shards answered at versions {[p.dense_version for p in parts]}, the server at "
                             f"{reply.dense_version}")
        nbytes = sum(len(p.dense) + sum(len(m.payload) for m in p.downlinks) for p in parts)
        dense = [p.dense for p in parts]
        if all(dense):
            whole = b"".join(dense)
            return nbytes - len(whole) + self.take(Reply(**{**_head(reply), "dense": whole}))
        if any(dense):
            raise ViewError("shards answered one reply with dense ranges and downlinks at once")
        dls = merge_downlinks([downlinks(p.downlinks, self.layout) for p in parts],
                              [[int(m.checksum_after, 16) for m in p.downlinks] for p in parts])
        self.changed = _NOTHING
        if dls:
            self.replies += 1
            self.replica.apply(dls, full_check=self.replies % FULL_CHECK_EVERY == 0)
            self.version = self.replica.version
            self.changed = np.concatenate([d.delta.indices for d in dls])
        return nbytes

    @property
    def weights(self) -> np.ndarray:
        return self.replica.U if self.sparse else self.w


def _head(reply: Reply) -> dict:
    return {f: getattr(reply, f) for f in ("lr", "density", "tau", "retrain", "send_state", "refused",
                                            "dense_version", "plan")}


class Lookahead:
    """Delay compensation: the weights a step's update will land on, extrapolated.

    With the push of step t in flight while step t+1 computes, a block's update
    lands ``tau`` server versions after the view it was computed from (the
    server measures ``tau`` and says it in each reply). Momentum makes the
    server's motion smooth, so the task computes at

        view + tau · (view − previous view) / (versions between them)

    rather than at the view (measured: at one step per exchange the plain view
    kept the per-step runs near 0.8, DESIGN §3). ``tau = 0`` is the view itself.

    A sparse view moves only where its downlinks land, so the velocity is zero
    elsewhere: given the indices a reply moved (``changed``), both the velocity
    and the extrapolated weights are updated there and where the velocity was
    non-zero, in O(nnz), bitwise the full passes (each of which cost ~0.25 ms of
    every step at one step per exchange); ``changed=None`` (a dense copy) runs them.
    """

    def __init__(self):
        self.prev: np.ndarray | None = None
        self.prev_version = -1
        self.velocity: np.ndarray | None = None
        self.out: np.ndarray | None = None
        self.tau = 0
        self.moving: np.ndarray | None = None  # where the velocity may be non-zero (None: anywhere)
        self.dirty: np.ndarray | None = None   # where ``out`` is out of date (None: everywhere)

    def observe(self, w: np.ndarray, version: int, tau: int | None,
                changed: np.ndarray | None = None) -> None:
        """The view ``w`` at ``version``; ``changed``: the indices moved since the last call (None: any)."""
        retau = tau is not None and int(tau) != self.tau
        if retau:
            self.tau = int(tau)
        if (self.velocity is not None and changed is not None and self.moving is not None and self.tau > 0
                and self.dirty is not None and version > self.prev_version and native.enabled()):
            # ``out`` is current but for ``dirty``: it moves where the velocity does (the last
            # motion's indices, which a new tau also moves, and this one's) in the same pass,
            # not in a compiled call of its own in weights(): each such call gives the GIL up
            # and waits to take it back from the push thread (~0.2-0.3 ms of wall clock per
            # step in a profile of the executors at one step per exchange, little of it CPU)
            s = np.float32(1.0 / (version - self.prev_version))
            self.prev_version = version
            native.velocity_step_out_at(w, self.prev, self.velocity, s, self.moving, changed,
                                        np.float32(self.tau), self.out)
            self.moving = changed
            return
        if retau:
            self._stale(self.moving)
        if self.prev is None:
            self.prev, self.prev_version = w.copy(), version
            return
        if version <= self.prev_version:
            if changed is None or changed.size:  # moved, same version: the next motion is measured in full
                self.moving = None
                self._stale(changed)
            return
        s = np.float32(1.0 / (version - self.prev_version))
        self.prev_version = version
        if self.velocity is not None and changed is not None and self.moving is not None:
            v, p = self.velocity, self.prev
            self._stale(self.moving)
            if native.enabled():
                native.velocity_step_at(w, p, v, s, self.moving, changed)
            else:
                v[self.moving] = 0.0  # w == prev there now: (w - prev) · s is +0
                v[changed] = (w[changed] - p[changed]) * s
                p[changed] = w[changed]
            self.moving = changed
            self._stale(changed)
            return
        if self.velocity is None:  # ``out`` aligned: the gradient's TF call reads it in place
            self.velocity = np.empty_like(self.prev)
            self.out = aligned_empty(self.prev.shape, self.prev.dtype)
        if native.enabled():  # one pass instead of three, bitwise the same
            native.velocity_step(w, self.prev, self.velocity, s)
        else:
            np.subtract(w, self.prev, out=self.velocity)
            self.velocity *= s
            np.copyto(self.prev, w)
        self.moving = np.flatnonzero(self.velocity)
        self.dirty = None

    def _stale(self, idx: np.ndarray | None) -> None:
        """``out`` must be recomputed at ``idx`` (None: everywhere)."""
        if self.dirty is None or idx is None or self.dirty.size + idx.size > self.out.size // 4:
            self.dirty = None  # (a full pass is as cheap)
        else:
            self.dirty = np.concatenate([self.dirty, idx])

    def weights(self, w: np.ndarray) -> np.ndarray:
        """The extrapolated weights (a buffer reused by the next call), or ``w`` itself."""
        if self.velocity is None or self.tau <= 0:
            return w
        a = np.float32(self.tau)
        if self.dirty is None:
            if native.enabled():
                native.axpy(self.tau, self.velocity, w, self.out)
            else:
                np.multiply(self.velocity, a, out=self.out)
                self.out += w
        elif self.dirty.size:
            d = self.dirty
            if native.enabled():
                native.axpy_at(a, self.velocity, w, self.out, d)
            else:
                self.out[d] = self.velocity[d] * a + w[d]
        self.dirty = _NOTHING
        return self.out


_NOTHING = np.empty(0, np.int64)
