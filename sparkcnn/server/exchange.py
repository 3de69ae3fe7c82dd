"""What an arrived result does to the server: the exchange rules, owned once (DESIGN §10).

Every transport hands :class:`~sparkcnn.server.run.Run` an :class:`~sparkcnn.protocol.Arrival`;
the run hands it here::

    ASGD, each result as it arrives:
        dedup: seq <= the block's last applied seq  ->  duplicate (counted)
        tau = version_now - r.base_version
        tau > ps.max_staleness:  dropped (stale_dropped); the block's cursor stays, so it trains
                                 those steps again, from its state before them and a dense view
        else:  W -= lambda(tau) * s(r.lr) * S_k / N;  cursor += r.steps
               downlink once every c = ceil(N / 2) applied results (version - view_version >= c)

    BSP, round ``seq`` once every block's result of it is in (held until then):
        dedup: seq <= the block's last applied seq, or its result of the round already held
        W -= sum_k (n_k / sum n) * s(r.lr) * S_k;  downlink;  cursors

``s(lr)`` is the momentum policy's server scale (``compression.feedback.server_scale``);
the lr and density are those the result was trained with (it carries them).

Why the ASGD downlink has a cadence: every replica follows every downlink, so a block
that pushes once while the N - 1 others push receives about N downlinks per reply. With
a downlink per result, each block would receive N · density_down · P entries per push
(measured with ``bench/psload.py`` at 64 blocks: ~0.6 MB per reply, 210 pushes/s and
4.3 ms of server CPU per push), where the seeds' GS-ASGD sends each worker the top
``density_down`` of the accumulated update per push. One downlink per ceil(N / 2)
results keeps a reply at about two downlinks whatever N, and spreads their selection
over the results between them; at N <= 2 it is a downlink per result. ``ps.downlink_every``
sets c instead (:func:`downlink_cadence`; 1: the rule before the cadence, which
``bench/cadence.py`` compares with it).

Every (block, epoch, step) is applied exactly once: a result moves its block's cursor
only when it is applied, and a dropped one is trained again over the same steps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sparkcnn.checkpoint import int_keys, json_keys
from sparkcnn.compression.feedback import server_scale
from sparkcnn.protocol import Arrival
from sparkcnn.server.apply import Applied, apply_deltas
from sparkcnn.staleness import held_back, staleness_scale

log = logging.getLogger(__name__)


def downlink_cadence(every: int, num_blocks: int) -> int:
    """ASGD: applied results per downlink, ``ps.downlink_every`` (0: ceil(N / 2), module docstring)."""
    return every if every > 0 else -(-num_blocks // 2)


class Progress:
    """The run's applied exchanges and samples, counted in this process. With several server
    processes a :class:`~sparkcnn.server.sharedstore.SharedStore` counts them for all, atomically."""

    def __init__(self):
        self.exchanges = 0  # applied exchanges (records of kind "round")
        self.samples = 0    # samples they applied

    def count(self) -> int:
        """Number an applied exchange: the count of them before it."""
        self.exchanges += 1
        return self.exchanges - 1

    def add_samples(self, n: int) -> None:
        self.samples += n

    def load_progress(self, exchanges: int, samples: int) -> None:
        self.exchanges, self.samples = exchanges, samples


class Cursors:
    """Where each block is in its data: passes done, minibatches into the current pass, the
    last applied seq (its state's tag), and the samples applied in all (``progress``)."""

    STATE = ("block_epoch", "block_step", "last_seq")  # int-keyed, checkpointed

    def __init__(self, pass_steps: dict[int, int], batch_size: int, progress=None):
        self.pass_steps = dict(pass_steps)  # steps in a block's pass (sync stream: the smallest block's)
        self.block_epoch = {k: 0 for k in pass_steps}
        self.block_step = {k: 0 for k in pass_steps}
        self.last_seq = {k: -1 for k in pass_steps}
        self.progress = Progress() if progress is None else progress
        self.epoch_samples = sum(self.pass_steps.values()) * batch_size  # one pass over every block

    @property
    def samples_done(self) -> int:
        return self.progress.samples

    @samples_done.setter
    def samples_done(self, n: int) -> None:
        self.progress.load_progress(self.progress.exchanges, n)

    @property
    def epoch_float(self) -> float:
        return self.samples_done / max(1, self.epoch_samples)

    def cursor(self, block: int) -> int:
        """Minibatches ``block`` has had applied since the run began (its next step's index)."""
        return self.block_epoch[block] * self.pass_steps[block] + self.block_step[block]

    def advance(self, r: Arrival) -> None:
        """An applied result moves its block's cursor by its steps, and the samples done."""
        self.last_seq[r.block] = r.seq
        self.progress.add_samples(r.samples)
        self.block_step[r.block] += r.steps
        if self.block_step[r.block] >= self.pass_steps[r.block]:
            self.block_epoch[r.block] += 1
            self.block_step[r.block] = 0

    def state_dict(self) -> dict:
        return {"samples_done": self.samples_done, **{k: json_keys(getattr(self, k)) for k in self.STATE}}

    def take_blocks(self, st: dict, blocks) -> None:
        """The cursors of ``blocks`` from ``st`` (a :meth:`state_dict`: another process's, whose
        server process moved them)."""
        for key in self.STATE:
            got, mine = int_keys(st[key]), getattr(self, key)
            mine.update({b: got[b] for b in blocks})

    def load_state_dict(self, st: dict) -> None:
        self.samples_done = int(st["samples_done"])  # the count of exchanges: Exchange.load_state_dict
        self.block_epoch, self.block_step, self.last_seq = (int_keys(st[k]) for k in self.STATE)


@dataclass(frozen=True)
class Taken:
    """What the exchange did with one arrival (see :class:`sparkcnn.server.run.Decision`)."""

    kind: str                        # "applied", "duplicate", "retrain" or "held" (BSP, round not complete)
    number: int = -1                 # applied: the exchange's number in the run (0, 1, ...)
    tau: int = 0                     # its staleness
    applied: tuple[Arrival, ...] = ()  # the results applied with it (BSP: the whole round)
    out: Applied | None = None
    scale: float = 1.0


class Exchange:
    """Dedup, staleness, drop and resync, lambda(tau)/N and the apply (module docstring)."""

    def __init__(self, ps, guard, spec, counters, cursors: Cursors, *, rule: str, max_staleness: int,
                 bsp: bool):
        self.ps, self.guard, self.spec, self.counters, self.cursors = ps, guard, spec, counters, cursors
        self.rule, self.max_staleness, self.bsp = rule, max_staleness, bsp
        self.staleness_hist: dict[int, int] = {}
        self.resync: set[int] = set()             # blocks whose next work starts from a dense view
        self.held: dict[int, dict[int, Arrival]] = {}  # BSP: seq -> block -> its result, until complete

    @property
    def exchanges(self) -> int:
        """Applied exchanges (records of kind "round"), in the run: every server's."""
        return self.cursors.progress.exchanges

    @property
    def num_blocks(self) -> int:
        return len(self.cursors.pass_steps)

    def duplicate(self, r: Arrival) -> bool:
        """The one dedup rule: the block has moved past ``r.seq``, or (BSP) holds it already."""
        return r.seq <= self.cursors.last_seq[r.block] or r.block in self.held.get(r.seq, {})

    def take(self, r: Arrival, version: int, shards=None) -> Taken:
        if self.duplicate(r):
            self.counters.add("duplicates_dropped")
            return Taken("duplicate")
        if self.bsp:
            got = self.held.setdefault(r.seq, {})
            got[r.block] = r
            if len(got) < self.num_blocks:
                return Taken("held")
            return self.take_round(r.seq, version, shards)
        tau = version - r.base_version
        self.staleness_hist[tau] = self.staleness_hist.get(tau, 0) + 1
        if held_back(tau, self.max_staleness):
            self.counters.add("stale_dropped")
            self.resync.add(r.block)
            log.warning("exchange %s block %s: staleness %s > ps.max_staleness %s; dropped, trained again",
                        r.seq, r.block, tau, self.max_staleness)
            return Taken("retrain", tau=tau)
        self.resync.discard(r.block)
        scale = staleness_scale(tau, self.rule) / self.num_blocks
        out = self.apply([r], r.lr, scale, shards)
        self.cursors.advance(r)
        return Taken("applied", self._count(), tau=tau, applied=(r,), out=out, scale=scale)

    def take_round(self, seq: int, version: int, shards=None) -> Taken:
        """BSP: apply what is held of round ``seq`` together, samples-weighted."""
        fresh = tuple(self.held.pop(seq, {}).values())
        tau = max((version - r.base_version for r in fresh), default=0)
        out = self.apply(list(fresh), fresh[0].lr if fresh else 0.0, 1.0, shards)
        for r in fresh:
            self.cursors.advance(r)
        return Taken("applied", self._count(), tau=tau, applied=fresh, out=out)

    def _count(self) -> int:
        """Number an applied exchange; the count of them so far."""
        return self.cursors.progress.count()

    def apply(self, results: list[Arrival], lr: float, factor: float, shards=None) -> Applied:
        """``W −= Σ_k factor·s(lr)·(n_k / Σ n)·S_k`` over the results that decode and pass the guard
        (``s(lr)``: the momentum policy's server scale). Each rejected one is logged and counted."""
        scale = factor * server_scale(self.spec.method, self.spec.momentum_mode, self.spec.per_step, lr)
        if shards is not None:  # ps.shards > 1: judged here, applied by the shards
            out = shards.apply(results, scale, self.guard)
        else:
            out = apply_deltas(self.ps, [r.payload for r in results], [r.samples for r in results],
                               [scale] * len(results), guard=self.guard, steps=[r.steps for r in results])
        for k, why in sorted(out.rejected.items()):
            log.error("exchange %s block %s: delta rejected: %s", results[k].seq, results[k].block, why)
        self.counters.add("rejected_deltas", len(out.rejected))
        return out

    def take_part(self, st: dict, blocks) -> None:
        """``ps.servers`` > 1: the cursors and resync marks of ``blocks`` from ``st``, the
        :meth:`state_dict` of the server process that serves them."""
        self.cursors.take_blocks(st, blocks)
        self.resync = (self.resync - set(blocks)) | {int(k) for k in st["resync"] if int(k) in blocks}

    def load_staleness(self, hist: dict[int, int]) -> None:
        """``ps.servers`` > 1: the run's staleness histogram, every server's added up."""
        self.staleness_hist = dict(hist)

    def state_dict(self) -> dict:
        return {"exchanges": self.exchanges, "resync": sorted(self.resync),
                "staleness_hist": json_keys(self.staleness_hist), **self.cursors.state_dict()}

    def load_state_dict(self, st: dict) -> None:
        self.resync = {int(k) for k in st.get("resync", ())}
        self.staleness_hist = int_keys(st["staleness_hist"])
        self.cursors.load_state_dict(st)
        self.cursors.progress.load_progress(int(st["exchanges"]), int(st["samples_done"]))
