"""Synchronous data-parallel rounds: one Spark job (mapPartitions + treeAggregate) per round.

Round ``t`` with blocks ``k = 1..N`` and samples ``n_k``::

    S_k = worker_round(W_t, block k, H steps)      # encoded delta, on the executors
    G   = Σ_k (n_k / Σ n) · S_k                     # samples-weighted mean, driver side
    W_{t+1} = W_t − G

The job returns each block's payload unmerged; the driver's
:class:`~sparkcnn.server.driver.RoundDriver` deduplicates, decodes, guards and
applies them. With ``engine.pipeline`` round t+1 computes from the weights
before round t is applied (bounded staleness 1) while the driver applies round t.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from sparkcnn.checkpoint import int_keys, json_keys
from sparkcnn.transport import tasks
from sparkcnn.server.driver import DriverShorthands, RoundDriver, timed
from sparkcnn.server.exchange import ExchangeCore
from sparkcnn.protocol import RoundOrder, steps_per_epoch
from sparkcnn.scheduler import pipeline_depth, size_sync_steps

log = logging.getLogger(__name__)


class SyncEngine(DriverShorthands):
    """Epochs of synchronous rounds through a backend; the server half lives in ``self.driver``."""

    def __init__(self, cfg, backend, spec, block_rows: dict[int, int], weights,
                 sink=None, progress=None, run_dir: str | None = None):
        self.cfg, self.backend, self.spec, self.block_rows = cfg, backend, spec, block_rows
        self.depth = pipeline_depth("sync", cfg.engine.pipeline)
        # dense broadcasts a round in flight may still read: the rounds in flight plus a spare
        self.driver = RoundDriver(cfg, backend, spec, weights, evaluate=partial(tasks.evaluate, backend, spec),
                                  keep_broadcasts=self.depth + 1, sink=sink, progress=progress, run_dir=run_dir)
        H = cfg.train.steps_per_round
        self.block_steps = {k: steps_per_epoch(n, cfg.train.batch_size) for k, n in block_rows.items()}
        self.core = ExchangeCore(self.driver, self.block_steps, batch_size=cfg.train.batch_size,
                                 staleness_rule="none")
        self.rounds_per_epoch = max(1, math.ceil(max(self.block_steps.values()) / H))
        self.total_rounds = self.rounds_per_epoch * cfg.train.epochs
        # balanced sync (scheduler.balance, not pipelined): executor -> measured images/s
        self.balanced = cfg.scheduler.balance and not cfg.engine.pipeline
        self.executor_speed: dict[str, float] = {}
        self.block_cursor = {k: 0 for k in block_rows}
        self.initial_states: dict = {}      # block -> state restored from a checkpoint, for the next order
        self.block_states: dict = {}        # block -> state returned by a checkpoint round
        self.last_state_round: dict[int, int] = {}
        self.last_applied_round: int | None = None   # W holds rounds up to this one
        self.last_recorded_round: int | None = None  # metrics hold rounds (and epochs) up to this one
        self._last_done: float | None = None
        self._parallelism = backend.parallelism  # a py4j call on Spark: read once, not per round

    # -- orders -----------------------------------------------------------------------------
    def _is_checkpoint_round(self, t: int) -> bool:
        every = self.cfg.checkpoint.every_rounds
        return self.driver.run_dir is not None and ((every and (t + 1) % every == 0)
                                                    or (t + 1) % self.rounds_per_epoch == 0)

    def order_for(self, t: int) -> RoundOrder:
        H = self.cfg.train.steps_per_round
        epoch, r = divmod(t, self.rounds_per_epoch)
        if self.balanced:
            # per-executor H: every block continues from its own cursor, wrapping into its next pass
            steps = {k: H for k in self.block_steps}
            offsets = dict(self.block_cursor)
            by_exec = self._sized_steps(H)
        else:
            steps = {k: max(0, min(H, s - r * H)) for k, s in self.block_steps.items()}
            offsets = {k: epoch * s + r * H for k, s in self.block_steps.items()}
            by_exec = {}
        lr, density = self.driver.schedule(epoch + r / self.rounds_per_epoch)
        states, self.initial_states = self.initial_states, {}
        return RoundOrder(seq=t, steps=steps, step_offset=offsets, lr=lr, density=density,
                          base_version=self.version, expect_state=dict(self.last_state_round),
                          state_wait_s=5.0 if self.depth > 1 else 0.0, steps_by_executor=by_exec,
                          return_state=self._is_checkpoint_round(t) and self.depth == 1,
                          initial_state=states, **self.driver.order_weights())

    def _sized_steps(self, H: int) -> dict:
        """H per executor so all tasks of a round finish together (``scheduler.size_sync_steps``)."""
        if not self.executor_speed:
            return {}
        return size_sync_steps(dict(self.executor_speed), H, max_steps=4 * H)

    def _job(self, order: RoundOrder):
        """One Spark job: every block's share of the round. Runs in a pool thread."""
        epoch, r = divmod(order.seq, self.rounds_per_epoch)
        desc = f"sparkcnn {self.spec.run_id} epoch {epoch + 1} round {order.seq + 1}"
        return timed(self.backend.gather_blocks, tasks.round_task(self.spec, order), sorted(self.block_rows), desc,
                     depth=self.cfg.engine.tree_depth, universe=len(self.block_rows))

    def run_round(self, t: int) -> dict:
        """Round ``t`` alone (tests and benchmarks); returns its record."""
        order = self.order_for(t)
        self.last_state_round = {k: t for k in self.block_rows}
        return self._complete(order, *self._job(order))

    # -- completion ---------------------------------------------------------------------------
    def _observe_speeds(self, fresh) -> None:
        for r in fresh:
            if r.compute_s > 0 and r.samples > 0:
                speed = r.samples / r.compute_s
                old = self.executor_speed.get(r.executor)
                # EMA: one noisy round should not swing the split
                self.executor_speed[r.executor] = speed if old is None else 0.5 * old + 0.5 * speed
            self.block_cursor[r.block] = self.block_cursor.get(r.block, 0) + r.steps

    def _complete(self, order: RoundOrder, results, t0: float, t1: float) -> dict:
        """Hand the round's results to the exchange core (it applies the fresh ones and sends the
        downlink); the record with this transport's timings."""
        t = order.seq
        epoch, r = divmod(t, self.rounds_per_epoch)
        out = self.core.accept_round(results, t, inline_bytes=sum(len(m.payload) for m in order.downlinks))
        fresh = list(out.results)
        rec = {**out.record, "round": t, "epoch": epoch, "round_in_epoch": r}
        self.last_applied_round = t
        self._observe_speeds(fresh)
        if order.return_state:
            self.block_states = {x.block: x.state for x in fresh if x.state is not None}
        t2 = time.perf_counter()
        # with pipelining a round's wall time runs from the previous completion to this one
        start = t0 if self._last_done is None else max(t0, self._last_done)
        self._last_done = t2
        wall = t2 - start
        busy = sum(x.task_s for x in fresh)
        slots = max(1, min(len(fresh), self._parallelism))
        rec.update(wall_s=wall, job_s=t1 - t0, apply_s=t2 - t1,
                   compute_s=max((x.compute_s for x in fresh), default=0.0),
                   round_overhead_s=(t1 - t0) - max((x.task_s for x in fresh), default=0.0),
                   images_per_s=rec["samples"] / wall if wall > 0 else 0.0,
                   idle_fraction=max(0.0, 1.0 - busy / (wall * slots)) if wall > 0 else 0.0,
                   task_compute_s={str(x.block): round(x.compute_s, 4) for x in fresh},
                   task_prep_s={str(x.block): round(x.prep_s, 4) for x in fresh},
                   task_encode_s={str(x.block): round(x.encode_s, 4) for x in fresh},
                   task_pids={str(x.block): x.pid for x in fresh},
                   task_executors={str(x.block): x.executor for x in fresh},
                   # which GPU trained each block: Spark's addresses and what its TensorFlow saw
                   task_gpus={str(x.block): None if x.gpus is None else ",".join(x.gpus) for x in fresh},
                   task_devices={str(x.block): x.devices for x in fresh})
        return rec

    # -- the loop -----------------------------------------------------------------------------
    def run(self, start_round: int = 0, on_epoch=None) -> dict:
        """Run rounds ``start_round..total``; with ``engine.pipeline`` two rounds are in flight."""
        t_start = time.perf_counter()
        inflight: deque = deque()
        next_t = start_round
        with ThreadPoolExecutor(max_workers=self.depth, thread_name_prefix="sparkcnn-round") as pool:
            try:
                while next_t < self.total_rounds or inflight:
                    while next_t < self.total_rounds and len(inflight) < self.depth:
                        order = self.order_for(next_t)
                        # the next round on this block starts from this round's state
                        self.last_state_round = {k: next_t for k in self.block_rows}
                        mark = self.backend.job_mark() if self.depth > 1 else None
                        inflight.append((order, pool.submit(self._job, order)))
                        if mark is not None and not self.backend.wait_job_after(mark):
                            log.warning("round %s: job not registered within 30 s", next_t)
                        next_t += 1
                    order, fut = inflight.popleft()
                    self._record(self._complete(order, *fut.result()), t_start, on_epoch)
            except BaseException as e:
                for _, fut in inflight:
                    fut.cancel()
                self.backend.stop()
                if isinstance(e, KeyboardInterrupt):
                    self._checkpoint_on_interrupt()
                raise
        return self.driver.summary(time.perf_counter() - t_start)

    def _record(self, rec: dict, t_start: float, on_epoch) -> None:
        d, t = self.driver, rec["round"]
        d.record(rec)
        epoch_end = (t + 1) % self.rounds_per_epoch == 0
        if not epoch_end:  # else only once its epoch record is written (a resume keeps that epoch's)
            self.last_recorded_round = t
        if d.progress:
            d.progress.round(rec, self.total_rounds)
        if epoch_end:
            d.write_epoch(t // self.rounds_per_epoch, time.perf_counter() - t_start, on_epoch)
            self.last_recorded_round = t
        if self._is_checkpoint_round(t):
            self.save_checkpoint(t + 1)
            self.block_states = {}
        d.chaos_kill(t)

    # -- checkpoints --------------------------------------------------------------------------
    def save_checkpoint(self, next_round: int) -> str:
        """The driver's state plus the round cursor and the block states gathered by this round."""
        return self.driver.save_checkpoint(
            next_round, {"next_round": next_round, "block_cursor": json_keys(self.block_cursor),
                         **self.core.state_dict()},
            dict(self.block_states))

    def restore(self, ckpt) -> int:
        """Continue from a loaded checkpoint; returns the round to start from."""
        st = self.driver.restore(ckpt)
        self.core.load_state_dict(st)
        self.block_cursor = int_keys(st["block_cursor"]) or self.block_cursor
        self.initial_states = {int(k): v for k, v in ckpt.blocks.items()}
        nxt = int(st["next_round"])
        self.last_state_round = {k: nxt - 1 for k in self.block_rows}
        self.driver.applied = {(t, k) for t in range(nxt) for k in self.block_rows}
        return nxt

    def _checkpoint_on_interrupt(self) -> None:
        """Ctrl-C: keep the rounds done so far (``--resume`` continues after the last one).

        Only when the weights hold exactly the recorded rounds; block states not
        collected since the last regular checkpoint restart from zero on resume
        (counted as ``state_resets``).
        """
        t = self.last_recorded_round
        if self.driver.run_dir is None or t is None or t != self.last_applied_round:
            return
        if self.driver.checkpointed_at == t + 1:
            return  # written right after that round
        try:
            path = self.save_checkpoint(t + 1)
            log.warning("interrupted after round %s: checkpoint %s written (continue with --resume)", t, path)
        except Exception:
            log.warning("interrupted after round %s: checkpoint failed", t, exc_info=True)
