"""Asynchronous parameter server (ASGD / GS-ASGD): one Spark job per block, applied on arrival.

A driver thread pool (threads reused) keeps every executor slot busy with
single-block jobs; the pure :class:`~sparkcnn.scheduler.AsyncPolicy` picks the
next block (stalest first, then locality), sizes its job to about
``scheduler.target_job_seconds`` and holds blocks back past
``ps.max_staleness``. The :class:`~sparkcnn.backends.monitor.LoadMonitor` tells
it the live task slots (fewer when an executor is lost, more when one joins;
``engine.threads`` fixes them), each executor's load and each block's speed.
Each result goes through the :class:`~sparkcnn.server.driver.RoundDriver` as
it arrives::

    ExchangeCore.accept: tau = version_now - base_version
    tau > ps.max_staleness:  dropped (stale_dropped); the block's next job trains the same steps
                             from its state before them and a reloaded view
    else:                    W -= lambda(tau) * S_k / N      # lambda = 1/tau (inverse) or 1 (none)

Blocks keep their own cursor through their data (a fast block simply starts
its next pass sooner); the global epoch is the number of samples processed
over the training set size, which drives the learning rate, the density
warm-up, evaluation, checkpoints (at epoch ends, and every ``checkpoint.every_rounds``
applied exchanges, at most one per 50 times the last one's cost) and the end of training.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from functools import partial

from sparkcnn.transport import tasks
from sparkcnn.server.driver import DriverShorthands, RoundDriver, timed
from sparkcnn.server.exchange import ExchangeCore
from sparkcnn.backends.monitor import LoadMonitor
from sparkcnn.protocol import RoundOrder, steps_per_epoch
from sparkcnn.scheduler import AsyncPolicy, DecisionKind, task_slots
from sparkcnn.staleness import resolve_rule

log = logging.getLogger(__name__)


class AsyncEngine(DriverShorthands):
    """Asynchronous jobs over the same driver, worker and records as sync mode."""

    def __init__(self, cfg, backend, spec, block_rows: dict[int, int], weights, sink=None, progress=None,
                 run_dir: str | None = None, pool_factory=None, monitor=None):
        self.cfg, self.backend, self.spec, self.block_rows = cfg, backend, spec, block_rows
        self.num_blocks = len(block_rows)
        self.block_steps = {k: steps_per_epoch(n, cfg.train.batch_size) for k, n in block_rows.items()}
        # samples in one pass over every block (full minibatches only)
        self.total_samples = cfg.train.epochs * sum(self.block_steps.values()) * cfg.train.batch_size
        # replicas and orders may trail by up to max_staleness versions and the jobs in flight
        self.driver = RoundDriver(cfg, backend, spec, weights, evaluate=partial(tasks.evaluate, backend, spec),
                                  keep_broadcasts=cfg.ps.max_staleness + 2 * max(2, self.num_blocks) + 2,
                                  sink=sink, progress=progress, run_dir=run_dir)
        self.core = ExchangeCore(self.driver, self.block_steps, batch_size=cfg.train.batch_size,
                                 staleness_rule=resolve_rule(cfg.ps.staleness, False))
        # the pool can run a job per block; live slots (_refresh_slots) limit the jobs in flight
        self.max_slots = cfg.engine.threads or self.num_blocks
        self.monitor = monitor or LoadMonitor(backend)
        self.load = None  # latest LoadSample
        self.slots = self.inflight_limit = self.max_slots
        self._refresh_slots()
        self.policy = AsyncPolicy(batch_size=cfg.train.batch_size,
                                  target_job_seconds=cfg.scheduler.target_job_seconds,
                                  default_steps=cfg.train.steps_per_round,
                                  max_staleness=cfg.ps.max_staleness,
                                  max_steps=max(self.block_steps.values()))
        # an injectable pool: tests run the same scenario with a synchronous executor
        self.pool_factory = pool_factory or (lambda n: ThreadPoolExecutor(n, thread_name_prefix="sparkcnn-job"))
        self.initial_states: dict = {}                  # block -> state from a checkpoint
        self.next_seq = 0
        self.block_jobs = dict.fromkeys(range(self.num_blocks), 0)  # orders made per block
        self.next_eval = 1                              # the next epoch end to evaluate and checkpoint
        self.ckpt_at, self.ckpt_cost_s, self.ckpt_t = 0, 0.0, 0.0  # mid-epoch checkpoint cadence

    @property
    def epoch_float(self) -> float:
        return self.core.epoch_float

    @property
    def samples_done(self) -> int:
        return self.core.samples_done

    # -- orders -----------------------------------------------------------------------------
    def order_for_block(self, block: int, steps: int) -> RoundOrder:
        c = self.core
        steps = max(1, min(steps, self.block_steps[block] - c.block_step[block]))
        # orders are made while samples remain, so the epoch is below train.epochs
        lr, density = self.driver.schedule(min(self.epoch_float, self.cfg.train.epochs))
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        block_seq, self.block_jobs[block] = self.block_jobs[block], self.block_jobs[block] + 1
        initial = {block: self.initial_states.pop(block)} if block in self.initial_states else {}
        return RoundOrder(seq=seq, steps={block: steps}, step_offset={block: c.cursor(block)}, lr=lr,
                          density=density, base_version=self.version, expect_state={block: c.last_seq[block]},
                          initial_state=initial, resync=block in c.resync, block_seq=block_seq,
                          **self.driver.order_weights())

    def _job(self, order: RoundOrder, block: int):
        desc = (f"sparkcnn {self.spec.run_id} epoch {self.core.block_epoch[block] + 1} block {block} "
                f"job {order.seq + 1}")
        return timed(self.backend.map_blocks, tasks.round_task(self.spec, order), [block], desc,
                     universe=self.num_blocks)

    def _refresh_slots(self) -> int:
        """Jobs allowed in flight now: the live task slots (``scheduler.task_slots`` of the
        monitor's latest sample) plus ``scheduler.queue_depth`` queued in Spark."""
        self.load = self.monitor.sample()
        ex, threads = self.load.executors, self.cfg.engine.threads
        self.slots = task_slots(ex, self.num_blocks, threads)
        self.inflight_limit = task_slots(ex, self.num_blocks, threads, self.cfg.scheduler.queue_depth)
        # replicas may trail by up to the jobs in flight: keep that many downlinks inline
        self.driver.inline_downlinks = self.inflight_limit + 2
        return self.inflight_limit

    # -- results ------------------------------------------------------------------------------
    def on_result(self, order: RoundOrder, block: int, results, t0: float, t1: float) -> dict | None:
        """Hand one job's result to the exchange core as it arrives; its record, or None
        (a duplicate, or dropped as too stale: the block's next job trains those steps again)."""
        if not results:
            return None
        r = results[0]
        self.policy.applied(block, r.base_version)
        self.monitor.record(r)
        inline = sum(len(m.payload) for m in order.downlinks)
        out = self.core.accept(r, inline_bytes=inline)
        if out is None or not out.applied:
            return None
        rec = out.record
        t2 = time.perf_counter()
        rec.update(epoch=int(self.epoch_float - 1e-9) if self.samples_done else 0,
                   compute_s=r.compute_s, task_s=r.task_s, job_s=t1 - t0, apply_s=t2 - t1, wall_s=t2 - t0,
                   round_overhead_s=(t1 - t0) - r.task_s,
                   images_per_s=r.samples / (t2 - t0) if t2 > t0 else 0.0, pid=r.pid,
                   executors=len(self.load.executors), slots=self.slots, inflight_limit=self.inflight_limit)
        return rec

    # -- the loop -----------------------------------------------------------------------------
    def run(self, start_round: int = 0, on_epoch=None) -> dict:
        """Run jobs until ``train.epochs`` passes of samples are applied (a resumed run continues
        from the restored counters; ``start_round`` is the checkpoint's position, for symmetry)."""
        t_start = time.perf_counter()
        inflight: dict = {}  # future -> (order, block)
        busy_s = slot_s = 0.0  # task seconds done; slot seconds offered (live slots x wall time)
        t_prev = t_start
        d = self.driver
        with self.pool_factory(self.max_slots) as pool:
            try:
                while True:
                    done_all = self.samples_done >= self.total_samples
                    if not done_all:
                        self._submit(pool, inflight)
                    if not inflight:
                        if done_all:
                            break
                        raise RuntimeError("async scheduler submitted nothing and nothing is in flight")
                    # wake up at the monitor's pace too, so a joining executor gets work at once
                    done, _ = wait(list(inflight), timeout=max(0.05, self.monitor.min_interval_s),
                                   return_when=FIRST_COMPLETED)
                    now = time.perf_counter()
                    slot_s += (now - t_prev) * self.slots
                    t_prev = now
                    for fut in done:
                        order, block = inflight.pop(fut)
                        rec = self.on_result(order, block, *fut.result())
                        if rec is None:
                            continue
                        busy_s += rec["task_s"]
                        rec["idle_fraction"] = max(0.0, 1 - busy_s / slot_s) if slot_s > 0 else 0.0
                        d.record(rec)
                        if d.progress:
                            d.progress.round({**rec, "round": self.samples_done * 1000 // self.total_samples - 1,
                                              "epoch": min(int(self.epoch_float), self.cfg.train.epochs - 1)},
                                             1000)
                        self._epoch_ends(t_start, on_epoch)
                        self._checkpoint_if_due()
                        d.chaos_kill(rec["round"])
            except BaseException:
                for fut in inflight:
                    fut.cancel()
                self.backend.stop()
                raise
        return d.summary(time.perf_counter() - t_start)

    def _epoch_ends(self, t_start: float, on_epoch) -> None:
        """Evaluate and checkpoint at every epoch end the applied samples have crossed."""
        while self.epoch_float >= self.next_eval - 1e-9 and self.next_eval <= self.cfg.train.epochs:
            self.driver.write_epoch(self.next_eval - 1, time.perf_counter() - t_start, on_epoch,
                                    staleness_histogram={str(k): v for k, v in sorted(self.core.staleness_hist.items())})
            self.next_eval += 1
            if self.driver.run_dir is not None:
                self.save_checkpoint()

    def _submit(self, pool, inflight: dict) -> None:
        in_flight_blocks = {b: o.base_version for o, b in inflight.values()}
        idle = [k for k in self.block_rows if k not in in_flight_blocks]
        free = self._refresh_slots() - len(inflight)
        if free <= 0 or not idle:
            return
        remaining = self.total_samples - self.samples_done - sum(
            o.steps[b] * self.cfg.train.batch_size for o, b in inflight.values())
        for dec in self.policy.decide(self.version, free, idle, in_flight_blocks,
                                      speeds=self.monitor.speeds(self.block_rows),
                                      executors=list(self.load.executors)):
            if dec.kind is not DecisionKind.SUBMIT or remaining <= 0:
                continue
            # no more than the run has left: every planned sample is trained once, none beyond
            order = self.order_for_block(dec.block, min(dec.steps, remaining // self.cfg.train.batch_size))
            remaining -= order.steps[dec.block] * self.cfg.train.batch_size
            inflight[pool.submit(self._job, order, dec.block)] = (order, dec.block)

    # -- checkpoints --------------------------------------------------------------------------
    def _checkpoint_if_due(self) -> None:
        """Every ``checkpoint.every_rounds`` applied exchanges, at most one per 50 times the last
        one's cost (so checkpoints take under 2 % of the run)."""
        every = self.cfg.checkpoint.every_rounds
        if (self.driver.run_dir is None or every <= 0 or self.core.exchanges - self.ckpt_at < every
                or time.perf_counter() - self.ckpt_t < 50 * self.ckpt_cost_s):
            return
        self.save_checkpoint()

    def save_checkpoint(self) -> str:
        """The driver's state, the block cursors, and each block's state as of its last applied job.

        Jobs in flight are not waited for: their results, applied after the checkpoint, are
        computed again after a resume (the cursors saved here do not include them). Each block's
        state is read where it lives by one small job (the executor keeps its last two).
        """
        t0 = time.perf_counter()
        blocks = tasks.block_states(self.backend, self.spec, self.core.last_seq, self.num_blocks)
        st = {"next_seq": self.next_seq, "next_eval": self.next_eval, **self.core.state_dict()}
        path = self.driver.save_checkpoint(self.core.exchanges, st, blocks)
        self.ckpt_at, self.ckpt_t = self.core.exchanges, time.perf_counter()
        self.ckpt_cost_s = self.ckpt_t - t0
        return path

    def restore(self, ckpt) -> int:
        """Continue from a loaded checkpoint; returns its position."""
        st = self.driver.restore(ckpt)
        self.next_seq, self.next_eval = int(st["next_seq"]), int(st["next_eval"])
        self.core.load_state_dict(st)
        self.initial_states = {int(k): v for k, v in ckpt.blocks.items()}
        return self.core.exchanges
