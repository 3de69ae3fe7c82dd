"""Jobs transport, sync: one Spark job (mapPartitions + treeAggregate) per round.

Round ``t`` with blocks ``k = 1..N`` and samples ``n_k``::

    S_k = worker_round(W_t, block k, H steps)      # encoded delta, on the executors
    G   = Σ_k (n_k / Σ n) · S_k                     # samples-weighted mean, by the Run
    W_{t+1} = W_t − G

The job returns each block's payload unmerged; every one goes to
:meth:`sparkcnn.server.run.Run.accept`, which deduplicates, decodes, guards and applies
the round once all are in. With ``engine.pipeline`` round t+1 computes from the weights
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
from sparkcnn.protocol import Arrival, ExchangeOrder, steps_per_epoch
from sparkcnn.scheduler import pipeline_depth, size_sync_steps
from sparkcnn.server.records import TaskStat, Timings, Where
from sparkcnn.server.run import APPLIED, Run, RunShape
from sparkcnn.transport import tasks
from sparkcnn.transport.base import Transport

log = logging.getLogger(__name__)


class Balancer:
    """Balanced sync (``scheduler.balance``): H per executor so all tasks of a round finish
    together, from each executor's measured images/s; every block continues from its own cursor."""

    def __init__(self, blocks):
        self.speed: dict[str, float] = {}         # executor -> images/s (EMA)
        self.cursor = {k: 0 for k in blocks}      # block -> steps it has trained

    def observe(self, results) -> None:
        for r in results:
            if r.compute_s > 0 and r.samples > 0:
                speed = r.samples / r.compute_s
                old = self.speed.get(r.executor)
                # EMA: one noisy round should not swing the split
                self.speed[r.executor] = speed if old is None else 0.5 * old + 0.5 * speed
            self.cursor[r.block] = self.cursor.get(r.block, 0) + r.steps

    def restore(self, cursor: dict) -> None:
        self.cursor = cursor or self.cursor

    def sized_steps(self, H: int) -> dict:
        """executor -> H (``scheduler.size_sync_steps``); empty until speeds are known."""
        return size_sync_steps(dict(self.speed), H, max_steps=4 * H) if self.speed else {}


class BlockStates:
    """Block states a round continues from or returns: restored from a checkpoint (for the
    next order), gathered by a checkpoint round, and the round each block's state is from."""

    def __init__(self, blocks):
        self.blocks = tuple(blocks)
        self.initial: dict = {}        # block -> state restored from a checkpoint
        self.returned: dict = {}       # block -> state returned by a checkpoint round
        self.from_round: dict[int, int] = {}

    def take_initial(self) -> dict:
        states, self.initial = self.initial, {}
        return states

    def ordered(self, t: int) -> None:
        """Round ``t`` is ordered: the next round on each block starts from its state."""
        self.from_round = {k: t for k in self.blocks}

    def restore(self, blocks: dict, next_round: int) -> None:
        self.initial = {int(k): v for k, v in blocks.items()}
        self.from_round = {k: next_round - 1 for k in self.blocks}

    def keep_returned(self, results) -> None:
        self.returned = {x.block: x.state for x in results if x.state is not None}

    def take_returned(self) -> dict:
        states, self.returned = self.returned, {}
        return states


