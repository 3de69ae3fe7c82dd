"""Jobs transport, async (ASGD / GS-ASGD): one Spark job per block, applied on arrival.

A driver thread pool (threads reused) keeps every executor slot busy with
single-block jobs; the pure :class:`~sparkcnn.scheduler.AsyncPolicy` picks the
next block (stalest first, then locality), sizes its job to about
``scheduler.target_job_seconds`` and holds blocks back past
``ps.max_staleness``. The :class:`~sparkcnn.backends.monitor.LoadMonitor` tells
it the live task slots (fewer when an executor is lost, more when one joins;
``engine.threads`` fixes them), each executor's load and each block's speed.
Each result goes to :meth:`sparkcnn.server.run.Run.accept` as it arrives; the
decision says whether it was applied, a duplicate, or too stale (the block's next
job then trains the same steps again from a reloaded view), which epoch ends the
applied samples crossed (evaluate and checkpoint) and whether a mid-epoch
checkpoint is due (``checkpoint.every_rounds``, server/checkpoints.py).

Blocks keep their own cursor through their data (a fast block simply starts its
next pass sooner); the global epoch is the number of samples applied over the
training set size, which drives the learning rate, the density warm-up,
evaluation, checkpoints and the end of training.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from functools import partial

from sparkcnn.backends.monitor import LoadMonitor
from sparkcnn.protocol import Arrival, ExchangeOrder, steps_per_epoch
from sparkcnn.scheduler import AsyncPolicy, DecisionKind, task_slots
from sparkcnn.server.exchange import downlink_cadence
from sparkcnn.server.records import Timings, Where
from sparkcnn.server.run import APPLIED, Run, RunShape
from sparkcnn.transport import tasks
from sparkcnn.transport.base import Transport

log = logging.getLogger(__name__)


class Slots:
    """Jobs allowed in flight: the live task slots of the monitor's latest sample
    (``scheduler.task_slots``) plus ``scheduler.queue_depth`` queued in Spark."""

    def __init__(self, cfg, monitor, num_blocks: int):
        self.cfg, self.monitor, self.num_blocks = cfg, monitor, num_blocks
        self.most = cfg.engine.threads or num_blocks  # the pool can run a job per block
        self.load = None                              # the latest LoadSample
        self.live = self.inflight_limit = self.most

    def watch(self, monitor) -> None:
        self.monitor = monitor

    def refresh(self) -> int:
        self.load = self.monitor.sample()
        ex, threads = self.load.executors, self.cfg.engine.threads
        self.live = task_slots(ex, self.num_blocks, threads)
        self.inflight_limit = task_slots(ex, self.num_blocks, threads, self.cfg.scheduler.queue_depth)
        return self.inflight_limit


class Orders:
    """Numbers of the orders made: the run's (seq) and each block's; states restored for them."""

    def __init__(self, num_blocks: int):
        self.next_seq = 0
        self.block_jobs = dict.fromkeys(range(num_blocks), 0)  # orders made per block
        self.initial_states: dict = {}                          # block -> state from a checkpoint

    def take(self, block: int) -> tuple[int, int, dict]:
        """(seq, the block's own job number, its restored state if any) of a new order."""
        seq, block_seq = self.next_seq, self.block_jobs[block]
        self.next_seq, self.block_jobs[block] = seq + 1, block_seq + 1
        initial = {block: self.initial_states.pop(block)} if block in self.initial_states else {}
        return seq, block_seq, initial

    def restore(self, next_seq: int, blocks: dict) -> None:
        self.next_seq = next_seq
        self.initial_states = {int(k): v for k, v in blocks.items()}


class AsyncEngine(Transport):
    """Asynchronous jobs over the same run, worker and records as sync mode."""

    def __init__(self, cfg, backend, spec, block_rows: dict[int, int], weights, progress=None,
                 run_dir: str | None = None, pool_factory=None, monitor=None,
                 warmup_started: float | None = None):
        self.cfg, self.backend, self.spec = cfg, backend, spec
        n = len(block_rows)
        steps = {k: steps_per_epoch(r, cfg.train.batch_size) for k, r in block_rows.items()}
        # replicas and orders may trail by up to max_staleness versions and the jobs in flight
        keep = cfg.ps.max_staleness + 2 * max(2, n) + 2
        every = downlink_cadence(cfg.ps.downlink_every, n)
        self.server = Run(cfg, spec, weights, RunShape(steps, bsp=False, downlink_every=every,
                                                       keep_broadcasts=keep),
                          backend=backend, evaluate=partial(tasks.evaluate, backend, spec), progress=progress,
                          run_dir=run_dir)
        self.slots = Slots(cfg, monitor or LoadMonitor(backend.cluster), n)
        self._refresh_slots()
        self.policy = AsyncPolicy(batch_size=cfg.train.batch_size,
                                  target_job_seconds=cfg.scheduler.target_job_seconds,
                                  default_steps=cfg.train.steps_per_round, max_staleness=cfg.ps.max_staleness,
                                  max_steps=max(steps.values()))
        # an injectable pool: tests run the same scenario with a synchronous executor
        self.pool_factory = pool_factory or (
            lambda k: ThreadPoolExecutor(k, thread_name_prefix="sparkcnn-job"))
        self.orders = Orders(n)
        self.warmup_s = self.warmed_up(warmup_started)

    @property
    def monitor(self) -> LoadMonitor:
        return self.slots.monitor

    def inject(self, *, pool_factory=None, monitor=None) -> None:
        """Tests run the same scenario with a pool (a synchronous one) or a monitor of their own."""
        if pool_factory is not None:
            self.pool_factory = pool_factory
        if monitor is not None:
            self.slots.watch(monitor)

    @property
    def num_blocks(self) -> int:
        return self.slots.num_blocks

    @property
    def total_samples(self) -> int:
        """Samples in ``train.epochs`` passes over every block (full minibatches only)."""
        return self.cfg.train.epochs * self.server.cursors.epoch_samples

    @property
    def samples_done(self) -> int:
        return self.server.cursors.samples_done

    @property
    def epoch_float(self) -> float:
        return self.server.epoch_float

    # -- orders -----------------------------------------------------------------------------
    def order_for_block(self, block: int, steps: int) -> ExchangeOrder:
        c, run = self.server.cursors, self.server
        steps = max(1, min(steps, c.pass_steps[block] - c.block_step[block]))
        # orders are made while samples remain, so the epoch is below train.epochs
        lr, density = run.schedule_now()
        seq, block_seq, initial = self.orders.take(block)
        w = run.downlink.order_weights(self.version)
        return ExchangeOrder(seq=seq, steps={block: steps}, step_offset={block: c.cursor(block)}, lr=lr,
                          density=density, base_version=self.version, expect_state={block: c.last_seq[block]},
                          initial_state=initial, resync=block in run.exchange.resync, block_seq=block_seq,
                          weights=w.weights, weights_version=w.weights_version, downlinks=w.downlinks)

    def _job(self, order: ExchangeOrder, block: int):
        epoch = self.server.cursors.block_epoch[block] + 1
        desc = (f"sparkcnn {self.spec.run_id} epoch {epoch} block {block} "
                f"job {order.seq + 1}")
        t0 = time.perf_counter()
        out = self.backend.map_blocks(tasks.round_task(self.spec, order), [block], desc,
                                      universe=self.num_blocks)
        return out, t0, time.perf_counter()

    def _refresh_slots(self) -> int:
        limit = self.slots.refresh()
        # replicas may trail by up to the jobs in flight: keep that many downlinks inline
        self.server.keep_inline_downlinks(limit + 2)
        return limit

    # -- results ------------------------------------------------------------------------------
    def on_result(self, order: ExchangeOrder, block: int, results, t0: float, t1: float) -> dict | None:
        """Hand one job's result to the run as it arrives; its record, or None (a duplicate, or
        dropped as too stale: the block's next job trains those steps again)."""
        out = self._take(order, block, results, t0, t1)
        return None if out is None else out[1]

    def _take(self, order: ExchangeOrder, block: int, results, t0: float, t1: float, busy=None):
        """:meth:`on_result`'s (decision, record) when applied, else None. ``busy``: (task seconds
        so far, slot seconds offered), for the record's idleness."""
        if not results:
            return None
        r = results[0]
        self.policy.applied(block, r.base_version)
        self.monitor.record(r)
        decision = self.server.accept(Arrival.of_result(r),
                                      inline_bytes=sum(len(m.payload) for m in order.downlinks))
        if decision.kind != APPLIED:
            return None
        t2 = time.perf_counter()
        busy_s, slot_s = busy if busy is not None else (0.0, 0.0)
        s = self.slots
        timings = Timings(compute_s=r.compute_s, task_s=r.task_s, job_s=t1 - t0, apply_s=t2 - t1,
                          wall_s=t2 - t0,
                          round_overhead_s=(t1 - t0) - r.task_s,
                          images_per_s=r.samples / (t2 - t0) if t2 > t0 else 0.0,
                          idle_fraction=max(0.0, 1 - (busy_s + r.task_s) / slot_s) if slot_s > 0 else 0.0)
        where = Where(pid=r.pid, executors=len(s.load.executors), slots=s.live,
                      inflight_limit=s.inflight_limit)
        progress = (self.samples_done * 1000 // self.total_samples - 1, 1000,
                    min(int(self.epoch_float), self.cfg.train.epochs - 1))
        return decision, self.server.write(decision, timings, where, progress_at=progress)

    # -- the loop -----------------------------------------------------------------------------
    def run(self, start_round: int = 0, on_epoch=None) -> dict:
        """Run jobs until ``train.epochs`` passes of samples are applied (a resumed run continues
        from the restored cursors; ``start_round`` is the checkpoint's position, for symmetry)."""
        t_start = time.perf_counter()
        inflight: dict = {}  # future -> (order, block)
        busy_s = slot_s = 0.0  # task seconds done; slot seconds offered (live slots x wall time)
        t_prev = t_start
        with self.pool_factory(self.slots.most) as pool:
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
                    slot_s += (now - t_prev) * self.slots.live
                    t_prev = now
                    for fut in done:
                        order, block = inflight.pop(fut)
                        out = self._take(order, block, *fut.result(), busy=(busy_s, slot_s))
                        if out is None:
                            continue
                        decision, line = out
                        busy_s += line["task_s"]
                        self._act(decision, t_start, on_epoch)
                        self.server.chaos_after(line["round"])
            except BaseException:
                for fut in inflight:
                    fut.cancel()
                self.backend.stop()
                raise
        return self.server.summary(time.perf_counter() - t_start)

    def _act(self, decision, t_start: float, on_epoch) -> None:
        """Evaluate and checkpoint at every epoch end the applied samples crossed; else checkpoint
        when the cadence says so."""
        for e in decision.epoch_ends:
            self.server.write_epoch(e, time.perf_counter() - t_start, on_epoch, staleness=True)
            if self.server.checkpoints.enabled:
                self.save_checkpoint()
        if decision.checkpoint and not decision.epoch_ends:
            self.save_checkpoint()

    def _submit(self, pool, inflight: dict) -> None:
        in_flight_blocks = {b: o.base_version for o, b in inflight.values()}
        idle = [k for k in range(self.num_blocks) if k not in in_flight_blocks]
        free = self._refresh_slots() - len(inflight)
        if free <= 0 or not idle:
            return
        batch = self.cfg.train.batch_size
        queued = sum(o.steps[b] * batch for o, b in inflight.values())
        remaining = self.total_samples - self.samples_done - queued
        for dec in self.policy.decide(self.version, free, idle, in_flight_blocks,
                                      speeds=self.monitor.speeds(range(self.num_blocks)),
                                      executors=list(self.slots.load.executors)):
            if dec.kind is not DecisionKind.SUBMIT or remaining <= 0:
                continue
            # no more than the run has left: every planned sample is trained once, none beyond
            order = self.order_for_block(dec.block, min(dec.steps, remaining // batch))
            remaining -= order.steps[dec.block] * batch
            inflight[pool.submit(self._job, order, dec.block)] = (order, dec.block)

    # -- checkpoints --------------------------------------------------------------------------
    def save_checkpoint(self) -> str:
        """The run's state, the block cursors, and each block's state as of its last applied job.

        Jobs in flight are not waited for: their results, applied after the checkpoint, are
        computed again after a resume (the cursors saved here do not include them). Each block's
        state is read where it lives by one small job (the executor keeps its last two).
        """
        t0 = time.perf_counter()
        blocks = tasks.block_states(self.backend, self.spec, self.server.cursors.last_seq, self.num_blocks)
        st = {"next_seq": self.orders.next_seq}
        return self.server.checkpoint(self.server.exchange.exchanges, st, blocks, t0=t0)

    def restore(self, ckpt) -> int:
        """Continue from a loaded checkpoint; returns its position."""
        st = self.server.restore(ckpt)
        self.orders.restore(int(st["next_seq"]), ckpt.blocks)
        return self.server.exchange.exchanges
