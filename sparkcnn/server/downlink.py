"""The schedule of a run and its downlink: what the server sends the workers.

:class:`Schedule`: the learning rate and both densities at a fractional epoch, after
their warm-ups and the guard's factors (a spike halves the lr or raises the density).

:class:`Downlink`: model-parameter sparsification (DESIGN §3). After an update::

    D = sparsify(W - U, density_down);  U += D     # ps.downlink

the latest ``D`` ship inline with the next orders (or replies); dense weights (W when the
downlink is dense, else the view U) go as one broadcast per version, kept alive while
orders in flight may read them.

The cadence check, ``D``, its encoding and its entry in the log are one critical section of
the parameter server's lock, and a reply reads the log or ``U`` inside it too: so the log is
one sequence in version order even when several server processes share the weights and the log
(:class:`~sparkcnn.server.sharedstore.SharedStore`, in place of the :class:`InlineLog`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from sparkcnn.compression import codec
from sparkcnn.compression.plan import density as plan_density
from sparkcnn.compression.warmup import density_at, lr_at
from sparkcnn.protocol import DownlinkMsg


class Factors:
    """The guard's multipliers of the lr and the density, in this process (a
    :class:`~sparkcnn.server.sharedstore.SharedStore` keeps them for every server process)."""

    def __init__(self):
        self.lr = 1.0        # halved by the guard on a loss spike
        self.density = 1.0   # raised by the guard on a loss spike

    def scale(self, lr: float = 1.0, density: float = 1.0, density_max: float = math.inf) -> None:
        self.lr, self.density = self.lr * lr, min(density_max, self.density * density)

    def load_factors(self, lr: float, density: float) -> None:
        self.lr, self.density = lr, density


class Schedule:
    """(lr, density) at a fractional epoch: warm-ups, the lr schedule and the guard's factors
    (``factors``: where they are kept, default this process)."""

    def __init__(self, cfg, plan, factors=None):
        self.train, self.compression, self.plan = cfg.train, cfg.compression, plan
        self.factors = Factors() if factors is None else factors

    @property
    def lr_factor(self) -> float:
        return self.factors.lr

    @property
    def density_factor(self) -> float:
        return self.factors.density

    def _warmed(self, epoch: float, target: float, initial: float | None = None) -> float:
        """``target`` after the exponential density warm-up from ``initial`` (default
        ``compression.initial_density``) over ``warmup_epochs``."""
        c = self.compression
        return density_at(epoch, initial=max(initial or c.initial_density, target), target=target,
                          warmup_epochs=c.warmup_epochs)

    def at(self, epoch: float) -> tuple[float, float]:
        """(learning rate, uplink density) at a fractional ``epoch``, warm-ups and guard included."""
        t, c = self.train, self.compression
        lr = lr_at(epoch, base_lr=t.lr, warmup_epochs=t.lr_warmup_epochs, total_epochs=t.epochs,
                   schedule=t.lr_schedule) * self.lr_factor
        return lr, plan_density(self.plan, self.density_factor * self._warmed(epoch, c.density))

    def down_density(self, epoch: float) -> float:
        """``compression.density_down`` after the density warm-up, which starts at
        ``initial_density_down`` (0: ``initial_density``): early updates are large and dense,
        and a view that lags them slows training most; but a replica follows every downlink the
        pushes of all blocks make (one per ceil(N / 2) results, server/exchange.py), so a start
        below the uplink's keeps a slow link's downlink in step."""
        c = self.compression
        return min(1.0, self._warmed(epoch, c.density_down, c.initial_density_down))

    def halve_lr(self) -> None:
        self.factors.scale(lr=0.5)

    def raise_density(self) -> None:
        self.factors.scale(density=4, density_max=1.0 / max(self.compression.density, 1e-12))

    def state_dict(self) -> dict:
        return {"lr_factor": self.lr_factor, "density_factor": self.density_factor}

    def load_state_dict(self, st: dict) -> None:
        self.factors.load_factors(st["lr_factor"], st["density_factor"])


@dataclass(frozen=True)
class OrderWeights:
    """The weights part of a jobs-transport order (``ExchangeOrder``'s fields of the same names)."""

    weights: object          # a broadcast of float32 bytes: W, or the view U
    weights_version: int
    downlinks: tuple = ()    # sparse downlink: the latest DownlinkMsgs, oldest first


@dataclass(frozen=True)
class ReplyWeights:
    """The weights part of a stream reply (``Reply``'s fields of the same names)."""

    dense: bytes
    dense_version: int
    downlinks: tuple = ()


NO_CPU = (0.0, 0.0, 0.0)


class InlineLog:
    """The latest ``keep`` downlinks, in this process, oldest first."""

    def __init__(self, keep: int):
        self.keep = keep
        self._messages: list[DownlinkMsg] = []

    def resize(self, keep: int) -> None:
        self.keep = keep

    def append(self, msg: DownlinkMsg) -> None:
        self._messages = (self._messages + [msg])[-self.keep:]

    def since(self, have: int) -> tuple[DownlinkMsg, ...]:
        """The downlinks kept that reach past version ``have``, oldest first."""
        return tuple(m for m in self._messages if m.version > have)

    def latest(self) -> tuple[DownlinkMsg, ...]:
        return tuple(self._messages)


class Downlink:
    """D = sparsify(W - U) after updates, its inline messages and the dense broadcasts.

    ``cpu``: the thread CPU seconds of the last :meth:`send` (the whole downlink, the scan's
    choice of entries within it, its encoding); ``NO_CPU`` when it made none."""

    def __init__(self, ps, spec, backend, *, keep_broadcasts: int, inline: int, log=None):
        self.ps, self.spec, self.backend = ps, spec, backend
        self.sparse = spec.sparse_downlink
        self.keep_broadcasts = keep_broadcasts  # older broadcasts orders in flight may still read
        # the latest downlinks kept for orders and replies (a shared store's, with several servers)
        self.log = InlineLog(inline) if log is None else log
        self._bcast = None
        self._bcast_version = -1
        self._old: list = []
        self.cpu = NO_CPU

    @property
    def inline(self) -> int:
        """How many of the latest downlinks are kept."""
        return self.log.keep

    @property
    def messages(self) -> tuple[DownlinkMsg, ...]:
        """The downlinks kept, oldest first."""
        return self.log.latest()

    def keep_inline(self, n: int) -> None:
        """Keep the latest ``n`` downlinks (async jobs: the jobs in flight may trail that many)."""
        self.log.resize(n)

    def order_weights(self, version: int) -> OrderWeights:
        """W (dense downlink) or the view U and the latest downlinks."""
        if not self.sparse:
            return OrderWeights(self._broadcast_at(version, self.ps.W), version)
        v = self.ps.view_version
        return OrderWeights(self._broadcast_at(v, self.ps.U), v, self.messages)

    def _broadcast_at(self, version: int, array: np.ndarray):
        """A broadcast of ``array``'s bytes at ``version``, made once per version."""
        if self._bcast is None or self._bcast_version != version:
            if self._bcast is not None:
                self._old.append(self._bcast)
                while len(self._old) > self.keep_broadcasts:
                    self.backend.unpersist(self._old.pop(0))
            self._bcast = self.backend.broadcast(array.tobytes())
            self._bcast_version = version
        return self._bcast

    def send(self, density: float, every: int = 1, shards=None) -> int:
        """After an update: D = sparsify(W − U), U += D; kept for the next orders. Returns the
        entries of D (P for the dense downlink, which ships W itself). ``every``: only once the
        view is that many versions behind (0 entries until then). ``shards``: they make it."""
        self.cpu = NO_CPU
        if not self.sparse:
            return int(self.ps.W.size)
        if shards is not None:  # its entries are the shards' to count
            if shards.version - shards.view_version >= every:
                shards.downlink(density)
            return 0
        with self.ps.lock:  # the cadence, D and its place in the log: one section (module docstring)
            if self.ps.version - self.ps.view_version < every:
                return 0
            c0 = time.thread_time()
            dl = self.ps.downlink(density)
            if dl is None:
                return 0
            c1 = time.thread_time()
            enc = codec.encode(dl.delta, self.spec.layout,
                               value_dtype="float32" if dl.assign else self.spec.value_dtype)
            self.log.append(DownlinkMsg(version=dl.version, base_version=dl.base_version,
                                        checksum_after=dl.checksum_after, assign=dl.assign, payload=enc))
            c2 = time.thread_time()
        self.cpu = (c2 - c0, self.ps.select_cpu_s, c2 - c1)
        return int(dl.delta.nnz)

    def since(self, have: int) -> ReplyWeights:
        """A stream reply's weights: W (dense downlink), or the downlinks since ``have``, or a
        dense copy of U when the replica cannot follow them (a start, a refusal, a long lag) or
        when they weigh more than the copy (a replica many warm-up downlinks behind)."""
        with self.ps.lock:  # W and its version, or the log and U at the view's version, as one
            if not self.sparse:
                return ReplyWeights(self.ps.W.tobytes(), self.ps.version)
            v = self.ps.view_version
            if have == v:
                return ReplyWeights(b"", v)
            dls = self.log.since(have)
            if (have >= 0 and dls and dls[0].base_version == have
                    and sum(len(m.payload) for m in dls) < 4 * self.ps.U.size):
                return ReplyWeights(b"", v, dls)
            return ReplyWeights(self.ps.U.tobytes(), v)
