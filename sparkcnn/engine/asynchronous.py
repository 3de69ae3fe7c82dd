"""Asynchronous parameter server (ASGD / GS-ASGD): one Spark job per block, applied on arrival.

A driver thread pool (threads reused) keeps every executor slot busy with
single-block jobs; the pure :class:`~sparkcnn.scheduler.AsyncPolicy` picks the
next block (stalest first, then locality), sizes its job to about
``scheduler.target_job_seconds`` and holds blocks back past
``ps.max_staleness``. The :class:`~sparkcnn.engine.monitor.LoadMonitor` tells
it the live task slots (fewer when an executor is lost, more when one joins;
``engine.threads`` fixes them), each executor's load and each block's speed.
Each result is applied as it arrives::

    tau = version_now - base_version
    W  -= lambda(tau) * S_k / N          # lambda = 1/tau (inverse) or 1 (none)

Blocks keep their own cursor through their data (a fast block simply starts
its next pass sooner); the global epoch is the number of samples processed
over the training set size, which drives the learning rate, the density
warm-up, evaluation and the end of training.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import numpy as np

from sparkcnn.engine.monitor import LoadMonitor
from sparkcnn.engine.sync import SyncEngine
from sparkcnn.errors import CodecError
from sparkcnn.scheduler import AsyncPolicy, DecisionKind, task_slots
from sparkcnn.staleness import staleness_scale
from sparkcnn.worker import RoundOrder, run_block_round

log = logging.getLogger(__name__)


class AsyncEngine(SyncEngine):
    """Asynchronous rounds over the same parameter server, worker and records as sync mode."""

    def __init__(self, *args, pool_factory=None, monitor=None, **kwargs):
        super().__init__(*args, **kwargs)
        cfg = self.cfg
        self.num_blocks = len(self.block_rows)
        # samples in one pass over every block (full minibatches only)
        self.n_train = sum(self.block_steps.values()) * cfg.train.batch_size
        self.total_samples = cfg.train.epochs * self.n_train
        # the pool can run a job per block; live slots (_refresh_slots) limit the jobs in flight
        self.max_slots = cfg.engine.threads or self.num_blocks
        self.monitor = monitor or LoadMonitor(self.backend)
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
        self.block_epoch = {k: 0 for k in self.block_rows}
        self.block_step = {k: 0 for k in self.block_rows}
        self.last_job = {k: -1 for k in self.block_rows}
        self.samples_done = 0
        self.jobs = 0
        self.total_rounds = 0  # unknown in advance; progress shows samples instead
        self.staleness_hist: dict[int, int] = {}

    @property
    def epoch_float(self) -> float:
        return self.samples_done / self.n_train

    def order_for_block(self, block: int, steps: int) -> RoundOrder:
        steps = max(1, min(steps, self.block_steps[block] - self.block_step[block]))
        # orders are made while samples remain, so the epoch is below train.epochs
        lr, density = self._schedule(min(self.epoch_float, self.cfg.train.epochs))
        job = self.jobs
        self.jobs += 1
        order = RoundOrder(round=job, epoch=self.block_epoch[block], round_in_epoch=self.block_step[block],
                           steps={block: steps}, step_offset={block: self.block_step[block]}, lr=lr,
                           base_version=self.version, expect_state={block: self.last_job[block]},
                           density=density, **self._downlink_fields())
        return order

    def _job_one(self, order: RoundOrder, block: int):
        spec = self.spec

        def fn(b, attempt):
            return run_block_round(spec, order, b, attempt)

        t0 = time.perf_counter()
        desc = f"sparkcnn {spec.run_id} epoch {order.epoch + 1} block {block} job {order.round + 1}"
        res = self.backend.map_blocks(fn, [block], desc, universe=self.num_blocks)
        return res, t0, time.perf_counter()

    def _refresh_slots(self) -> int:
        """Jobs allowed in flight now: the live task slots (``scheduler.task_slots`` of the
        monitor's latest sample) plus ``scheduler.queue_depth`` queued in Spark."""
        self.load = self.monitor.sample()
        ex, threads = self.load.executors, self.cfg.engine.threads
        self.slots = task_slots(ex, self.num_blocks, threads)
        self.inflight_limit = task_slots(ex, self.num_blocks, threads, self.cfg.scheduler.queue_depth)
        # replicas may trail by up to the jobs in flight: keep that many downlinks inline
        self.inline_downlinks = self.inflight_limit + 2
        return self.inflight_limit

    def _apply_async(self, order: RoundOrder, block: int, results, t0: float, t1: float) -> dict | None:
        fresh = []
        for r in results:
            key = (r["round"], r["block"])
            if key in self.applied:
                self.counters["duplicates_dropped"] += 1
                continue
            self.applied.add(key)
            fresh.append(r)
        if not fresh:
            return None
        r = fresh[0]
        tau = self.version - r["base_version"]
        self.staleness_hist[tau] = self.staleness_hist.get(tau, 0) + 1
        scale = staleness_scale(tau, self.cfg.ps.staleness) * r["lr_scale"] / self.num_blocks
        rejected = 0
        if r["samples"] > 0:
            from sparkcnn.compression import codec

            try:
                d = codec.decode(r["payload"], self.spec.layout)
                why = self.guard.check_delta(d.values, r["steps"])
                if why:
                    raise CodecError(why)
                if not self.ps.apply(d, scale=scale):
                    raise CodecError("delta is not finite")
            except CodecError as e:
                log.error("job %s block %s: delta rejected: %s", r["round"], block, e)
                rejected = 1
                self.counters["rejected_deltas"] += 1
        nnz_down = self._send_downlink(self.epoch_float) if self.sparse_down else self.W.size
        down_inline = self._downlink_bytes(order)
        self.policy.applied(block, r["base_version"])
        self.monitor.record(r)
        self.last_job[block] = r["round"]
        self.counters["state_resets"] += int(r["state_reset"])
        self.counters["replica_resyncs"] += int(r["replica_resync"])
        self.samples_done += r["samples"]
        self.block_step[block] += r["steps"]
        if self.block_step[block] >= self.block_steps[block]:
            self.block_epoch[block] += 1
            self.block_step[block] = 0
        loss = r["loss_sum"] / max(1, r["samples"])
        self._check_loss(r["round"], loss)
        t2 = time.perf_counter()
        n = self.W.size
        return {
            "kind": "round", "round": r["round"], "epoch": int(self.epoch_float - 1e-9) if self.samples_done else 0,
            "block": block, "staleness": tau, "scale": scale, "lr": order.lr, "version": self.version,
            "loss": loss, "accuracy": r["correct"] / max(1, r["samples"]), "samples": r["samples"],
            "steps": r["steps"], "blocks": 1, "bytes_up": len(r["payload"]), "density": order.density,
            "nnz_up": r["nnz"], "achieved_density": r["nnz"] / n,
            "bytes_per_nonzero": len(r["payload"]) / max(1, r["nnz"]),
            "bytes_down": down_inline + r["view_bytes"], "nnz_down": nnz_down,
            "dense_bytes": 4 * n, "uplink_ratio": 4 * n / max(1, len(r["payload"])),
            "downlink_ratio": 4 * n / max(1, down_inline + r["view_bytes"]),
            "rejected": rejected, "state_resets": int(r["state_reset"]),
            "replica_resyncs": int(r["replica_resync"]),
            "compute_s": r["compute_s"], "task_s": r["task_s"], "job_s": t1 - t0, "apply_s": t2 - t1,
            "wall_s": t2 - t0, "round_overhead_s": (t1 - t0) - r["task_s"],
            "images_per_s": r["samples"] / (t2 - t0) if t2 > t0 else 0.0, "pid": r["pid"],
            "executors": len(self.load.executors), "slots": self.slots, "inflight_limit": self.inflight_limit,
        }

    def run(self, start_round: int = 0, on_epoch=None) -> dict:
        t_start = time.perf_counter()
        next_eval = 1
        inflight: dict = {}  # future -> (order, block)
        busy_s = slot_s = 0.0  # task seconds done; slot seconds offered (live slots x wall time)
        t_prev = t_start
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
                        rec = self._apply_async(order, block, *fut.result())
                        if rec is None:
                            continue
                        busy_s += rec["task_s"]
                        rec["idle_fraction"] = max(0.0, 1 - busy_s / slot_s) if slot_s > 0 else 0.0
                        self.history.append(rec)
                        if self.sink:
                            self.sink.write(rec)
                        if self.progress:
                            self.progress.round({**rec, "round": self.samples_done * 1000 // self.total_samples
                                                 - 1, "epoch": min(int(self.epoch_float), self.cfg.train.epochs - 1)},
                                                1000)
                    while self.epoch_float >= next_eval - 1e-9 and next_eval <= self.cfg.train.epochs:
                        self._epoch_end(next_eval - 1, t_start, on_epoch)
                        next_eval += 1
            except BaseException:
                for fut in inflight:
                    fut.cancel()
                self.backend.stop()
                raise
        return self.summary(time.perf_counter() - t_start)

    def _submit(self, pool, inflight: dict) -> None:
        in_flight_blocks = {b: o.base_version for o, b in inflight.values()}
        idle = [k for k in self.block_rows if k not in in_flight_blocks]
        free = self._refresh_slots() - len(inflight)
        if free <= 0 or not idle:
            return
        remaining = self.total_samples - self.samples_done - sum(
            o.steps[b] * self.cfg.train.batch_size for o, b in inflight.values())
        for d in self.policy.decide(self.version, free, idle, in_flight_blocks,
                                    speeds=self.monitor.speeds(self.block_rows),
                                    executors=list(self.load.executors)):
            if d.kind is not DecisionKind.SUBMIT or remaining <= 0:
                continue
            order = self.order_for_block(d.block, d.steps)
            remaining -= order.steps[d.block] * self.cfg.train.batch_size
            inflight[pool.submit(self._job_one, order, d.block)] = (order, d.block)

    def _epoch_end(self, epoch: int, t_start: float, on_epoch) -> None:
        self._write_epoch(epoch, t_start, on_epoch,
                          staleness_histogram={str(k): v for k, v in sorted(self.staleness_hist.items())})
