"""Executor side of the streaming transport: one long-lived task trains its block and talks to
the driver's parameter server every H steps (H may be 1).

    start  <- Reply: StreamPlan (seq0, first step, steps, H) + lr, density + weights (W, or the view U)
    loop:  keep the block state;  V = replica (extrapolated, Lookahead);  S = compute(V, next H minibatches)
           wait for the previous push's reply; apply its downlink to the replica
           reply.retrain (that push was too stale and dropped, or refused): put the block state back
               to what it was before that push, drop the exchange just computed, train the dropped
               steps again from the fresh view
           Push (seq, first step, base version, lr, density, S) on the background thread
    end:   wait for the last reply; send the block state (StageState) and keep it for the next stage

The push of exchange t and the reply that follows travel on a background thread
while exchange t+1 computes, so each exchange starts from a replica one reply
old (bounded staleness 1, measured by the server as usual). The time the task
waits for a reply is the exposed communication, reported per exchange. A push
carries the block state when a reply asks (a checkpoint); at the stage's end the
state follows the last push, once it is answered, as a message of its own.
With ``ps.shards`` > 1 a push's delta travels as one piece per shard, sent to the shards
before the push (which then carries only their norms) reaches the driver, and the reply's
weights part is the shards' parts, merged (:mod:`sparkcnn.shards`).
Nothing here imports Spark.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np

from sparkcnn.compression import codec
from sparkcnn.protocol import (
    Push,
    StageState,
    StateArray,
    StreamTicket,
    StreamTotals,
    TaskContextInfo,
    TaskSpec,
)
from sparkcnn.shards import shard_ranges, split_delta, sum_squares
from sparkcnn.worker import blockstore, chaos
from sparkcnn.worker.round import block_batches, compute, held_state, hold_state
from sparkcnn.worker.streamlink import Link, ServerGone
from sparkcnn.worker.task import TaskStart, freeze_heap_once, start_task
from sparkcnn.worker.view import Lookahead, View

log = logging.getLogger(__name__)


def run_stream_task(spec: TaskSpec, ticket: StreamTicket, initial: dict, block: int,
                    ctx: TaskContextInfo) -> StreamTotals:
    """Train ``block`` through one stage of the stream (module docstring); returns the task's totals.

    ``initial``: block -> state arrays from a checkpoint (a resumed run's first stage)."""
    task = start_task(spec, ctx, block, f"stream block {block}")
    # before the stream opens: a full collection walking TF's objects would stall this task
    # for ~0.3 s mid-stage, and the other blocks' pushes would run its staleness past the bound
    freeze_heap_once()
    link = Link(ticket, block)
    try:
        stage = _BlockStream(spec, link, task, initial, ctx)
        stage.run()
        if stage.last_seq >= 0:
            state = stage.state()
            # the stage's state goes after its last push was answered, not on that push: on a
            # slow link its megabytes made the push stale enough to be dropped, again and again
            reply = link.send_state(StageState(stage.last_seq, _state_arrays(state)))
            if reply.refused:
                log.warning("block %s: the server did not keep its state of exchange %s (%s)", block,
                            stage.last_seq, reply.refused)
            blockstore.save_state(task.root, spec.run_id, block, stage.last_seq, state)
    finally:
        link.close()
    return StreamTotals(block=block, exchanges=stage.exchanges, samples=stage.samples,
                        last_seq=stage.last_seq, exposed_comm_s=stage.exposed,
                        task_s=time.perf_counter() - task.t0)


class _BlockStream:
    """One block's exchanges of a stage: compute, settle the previous push's reply, push."""

    def __init__(self, spec: TaskSpec, link: Link, task: TaskStart, initial: dict, ctx: TaskContextInfo):
        self.spec, self.link, self.block = spec, link, task.block
        self.trainer, self.policy = task.trainer, task.policy  # the block's, through the stage
        self.images, self.labels = task.images, task.labels
        start, parts = link.start()
        if start.plan is None:
            raise ServerGone(f"the parameter server sent no plan for block {self.block}")
        self.plan = plan = start.plan
        self.view = View(spec.sparse_downlink, spec.layout)
        self.view.take(start, parts)
        self.ranges = shard_ranges(spec.layout, len(link.ticket.shards)) if link.ticket.shards else None
        self.look = Lookahead() if plan.lookahead else None
        if self.look:
            self.look.observe(self.view.weights, self.view.version, None)
        state, self.reset, _ = task.state(initial, plan.expect_state)
        hold_state(spec, self.trainer, self.policy, state)  # the policy and the trainer keep it
        self.lr, self.density, self.send_state = start.lr, start.density, start.send_state
        self.attempt = max(ctx.attempt, plan.attempt)  # the stage's rerun count
        self.seq, self.step, self.left = plan.seq0, plan.first_step, plan.steps
        self.executor = task.executor
        # (future of the reply, the push, the block state before it, steps left before it)
        self.pending = None
        self.exposed, self.exchanges, self.samples, self.last_seq = 0.0, 0, 0, -1
        self.wait_s, self.down_bytes, self.resyncs_sent, self.refusals = 0.0, 0, 0, 0
        self.pushed_to = self.seq - 1  # the highest seq pushed: one at or below it is trained again
        self._cpu_marks = self._cpu_now()  # where the CPU outside TF stood at the last push

    def state(self) -> dict:
        return held_state(self.spec, self.trainer, self.policy)

    def _cpu_now(self) -> tuple[float, float, float]:
        return time.thread_time(), self.trainer.tf_thread_s, self.link.cpu_s

    def _overhead_cpu(self) -> float:
        """The CPU outside TensorFlow since the last call: this thread outside the TF calls (the
        view, lookahead, momentum policy, codec, messages), and the push thread (Flight). TF's
        own threads are not in it; the push thread's share is of the pushes landed by now."""
        now, last = self._cpu_now(), self._cpu_marks
        self._cpu_marks = now
        return (now[0] - last[0]) - (now[1] - last[1]) + (now[2] - last[2])

    def snapshot(self) -> dict:
        """The block state before an exchange, kept until its reply: in the per-step form the
        policy's references, intact for the two exchanges that reply takes (it steps out of
        place: ``KEEP``), else copies."""
        if self.spec.per_step:
            return self.policy.snapshot()
        return self.state()

    def run(self) -> None:
        """With ``plan.overlap`` exchange t + 1 computes while push t travels; else each exchange
        waits for the previous reply first (its base then holds the block's own last push)."""
        while self.left > 0 or self.pending is not None:
            if self.pending is not None and not self.plan.overlap and self._settle():
                continue
            work = self._compute() if self.left > 0 else None
            if self.pending is not None and self._settle():
                continue  # the exchange just computed started from the dropped one's state
            if work is None:
                break
            self._push(*work)

    def _compute(self) -> tuple:
        """The next exchange's delta, from the view (extrapolated by the lookahead)."""
        spec, view = self.spec, self.view
        n = min(self.plan.h, self.left)
        before = self.snapshot()  # put back if this push is dropped
        batches = block_batches(spec, self.block, len(self.labels), self.step, n)
        w = self.look.weights(view.weights) if self.look else view.weights
        t0 = time.perf_counter()
        sent, _, loss_sum, correct, seen = compute(spec, self.trainer, self.policy, None, w, self.images,
                                                   self.labels, batches, self.lr, self.density, live=True)
        if self.ranges is None:
            payload = codec.encode(sent, spec.layout, value_dtype=spec.value_dtype)
        else:  # a piece per shard; the guard's norm is of the values as they travel
            payload = [codec.encode(p, spec.layout, value_dtype=spec.value_dtype)
                       for p in split_delta(sent, self.ranges)]
        return (n, before, view.version, self.lr, self.density, sent, payload, loss_sum, correct, seen,
                time.perf_counter() - t0)

    def _settle(self) -> bool:
        """Wait for the pending push's reply and take it: its downlink, the next lr and density.
        True when the push was dropped (too stale) or refused: the block state and the cursor
        are back where they were before it, to train those steps again."""
        fut, last, before, left = self.pending
        self.pending = None
        tw = time.perf_counter()
        reply, parts = self.link.wait(fut)
        self.wait_s = time.perf_counter() - tw
        self.exposed += self.wait_s
        self.down_bytes = self.view.take(reply, parts)
        if self.look:
            self.look.observe(self.view.weights, self.view.version, reply.tau, self.view.changed)
        self.lr, self.density, self.send_state = reply.lr, reply.density, reply.send_state
        if not reply.retrain:
            self.refusals, self.last_seq = 0, last.seq
            return False
        self.refusals = self.refusals + 1 if reply.refused else 0
        if self.refusals > 3:
            raise RuntimeError(f"block {self.block} exchange {last.seq}: refused 4 times ({reply.refused})")
        hold_state(self.spec, self.trainer, self.policy, before)
        self.seq, self.step, self.left = last.seq, last.first_step, left
        return True

    def _push(self, n, before, base, lr, density, sent, payload, loss_sum, correct, seen, compute_s) -> None:
        spec = self.spec
        pieces = payload if isinstance(payload, list) else []
        sumsq = tuple(sum_squares(codec.decode(p, spec.layout)) for p in pieces)
        push = Push(seq=self.seq, first_step=self.step, steps=n, samples=seen, base_version=base,
                    have=self.view.version, attempt=self.attempt, lr=lr, density=density, loss_sum=loss_sum,
                    correct=correct, nnz=int(sent.nnz), compute_s=compute_s, wait_s=self.wait_s,
                    view_bytes=self.down_bytes, state_reset=self.reset,
                    replica_resync=self.view.resyncs > self.resyncs_sent,
                    pid=os.getpid(), executor=self.executor, payload=b"" if pieces else payload,
                    state=_state_arrays(self.state()) if self.send_state else (), sumsq=sumsq,
                    overhead_cpu_s=self._overhead_cpu())
        self.resyncs_sent = self.view.resyncs
        first_try = self.attempt == 0 and self.seq > self.pushed_to  # neither a rerun nor a retrain
        self.pushed_to = max(self.pushed_to, self.seq)
        if chaos.holds(spec, self.block, self.seq, first_try):
            chaos.hold(spec)  # this push arrives stale
        self.pending = (self.link.send(push, pieces), push, before, self.left)
        if chaos.kills(spec, self.seq, self.block, self.attempt):
            self.link.wait(self.pending[0])  # the push has landed: its retry must be a duplicate
            chaos.kill_worker(self.block, self.seq)
        self.reset = False
        self.seq, self.step, self.left = self.seq + 1, self.step + n, self.left - n
        self.exchanges += 1
        self.samples += seen


def _state_arrays(state: dict) -> tuple[StateArray, ...]:
    """A block state (flat float32 arrays by name) as a push carries it."""
    return tuple(StateArray(name, "float32", np.ascontiguousarray(a, np.float32).tobytes())
                 for name, a in sorted(state.items()))
