"""A run's rules, Spark-free: every arrived result goes through :meth:`Run.accept`.

    decision = run.accept(arrival)        # the one entry for a result, from any transport
        duplicate  ->  counted, nothing changes
        retrain    ->  too stale: dropped, the block trains those steps again (ASGD)
        held       ->  BSP: kept until every block's result of its round is in
        applied    ->  W updated (server/exchange.py), the downlink sent (server/downlink.py),
                       the guard judged the loss (a collapse raises Diverged: the run stops,
                       exit 3), and the decision says which epoch ends the applied samples
                       crossed and whether a checkpoint is due (server/checkpoints.py)
    run.write(decision, timings, where)   # the record, with what the transport measured
    run.chaos_after(exchange)             # fault drills, once the transport has acted on it

The transport acts on the decision (evaluates, checkpoints, replies, retrains); it keeps
no rule, counter, record or checkpoint code of its own.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
from dataclasses import dataclass

import numpy as np

from sparkcnn.compression.plan import plan
from sparkcnn.compression.sparsify import Sparsifier
from sparkcnn.errors import Diverged
from sparkcnn.guard import DivergenceGuard
from sparkcnn.protocol import Arrival
from sparkcnn.ps import ParameterServer
from sparkcnn.server.checkpoints import Checkpoints
from sparkcnn.server.downlink import Downlink, Schedule
from sparkcnn.server.exchange import Cursors, Exchange
from sparkcnn.server.records import Counters, ExchangeRecord, Records, Timings, Where
from sparkcnn.staleness import resolve_rule

log = logging.getLogger(__name__)

APPLIED, DUPLICATE, RETRAIN, HELD = "applied", "duplicate", "retrain", "held"


@dataclass(frozen=True)
class Decision:
    """What :meth:`Run.accept` did with a result, and what the transport should do next."""

    kind: str                           # APPLIED, DUPLICATE, RETRAIN or HELD
    tau: int = 0                        # its staleness (BSP: the round's largest)
    record: ExchangeRecord | None = None  # applied: the exchange's record, for Run.write
    epoch_ends: tuple[int, ...] = ()    # applied: epochs whose end the applied samples crossed
    checkpoint: bool = False            # applied: checkpoint.every_rounds' cadence is due
    blocks: tuple[int, ...] = ()        # applied: the blocks whose results it applied


@dataclass(frozen=True)
class RunShape:
    """How a transport lays the run out: steps per pass of each block, and its staleness."""

    pass_steps: dict                    # block -> steps of its pass (sync stream: the smallest block's)
    bsp: bool                           # rounds of every block together (sync) or each on arrival
    compensated: bool = False           # the workers compensate staleness (the stream's lookahead)
    downlink_every: int = 1             # ASGD: applied results per downlink (server/exchange.py)
    keep_broadcasts: int = 2            # dense broadcasts orders in flight may still read
    inline_downlinks: int = 1           # downlinks kept for orders and replies


class Run:
    """Server state and rules of one run (module docstring)."""

    def __init__(self, cfg, spec, weights: np.ndarray, shape: RunShape, *, backend, evaluate,
                 progress=None, run_dir: str | None = None, shared=None):
        """``shared``: a :class:`~sparkcnn.server.sharedstore.SharedStore` that keeps W, U, the
        versions, the downlink log, the count of applied exchanges and samples and the guard's
        factors for every server process of the run (``ps.servers`` > 1); None: this process does."""
        self.cfg, self.spec, self.shape = cfg, spec, shape
        c = cfg.compression
        self.schedule = Schedule(cfg, plan(c.method, c.value_dtype, cfg.train.steps_per_round),
                                 factors=shared)
        ps = ParameterServer(np.array(weights, np.float32, copy=True), spec.layout,
                             density_down=c.density_down if spec.sparse_downlink else None,
                             sparsifier=Sparsifier(self.schedule.plan.selector, c.dense_below),
                             value_dtype=spec.value_dtype, candidates=cfg.ps.downlink_candidates,
                             memory=shared)
        g = cfg.guard
        guard = DivergenceGuard(g.max_norm_factor, g.loss_spike_factor, loss_samples=g.loss_samples,
                                warmup_steps=g.warmup_steps,
                                chance_loss=math.log(spec.num_classes) if spec.num_classes > 1 else None)
        self.counters = Counters()
        cursors = Cursors(shape.pass_steps, cfg.train.batch_size, progress=shared)
        self.exchange = Exchange(ps, guard, spec, self.counters, cursors,
                                 rule=resolve_rule(cfg.ps.staleness, shape.compensated),
                                 max_staleness=cfg.ps.max_staleness, bsp=shape.bsp)
        self.downlink = Downlink(ps, spec, backend, keep_broadcasts=shape.keep_broadcasts,
                                 inline=shape.inline_downlinks, log=shared)
        self.records = Records(progress)
        self.checkpoints = Checkpoints(run_dir, cfg.checkpoint.every_rounds)
        self.evaluator = evaluate  # (W, epoch) -> test loss, accuracy and samples: the transport's job
        self.shards = None         # ps.shards > 1: the stream's shard processes (attach_shards)
        self.next_eval = 1         # the next epoch end to evaluate

    # -- views ------------------------------------------------------------------------------
    @property
    def ps(self) -> ParameterServer:
        return self.exchange.ps

    @property
    def guard(self) -> DivergenceGuard:
        return self.exchange.guard

    @property
    def cursors(self) -> Cursors:
        return self.exchange.cursors

    @property
    def W(self) -> np.ndarray:
        return self.ps.W

    @property
    def version(self) -> int:
        return self.ps.version if self.shards is None else self.shards.version

    @property
    def history(self) -> list[dict]:
        return self.records.history

    @property
    def epoch_float(self) -> float:
        return self.cursors.epoch_float

    @property
    def epoch(self) -> int:
        """The epoch the applied samples are in (the last one once every sample is applied)."""
        c = self.cursors
        return min(int(c.epoch_float - 1e-9) if c.samples_done else 0, self.cfg.train.epochs - 1)

    def schedule_now(self) -> tuple[float, float]:
        """(lr, density) for work ordered now, at the applied samples' epoch."""
        return self.schedule.at(min(self.epoch_float, self.cfg.train.epochs))

    def attach_shards(self, shards) -> None:
        """ps.shards > 1: W and U live in ``shards`` from now on (None: back in this process)."""
        self.shards = shards

    def keep_inline_downlinks(self, n: int) -> None:
        self.downlink.keep_inline(n)

    # -- the one entry for a result -------------------------------------------------------------
    def accept(self, r: Arrival, *, inline_bytes: int = 0, at: tuple[int, int] | None = None) -> Decision:
        """Take one block's result (module docstring). ``inline_bytes``: downlink bytes its order
        carried; ``at``: (epoch, round in it) when the transport counts epochs by rounds (sync jobs)."""
        ex = self.exchange
        cursor = (ex.cursors.block_epoch[r.block], ex.cursors.block_step[r.block])
        taken = ex.take(r, self.version, self.shards)
        if taken.kind == "duplicate":
            return Decision(DUPLICATE)
        self.records.count_executor(r.executor)
        if taken.kind in ("held", "retrain"):
            return Decision(HELD if taken.kind == "held" else RETRAIN, tau=taken.tau)
        return self._applied(taken, inline_bytes, at, None if ex.bsp else (r.block, *cursor))

    def held_blocks(self, seq: int) -> tuple[int, ...]:
        """BSP: the blocks whose result of round ``seq`` is held, waiting for the others."""
        return tuple(self.exchange.held.get(seq, {}))

    def close_round(self, seq: int, *, inline_bytes: int = 0, at: tuple[int, int] | None = None) -> Decision:
        """BSP: apply round ``seq`` with the results that came (a jobs round that lost a block's)."""
        return self._applied(self.exchange.take_round(seq, self.version, self.shards), inline_bytes, at, None)

    def _applied(self, taken, inline_bytes: int, at: tuple | None, block: tuple | None) -> Decision:
        ex, rs = self.exchange, taken.applied
        for r in rs:  # each flag is rarely set: count only what happened (the driver's hot path)
            if r.state_reset:
                self.counters.add("state_resets")
            if r.state_stale:
                self.counters.add("stale_states")
            if r.replica_resync:
                self.counters.add("replica_resyncs")
        every = 1 if ex.bsp else self.shape.downlink_every
        density = self.schedule.down_density(self.epoch_float) if self.downlink.sparse else 1.0
        nnz_down = self.downlink.send(density, every, self.shards)
        samples, first = sum(r.samples for r in rs), rs[0] if rs else None
        where = {} if block is None else {"block": block[0], "block_epoch": block[1], "block_step": block[2],
                                          "scale": taken.scale}
        rec = ExchangeRecord(
            round=taken.number, seq=first.seq if first else -1, epoch=self.epoch if at is None else at[0],
            round_in_epoch=None if at is None else at[1], version=self.version,
            lr=first.lr if first else 0.0, density=first.density if first else 0.0,
            samples=samples, blocks=len(rs), steps=max((r.steps for r in rs), default=0), staleness=taken.tau,
            loss=sum(r.loss_sum for r in rs) / max(1, samples),
            accuracy=sum(r.correct for r in rs) / max(1, samples),
            bytes_up=sum(len(r.payload) for r in rs), nnz_up=sum(r.nnz for r in rs),
            # measured: inline downlink bytes per task + the dense bytes each task read
            bytes_down=inline_bytes * len(rs) + sum(r.view_bytes for r in rs), nnz_down=nnz_down,
            dense_bytes=4 * int(self.W.size) * len(rs), params=int(self.W.size),
            rejected=len(taken.out.rejected) if taken.out else 0,
            state_resets=sum(int(r.state_reset) for r in rs),
            replica_resyncs=sum(int(r.replica_resync) for r in rs), **where)
        self.check_loss(f"exchange {rec.round}", rec.loss, rec.samples)
        ends = tuple(range(self.next_eval - 1, min(int(self.epoch_float + 1e-9), self.cfg.train.epochs)))
        return Decision(APPLIED, tau=taken.tau, record=rec, epoch_ends=ends,
                        blocks=tuple(r.block for r in rs),
                        checkpoint=self.checkpoints.due(ex.exchanges))

    # -- the guard's actions ------------------------------------------------------------------
    def check_loss(self, tag: str, loss: float, samples: int | None = None) -> None:
        """Loss spike: act as ``guard.action`` says (halve the lr, raise the density, or stop).
        A loss back at chance level after the model had learned (the guard's chance rule) takes
        no action; ``guard.max_chance_in_a_row`` of them in a row stop the run (exit 3).
        ``samples``: the exchange's; the guard pools exchanges to ``guard.loss_samples``."""
        g, cg = self.guard, self.cfg.guard
        if not g.check_loss(loss, samples):
            if g.at_chance_now:
                chance = (f"{g.judged:.4g}, at or above chance level (ln {self.spec.num_classes} = "
                          f"{g.chance_loss:.4g}) after {g.best:.4g}")
                log.warning("%s: training loss %s", tag, chance)
                self.counters.add("losses_at_chance")
                if cg.max_chance_in_a_row and g.chance_in_a_row >= cg.max_chance_in_a_row:
                    raise Diverged(f"{tag}: training loss {chance}, {g.chance_in_a_row} judgments in a row: "
                                   f"the run collapsed (guard.max_chance_in_a_row={cg.max_chance_in_a_row})")
            return
        action, judged, limit = cg.action, g.judged, cg.max_spikes_in_a_row  # judged: the pooled mean
        log.warning("%s: loss %.4g is a spike; action %s", tag, judged, action)
        self.counters.add("loss_spikes")
        if action == "stop" or not math.isfinite(judged):
            raise Diverged(f"{tag}: training loss {judged:.4g} diverged (guard.action={action})")
        if limit and g.in_a_row >= limit:
            raise Diverged(f"{tag}: training loss {judged:.4g} spiked in {g.in_a_row} judgments in a row "
                           f"despite guard.action={action}: the run collapsed "
                           f"(guard.max_spikes_in_a_row={limit})")
        if action == "halve_lr":
            self.schedule.halve_lr()
        else:
            self.schedule.raise_density()

    # -- records ------------------------------------------------------------------------------
    def open_records(self, sink, history: list[dict] = (), epochs: list[dict] = (),
                     keep: bool = True) -> None:
        """Write records to ``sink``, after those a resumed run keeps (``history``, ``epochs``);
        ``keep``: False where another process keeps the run's history (a server process)."""
        self.records.open(sink, history, epochs, keep)

    def write(self, decision: Decision, timings: Timings, where: Where = Where(),
              progress_at: tuple | None = None) -> dict:
        """Write an applied exchange's record with what the transport measured."""
        return self.records.write(decision.record, progress_at, timings, where)

    def write_encoded(self, encoded: str, progress_at: tuple | None = None) -> dict:
        """An exchange record a server process wrote (``ps.servers`` > 1), its ``metrics.jsonl``
        line as that process encoded it, in this run's records."""
        return self.records.write_encoded(encoded, progress_at)

    def show(self, line: dict, progress_at: tuple) -> None:
        """A record already written, on the progress bar (when the transport shows it later)."""
        self.records.show(line, progress_at)

    def evaluate(self, epoch: int) -> dict:
        """Test loss and accuracy of ``W``, by the transport's evaluation."""
        return self.evaluator(self.W, epoch)

    def write_epoch(self, epoch: int, wall_s: float, on_epoch=None, *, staleness: bool = False,
                    exposed_comm_s: float | None = None) -> dict:
        """Evaluate on the test blocks and write the epoch record (``staleness``: with the histogram)."""
        erec = self.records.write_epoch(epoch, self.evaluate(epoch), wall_s, self.counters,
                                        staleness=self.exchange.staleness_hist if staleness else None,
                                        exposed_comm_s=exposed_comm_s)
        self.next_eval = max(self.next_eval, epoch + 2)
        if on_epoch:
            on_epoch(erec)
        return erec

    def summary(self, wall_s: float) -> dict:
        s = self.schedule
        # what the guard's actions on loss spikes left: the lr and density multipliers
        return {**self.records.summary(wall_s, self.counters),
                "guard_lr_factor": s.lr_factor, "guard_density_factor": s.density_factor}

    def chaos_after(self, exchange: int) -> None:
        """Fault drills: SIGKILL this driver (``chaos.kill_driver_round``), or its last shard
        process (``chaos.kill_shard_round``), once the transport has acted on exchange ``exchange``."""
        ch = self.cfg.chaos
        if ch.kill_driver_round == exchange:
            log.warning("chaos: SIGKILL of the driver after exchange %s", exchange)
            os.kill(os.getpid(), signal.SIGKILL)
        if ch.kill_shard_round == exchange and self.shards is not None:
            log.warning("chaos: SIGKILL of shard %s after exchange %s", len(self.shards.procs) - 1, exchange)
            self.shards.kill_last()

    # -- checkpoints --------------------------------------------------------------------------
    def checkpoint(self, position: int, transport_state: dict, blocks: dict, t0: float | None = None) -> str:
        """The run's state, the transport's own position and each block's state, as checkpoint
        ``r<position>`` (server/checkpoints.py)."""
        s = self.schedule
        state = {"counters": self.counters.as_dict(), **s.state_dict(), "guard": self.guard.state_dict(),
                 "records": len(self.records.history) + len(self.records.epochs),
                 "engine": {**transport_state, **self.exchange.state_dict(), "next_eval": self.next_eval},
                 "config": self.cfg.to_dict()}
        self.records.flush()  # the records the checkpoint covers are stored first
        return self.checkpoints.write(position, self.exchange.exchanges, self.ps.state_dict(), state, blocks,
                                      t0)

    def restore(self, ckpt) -> dict:
        """The run's state from a loaded checkpoint; returns the transport's own state."""
        st = ckpt.state
        self.ps.load_state_dict({**ckpt.arrays, **st["ps"]})
        self.counters.load(st["counters"])
        self.schedule.load_state_dict(st)
        self.guard.load_state_dict(st["guard"])
        self.exchange.load_state_dict(st["engine"])
        self.next_eval = int(st["engine"].get("next_eval", self.next_eval))
        self.checkpoints.restored(int(st["position"]))
        return st["engine"]
