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
The loop (``_BlockStream``) keeps its parts apart: the cursor, what the server offers, the
pushes' tally, the CPU meter and the push in flight (:mod:`.streamstate`), the block's training
(:mod:`.streamwork`) and the connection (:mod:`.streamlink`).
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
from sparkcnn.shards import sum_squares
from sparkcnn.worker import blockstore, chaos
from sparkcnn.worker.streamlink import Link, ServerGone
from sparkcnn.worker.streamstate import CpuMeter, Cursor, Offer, Pending, Tally
from sparkcnn.worker.streamwork import BlockWork, Trained
from sparkcnn.worker.task import TaskStart, freeze_heap_once, start_task

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
        last_seq = stage.cursor.last_seq
        if last_seq >= 0:
            state = stage.work.state()
            # the stage's state goes after its last push was answered, not on that push: on a
            # slow link its megabytes made the push stale enough to be dropped, again and again
            reply = link.send_state(StageState(last_seq, _state_arrays(state)))
            if reply.refused:
                log.warning("block %s: the server did not keep its state of exchange %s (%s)", block,
                            last_seq, reply.refused)
            blockstore.save_state(task.root, spec.run_id, block, last_seq, state)
    finally:
        link.close()
    tally = stage.tally
    return StreamTotals(block=block, exchanges=tally.exchanges, samples=tally.samples,
                        last_seq=stage.cursor.last_seq, exposed_comm_s=tally.exposed,
                        task_s=time.perf_counter() - task.t0)


class _BlockStream:
    """One block's exchanges of a stage: compute, settle the previous push's reply, push."""

    def __init__(self, spec: TaskSpec, link: Link, task: TaskStart, initial: dict, ctx: TaskContextInfo):
        self.spec, self.link, self.block, self.executor = spec, link, task.block, task.executor
        start, parts = link.start()
        if start.plan is None:
            raise ServerGone(f"the parameter server sent no plan for block {self.block}")
        self.plan = plan = start.plan
        self.work = BlockWork(task, start, parts, len(link.ticket.shards), plan.lookahead)
        state, reset, _ = task.state(initial, plan.expect_state)
        self.work.hold(state)
        self.offer = Offer(start)
        self.cursor = Cursor(plan, max(ctx.attempt, plan.attempt))
        self.tally = Tally(reset)
        self.pending: Pending | None = None
        self.meter = CpuMeter(task.trainer, link)

    def run(self) -> None:
        """With ``plan.overlap`` exchange t + 1 computes while push t travels; else each exchange
        waits for the previous reply first (its base then holds the block's own last push)."""
        cursor = self.cursor
        while cursor.left > 0 or self.pending is not None:
            if self.pending is not None and not self.plan.overlap and self._settle():
                continue
            work = self._compute() if cursor.left > 0 else None
            if self.pending is not None and self._settle():
                continue  # the exchange just computed started from the dropped one's state
            if work is None:
                break
            self._push(work)

    def _compute(self) -> Trained:
        """The next exchange, from the view (extrapolated by the lookahead)."""
        cursor, offer = self.cursor, self.offer
        return self.work.compute(cursor.step, min(self.plan.h, cursor.left), offer.lr, offer.density)

    def _settle(self) -> bool:
        """Wait for the pending push's reply and take it: its downlink, the next lr and density.
        True when the push was dropped (too stale) or refused: the block state and the cursor
        are back where they were before it, to train those steps again."""
        pending, self.pending = self.pending, None
        tw = time.perf_counter()
        reply, parts = self.link.wait(pending.future)
        self.tally.waited(time.perf_counter() - tw)
        self.tally.took(self.work.take(reply, parts))
        self.offer.take(reply)
        last = pending.push
        if not reply.retrain:
            self.cursor.kept(last.seq)
            return False
        if self.cursor.refused(reply.refused) > 3:
            raise RuntimeError(f"block {self.block} exchange {last.seq}: refused 4 times ({reply.refused})")
        self.work.hold(pending.before)
        self.cursor.rewind(last, pending.left)
        return True

    def _push(self, ex: Trained) -> None:
        spec, cursor, tally, view = self.spec, self.cursor, self.tally, self.work.view
        pieces = ex.payload if isinstance(ex.payload, list) else []
        sumsq = tuple(sum_squares(codec.decode(p, spec.layout)) for p in pieces)
        push = Push(seq=cursor.seq, first_step=cursor.step, steps=ex.n, samples=ex.seen, base_version=ex.base,
                    have=view.version, attempt=cursor.attempt, lr=ex.lr, density=ex.density,
                    loss_sum=ex.loss_sum, correct=ex.correct, nnz=int(ex.sent.nnz), compute_s=ex.compute_s,
                    wait_s=tally.wait_s, view_bytes=tally.down_bytes, state_reset=tally.reset,
                    replica_resync=view.resyncs > tally.resyncs_sent,
                    pid=os.getpid(), executor=self.executor, payload=b"" if pieces else ex.payload,
                    state=_state_arrays(self.work.state()) if self.offer.send_state else (),
                    sumsq=sumsq, overhead_cpu_s=self.meter.overhead())
        tally.resynced(view.resyncs)
        first_try = cursor.first_try()  # neither a rerun nor a retrain
        if chaos.holds(spec, self.block, cursor.seq, first_try):
            chaos.hold(spec)  # this push arrives stale
        self.pending = Pending(self.link.send(push, pieces), push, ex.before, cursor.left)
        if chaos.kills(spec, cursor.seq, self.block, cursor.attempt):
            self.link.wait(self.pending.future)  # the push has landed: its retry must be a duplicate
            chaos.kill_worker(self.block, cursor.seq)
        tally.pushed(ex.seen)
        cursor.advance(ex.n)


def _state_arrays(state: dict) -> tuple[StateArray, ...]:
    """A block state (flat float32 arrays by name) as a push carries it."""
    return tuple(StateArray(name, "float32", np.ascontiguousarray(a, np.float32).tobytes())
                 for name, a in sorted(state.items()))