class SyncEngine(Transport):
    """Epochs of synchronous rounds through a backend; the rules live in ``self.server`` (a Run)."""

    def __init__(self, cfg, backend, spec, block_rows: dict[int, int], weights, progress=None,
                 run_dir: str | None = None, warmup_started: float | None = None):
        self.cfg, self.backend, self.spec = cfg, backend, spec
        self.depth = pipeline_depth("sync", cfg.engine.pipeline)
        steps = {k: steps_per_epoch(n, cfg.train.batch_size) for k, n in block_rows.items()}
        # dense broadcasts a round in flight may still read: the rounds in flight plus a spare
        self.server = Run(cfg, spec, weights, RunShape(steps, bsp=True, keep_broadcasts=self.depth + 1),
                       backend=backend, evaluate=partial(tasks.evaluate, backend, spec), progress=progress,
                       run_dir=run_dir)
        # balanced sync (scheduler.balance, not pipelined)
        self.balancer = Balancer(block_rows)
        self.balanced = cfg.scheduler.balance and not cfg.engine.pipeline
        self.states = BlockStates(sorted(block_rows))
        self.last_applied_round: int | None = None   # W holds rounds up to this one
        self.last_recorded_round: int | None = None  # metrics hold rounds (and epochs) up to this one
        self._parallelism = backend.cluster.parallelism  # a py4j call on Spark: read once, not per round
        self.warmup_s = self.warmed_up(warmup_started)

    @property
    def rounds_per_epoch(self) -> int:
        longest = max(self.server.cursors.pass_steps.values())
        return max(1, math.ceil(longest / self.cfg.train.steps_per_round))

    @property
    def total_rounds(self) -> int:
        return self.rounds_per_epoch * self.cfg.train.epochs

    # -- orders -----------------------------------------------------------------------------
    def _is_checkpoint_round(self, t: int) -> bool:
        """Round ``t`` ends with a checkpoint: at fixed round counts (so a resumed deterministic run
        repeats an uninterrupted one; known when the round is ordered) and at every epoch's end."""
        ck = self.server.checkpoints
        return ck.enabled and (ck.due(t + 1, aligned=True) or (t + 1) % self.rounds_per_epoch == 0)

    def order_for(self, t: int) -> ExchangeOrder:
        H = self.cfg.train.steps_per_round
        epoch, r = divmod(t, self.rounds_per_epoch)
        pass_steps = self.server.cursors.pass_steps
        if self.balanced:
            # per-executor H: every block continues from its own cursor, wrapping into its next pass
            steps, offsets = {k: H for k in pass_steps}, dict(self.balancer.cursor)
            by_exec = self.balancer.sized_steps(H)
        else:
            steps = {k: max(0, min(H, s - r * H)) for k, s in pass_steps.items()}
            offsets = {k: epoch * s + r * H for k, s in pass_steps.items()}
            by_exec = {}
        lr, density = self.server.schedule.at(epoch + r / self.rounds_per_epoch)
        w = self.server.downlink.order_weights(self.version)
        return ExchangeOrder(seq=t, steps=steps, step_offset=offsets, lr=lr, density=density,
                          base_version=self.version, expect_state=dict(self.states.from_round),
                          state_wait_s=5.0 if self.depth > 1 else 0.0, steps_by_executor=by_exec,
                          return_state=self._is_checkpoint_round(t) and self.depth == 1,
                          initial_state=self.states.take_initial(), weights=w.weights,
                          weights_version=w.weights_version, downlinks=w.downlinks)

    def _job(self, order: ExchangeOrder):
        """One Spark job: every block's share of the round. Runs in a pool thread."""
        epoch = order.seq // self.rounds_per_epoch
        desc = f"sparkcnn {self.spec.run_id} epoch {epoch + 1} round {order.seq + 1}"
        blocks = self.states.blocks
        t0 = time.perf_counter()
        out = self.backend.map_blocks(tasks.round_task(self.spec, order), list(blocks), desc,
                                      universe=len(blocks), tree_depth=self.cfg.engine.tree_depth)
        return out, t0, time.perf_counter()

    def run_round(self, t: int) -> dict:
        """Round ``t`` alone (tests and benchmarks); returns its record."""
        order = self.order_for(t)
        self.states.ordered(t)
        return self._complete(order, *self._job(order), None)[0]

    # -- completion ---------------------------------------------------------------------------
    def _complete(self, order: ExchangeOrder, results, t0: float, t1: float, last_done: float | None) -> dict:
        """Hand the round's results to the run, which applies the fresh ones once all are in;
        write its record with this transport's timings."""
        t = order.seq
        epoch, r = divmod(t, self.rounds_per_epoch)
        inline = sum(len(m.payload) for m in order.downlinks)
        decision = None
        for res in results:
            d = self.server.accept(Arrival.of_result(res), inline_bytes=inline, at=(epoch, r))
            decision = d if d.kind == APPLIED else decision
        if decision is None:  # a block's result did not come: the round applies those that did
            decision = self.server.close_round(t, inline_bytes=inline, at=(epoch, r))
        applied = set(decision.blocks)  # one result per block: the one the run took
        taken: dict = {}
        for x in results:
            if x.block in applied and x.seq == t:
                taken.setdefault(x.block, x)
        fresh = list(taken.values())
        first = self.first_step_s(fresh) if self.last_applied_round is None else None
        self.last_applied_round = t
        self.balancer.observe(fresh)
        if order.return_state:
            self.states.keep_returned(fresh)
        t2 = time.perf_counter()
        # with pipelining a round's wall time runs from the previous completion to this one
        start = t0 if last_done is None else max(t0, last_done)
        wall, busy = t2 - start, sum(x.task_s for x in fresh)
        slots = max(1, min(len(fresh), self._parallelism))
        timings = Timings(
            wall_s=wall, job_s=t1 - t0, apply_s=t2 - t1,
            compute_s=max((x.compute_s for x in fresh), default=0.0),
            round_overhead_s=(t1 - t0) - max((x.task_s for x in fresh), default=0.0),
            images_per_s=decision.record.samples / wall if wall > 0 else 0.0,
            idle_fraction=max(0.0, 1.0 - busy / (wall * slots)) if wall > 0 else 0.0, first_step_s=first)
        # which GPU trained each block: Spark's addresses and what its TensorFlow saw
        where = Where(tasks=tuple(TaskStat(x.block, x.compute_s, x.prep_s, x.encode_s, x.pid, x.executor,
                                           None if x.gpus is None else ",".join(x.gpus),
                                           x.devices) for x in fresh))
        return self.server.write(decision, timings, where), t2

    # -- the loop -----------------------------------------------------------------------------
    def run(self, start_round: int = 0, on_epoch=None) -> dict:
        """Run rounds ``start_round..total``; with ``engine.pipeline`` two rounds are in flight."""
        t_start = time.perf_counter()
        inflight: deque = deque()
        next_t, last_done = start_round, None
        with ThreadPoolExecutor(max_workers=self.depth, thread_name_prefix="sparkcnn-round") as pool:
            try:
                while next_t < self.total_rounds or inflight:
                    while next_t < self.total_rounds and len(inflight) < self.depth:
                        order = self.order_for(next_t)
                        # the next round on this block starts from this round's state
                        self.states.ordered(next_t)
                        mark = self.backend.cluster.job_mark() if self.depth > 1 else None
                        inflight.append((order, pool.submit(self._job, order)))
                        if mark is not None and not self.backend.cluster.wait_job_after(mark):
                            log.warning("round %s: job not registered within 30 s", next_t)
                        next_t += 1
                    order, fut = inflight.popleft()
                    rec, last_done = self._complete(order, *fut.result(), last_done)
                    self._after(rec, t_start, on_epoch)
            except BaseException as e:
                for _, fut in inflight:
                    fut.cancel()
                self.backend.stop()
                if isinstance(e, KeyboardInterrupt):
                    self._checkpoint_on_interrupt()
                raise
        return self.server.summary(time.perf_counter() - t_start)

    def _after(self, rec: dict, t_start: float, on_epoch) -> None:
        t = rec["round"]
        epoch_end = (t + 1) % self.rounds_per_epoch == 0
        if not epoch_end:  # else only once its epoch record is written (a resume keeps that epoch's)
            self.last_recorded_round = t
        self.server.show(rec, (t, self.total_rounds))
        if epoch_end:
            self.server.write_epoch(t // self.rounds_per_epoch, time.perf_counter() - t_start, on_epoch)
            self.last_recorded_round = t
        if self._is_checkpoint_round(t):
            self.save_checkpoint(t + 1)
        self.server.chaos_after(t)

    # -- checkpoints --------------------------------------------------------------------------
    def save_checkpoint(self, next_round: int) -> str:
        """The run's state plus the round cursor and the block states gathered by this round."""
        return self.server.checkpoint(next_round, {"next_round": next_round,
                                                "block_cursor": json_keys(self.balancer.cursor)},
                                   self.states.take_returned())

    def restore(self, ckpt) -> int:
        """Continue from a loaded checkpoint; returns the round to start from."""
        st = self.server.restore(ckpt)
        self.balancer.restore(int_keys(st["block_cursor"]))
        nxt = int(st["next_round"])
        self.states.restore(ckpt.blocks, nxt)
        return nxt

    def _checkpoint_on_interrupt(self) -> None:
        """Ctrl-C: keep the rounds done so far (``--resume`` continues after the last one).

        Only when the weights hold exactly the recorded rounds; block states not
        collected since the last regular checkpoint restart from zero on resume
        (counted as ``state_resets``).
        """
        t = self.last_recorded_round
        if not self.server.checkpoints.enabled or t is None or t != self.last_applied_round:
            return
        if self.server.checkpoints.written_at == t + 1:
            return  # written right after that round
        try:
            path = self.save_checkpoint(t + 1)
            log.warning("interrupted after round %s: checkpoint %s written (continue with --resume)", t, path)
        except Exception:
            log.warning("interrupted after round %s: checkpoint failed", t, exc_info=True)
