"""Executor side of the streaming transport: one long-lived task trains its block and talks to
the driver's parameter server every H steps (H may be 1).

    start  <- Reply: StreamPlan (seq0, first step, steps, H) + lr, density + weights (W, or the view U)
    loop:  keep the block state;  V = replica (extrapolated, _Lookahead);  S = compute(V, next H minibatches)
           wait for the previous push's reply; apply its downlink to the replica
           reply.retrain (that push was too stale and dropped, or refused): put the block state back
               to what it was before that push, drop the exchange just computed, train the dropped
               steps again from the fresh view
           Push (seq, first step, base version, lr, density, S) on the background thread
    end:   wait for the last reply; keep the block state for the next stage

The push of exchange t and the reply that follows travel on a background thread
while exchange t+1 computes, so each exchange starts from a replica one reply
old (bounded staleness 1, measured by the server as usual). The time the task
waits for a reply is the exposed communication, reported per exchange. A push
carries the block state when a reply asks (a checkpoint) and at the stage's end.
Nothing here imports Spark.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np

from sparkcnn import blockstore
from sparkcnn.compression import codec, native
from sparkcnn.compression.feedback import make_policy
from sparkcnn.protocol import Done, Push, Reply, StateArray, StreamTicket, StreamTotals, TaskContextInfo, TaskSpec
from sparkcnn.streamwire import decode, encode
from sparkcnn.worker.round import (
    _chaos_hit,
    block_batches,
    block_state_at,
    compute,
    freeze_heap_once,
    held_state,
    hold_state,
    local_root,
)
from sparkcnn.worker.trainer import get_trainer

log = logging.getLogger(__name__)


FULL_CHECK_EVERY = 64  # replies between full checksums of the replica (each downlink is checked alone)


class ServerGone(RuntimeError):
    """The parameter server did not answer in time or closed the stream."""


class _Link:
    """One DoExchange stream to the parameter server; every call bounded by ``timeout_s``."""

    def __init__(self, ticket: StreamTicket, block: int):
        import pyarrow as pa
        import pyarrow.flight as flight

        self._pa, self.ticket = pa, ticket
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sparkcnn-push")
        where = f"{ticket.host}:{ticket.port}"
        try:
            self.client = flight.FlightClient(f"grpc+tcp://{where}")
            opts = flight.FlightCallOptions(headers=[(b"authorization", f"Bearer {ticket.token}".encode())])
            desc = flight.FlightDescriptor.for_command(json.dumps({"block": block}).encode())
            self.writer, self.reader = self.client.do_exchange(desc, opts)
        except Exception as e:  # noqa: BLE001 - any failure to reach it means the same to the task
            raise ServerGone(f"parameter server at {where} unreachable ({type(e).__name__})") from None

    def _read(self):
        try:
            chunk = self.reader.read_chunk()
        except StopIteration:
            raise ServerGone("the parameter server closed the stream") from None
        except Exception as e:  # noqa: BLE001 - Flight raises per gRPC status; all mean the server is gone
            raise ServerGone(f"parameter server stream failed ({type(e).__name__})") from None
        return decode(chunk.app_metadata, (Reply,))

    def start(self):
        return self._wait(self._pool.submit(self._read))

    def send(self, push: Push):
        """Push on the background thread; returns a future of the reply."""
        buf = encode(push)

        def roundtrip():
            self.writer.write_metadata(self._pa.py_buffer(buf))
            return self._read()

        return self._pool.submit(roundtrip)

    def _wait(self, fut):
        try:
            return fut.result(timeout=self.ticket.timeout_s)
        except FutureTimeout:
            raise ServerGone(f"parameter server at {self.ticket.host}:{self.ticket.port} did not answer "
                             f"within {self.ticket.timeout_s:g} s") from None

    def wait(self, fut):
        return self._wait(fut)

    def close(self) -> None:
        try:
            self.writer.write_metadata(self._pa.py_buffer(encode(Done())))
            self.writer.done_writing()
            self.writer.close()
        except Exception:  # noqa: BLE001 - closing a stream to a server that is gone
            pass
        self._pool.shutdown(wait=False, cancel_futures=True)


class _View:
    """The weights this block computes from: W (dense downlink) or a checksummed replica of U."""

    def __init__(self, sparse: bool, layout):
        from sparkcnn.replica import Replica

        self.sparse, self.layout = sparse, layout
        self.replica = Replica() if sparse else None
        self.w: np.ndarray | None = None
        self.version = 0
        self.resyncs = 0
        self.replies = 0
        self.changed: np.ndarray | None = None  # what the last take moved: indices, or None (all of it)

    def take(self, reply: Reply) -> int:
        """Apply a reply's weights part; returns the bytes it carried."""
        from sparkcnn.replica import Downlink

        nbytes = len(reply.dense) + sum(len(m.payload) for m in reply.downlinks)
        self.changed = _NOTHING
        if reply.dense:  # W itself, or a dense copy of U (start, resync)
            self.changed = None
            w = np.frombuffer(reply.dense, np.float32)
            if self.sparse:
                self.replica.load_snapshot(reply.dense_version, w.copy())
                if reply.plan is None:
                    self.resyncs += 1
            else:
                self.w = w
            self.version = reply.dense_version
        if self.sparse and reply.downlinks:
            dls = [Downlink(m.version, codec.decode(m.payload, self.layout), m.checksum_after, m.base_version,
                            m.assign) for m in reply.downlinks]
            # each downlink is checked by its O(nnz) checksum; the full O(P) pass only every
            # FULL_CHECK_EVERY replies (at H = 1 it would cost ~1 ms of every step)
            self.replies += 1
            self.replica.apply(dls, full_check=self.replies % FULL_CHECK_EVERY == 0)
            self.version = self.replica.version
            if self.changed is not None:
                self.changed = np.concatenate([d.delta.indices for d in dls])
        return nbytes

    @property
    def weights(self) -> np.ndarray:
        return self.replica.U if self.sparse else self.w


class _Lookahead:
    """Delay compensation: the weights a step's update will land on, extrapolated.

    With the push of step t in flight while step t+1 computes, a block's update
    lands ``tau`` server versions after the view it was computed from (the
    server measures ``tau`` and says it in each reply). Momentum makes the
    server's motion smooth, so the task computes at

        view + tau · (view − previous view) / (versions between them)

    rather than at the view (measured: at one step per exchange the plain view
    kept the per-step runs near 0.8, DESIGN §3). ``tau = 0`` is the view itself.

    A sparse view moves only where its downlinks land, so the velocity is zero
    elsewhere: given the indices a reply moved (``changed``), both the velocity
    and the extrapolated weights are updated there and where the velocity was
    non-zero, in O(nnz), bitwise the full passes (each of which cost ~0.25 ms of
    every step at one step per exchange); ``changed=None`` (a dense copy) runs them.
    """

    def __init__(self):
        self.prev: np.ndarray | None = None
        self.prev_version = -1
        self.velocity: np.ndarray | None = None
        self.out: np.ndarray | None = None
        self.tau = 0
        self.moving: np.ndarray | None = None  # where the velocity may be non-zero (None: anywhere)
        self.dirty: np.ndarray | None = None   # where ``out`` is out of date (None: everywhere)

    def observe(self, w: np.ndarray, version: int, tau: int | None, changed: np.ndarray | None = None) -> None:
        """The view ``w`` at ``version``; ``changed``: the indices moved since the last call (None: any)."""
        if tau is not None and int(tau) != self.tau:
            self.tau = int(tau)
            self._stale(self.moving)
        if self.prev is None:
            self.prev, self.prev_version = w.copy(), version
            return
        if version <= self.prev_version:
            if changed is None or changed.size:  # moved, same version: the next motion is measured in full
                self.moving = None
                self._stale(changed)
            return
        s = np.float32(1.0 / (version - self.prev_version))
        self.prev_version = version
        if self.velocity is not None and changed is not None and self.moving is not None:
            v, p = self.velocity, self.prev
            self._stale(self.moving)
            if native.enabled():
                native.velocity_step_at(w, p, v, s, self.moving, changed)
            else:
                v[self.moving] = 0.0  # w == prev there now: (w - prev) · s is +0
                v[changed] = (w[changed] - p[changed]) * s
                p[changed] = w[changed]
            self.moving = changed
            self._stale(changed)
            return
        if self.velocity is None:
            self.velocity, self.out = np.empty_like(self.prev), np.empty_like(self.prev)
        if native.enabled():  # one pass instead of three, bitwise the same
            native.velocity_step(w, self.prev, self.velocity, s)
        else:
            np.subtract(w, self.prev, out=self.velocity)
            self.velocity *= s
            np.copyto(self.prev, w)
        self.moving = np.flatnonzero(self.velocity)
        self.dirty = None

    def _stale(self, idx: np.ndarray | None) -> None:
        """``out`` must be recomputed at ``idx`` (None: everywhere)."""
        if self.dirty is None or idx is None or self.dirty.size + idx.size > self.out.size // 4:
            self.dirty = None  # (a full pass is as cheap)
        else:
            self.dirty = np.concatenate([self.dirty, idx])

    def weights(self, w: np.ndarray) -> np.ndarray:
        """The extrapolated weights (a buffer reused by the next call), or ``w`` itself."""
        if self.velocity is None or self.tau <= 0:
            return w
        a = np.float32(self.tau)
        if self.dirty is None:
            if native.enabled():
                native.axpy(self.tau, self.velocity, w, self.out)
            else:
                np.multiply(self.velocity, a, out=self.out)
                self.out += w
        else:
            d = self.dirty
            if native.enabled():
                native.axpy_at(a, self.velocity, w, self.out, d)
            else:
                self.out[d] = self.velocity[d] * a + w[d]
        self.dirty = _NOTHING
        return self.out


_NOTHING = np.empty(0, np.int64)


def run_stream_task(spec: TaskSpec, ticket: StreamTicket, initial: dict, block: int,
                    ctx: TaskContextInfo) -> StreamTotals:
    """Train ``block`` through one stage of the stream (module docstring); returns the task's totals.

    ``initial``: block -> state arrays from a checkpoint (a resumed run's first stage)."""
    t_task = time.perf_counter()
    root = local_root(spec, ctx)
    images, labels = blockstore.get_block(root, spec.run_id, "train", spec.num_blocks, block)
    trainer = get_trainer(spec, ctx)
    # before the stream opens: a full collection walking TF's objects would stall this task
    # for ~0.3 s mid-stage, and the other blocks' pushes would run its staleness past the bound
    freeze_heap_once()
    link = _Link(ticket, block)
    try:
        task = _BlockStream(spec, link, trainer, block, images, labels, root, initial, ctx)
        task.run()
        if task.last_seq >= 0:
            blockstore.save_state(root, spec.run_id, block, task.last_seq, task.state())
    finally:
        link.close()
    return StreamTotals(block=block, exchanges=task.exchanges, samples=task.samples, last_seq=task.last_seq,
                        exposed_comm_s=task.exposed, task_s=time.perf_counter() - t_task)


class _BlockStream:
    """One block's exchanges of a stage: compute, settle the previous push's reply, push."""

    def __init__(self, spec: TaskSpec, link: _Link, trainer, block: int, images, labels, root: str,
                 initial: dict, ctx: TaskContextInfo):
        self.spec, self.link, self.trainer, self.block = spec, link, trainer, block
        self.images, self.labels = images, labels
        start = link.start()
        if start.plan is None:
            raise ServerGone(f"the parameter server sent no plan for block {block}")
        self.plan = plan = start.plan
        self.view = _View(spec.sparse_downlink, spec.layout)
        self.view.take(start)
        self.look = _Lookahead() if plan.lookahead else None
        if self.look:
            self.look.observe(self.view.weights, self.view.version, None)
        state, self.reset = _stage_state(spec, plan.expect_state, root, block, initial)
        self.policy = make_policy(spec.method, spec.momentum_mode, spec.per_step, spec.layout, spec.value_dtype,
                                  spec.dense_below, spec.momentum, masking=spec.factor_masking)
        hold_state(spec, trainer, self.policy, state)  # the policy and the trainer keep it through the stage
        self.lr, self.density, self.send_state = start.lr, start.density, start.send_state
        self.attempt = max(ctx.attempt, plan.attempt)  # the stage's rerun count
        self.seq, self.step, self.left = plan.seq0, plan.first_step, plan.steps
        self.executor = f"{socket.gethostname()}:{os.path.realpath(root)}"
        self.pending = None  # (future of the reply, the push, the block state before it, steps left before it)
        self.exposed, self.exchanges, self.samples, self.last_seq = 0.0, 0, 0, -1
        self.wait_s, self.down_bytes, self.resyncs_sent, self.refusals = 0.0, 0, 0, 0
        self.held: set[int] = set()

    def state(self) -> dict:
        return held_state(self.spec, self.trainer, self.policy)

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
        before = self.state()  # copies: put back if this push is dropped
        batches = block_batches(spec, self.block, len(self.labels), self.step, n)
        w = self.look.weights(view.weights) if self.look else view.weights
        t0 = time.perf_counter()
        sent, _, loss_sum, correct, seen = compute(spec, self.trainer, self.policy, None, w, self.images,
                                                   self.labels, batches, self.lr, self.density, live=True)
        payload = codec.encode(sent, spec.layout, value_dtype=spec.value_dtype)
        return (n, before, view.version, self.lr, self.density, sent, payload, loss_sum, correct, seen,
                time.perf_counter() - t0)

    def _settle(self) -> bool:
        """Wait for the pending push's reply and take it: its downlink, the next lr and density.
        True when the push was dropped (too stale) or refused: the block state and the cursor
        are back where they were before it, to train those steps again."""
        fut, last, before, left = self.pending
        self.pending = None
        tw = time.perf_counter()
        reply = self.link.wait(fut)
        self.wait_s = time.perf_counter() - tw
        self.exposed += self.wait_s
        self.down_bytes = self.view.take(reply)
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
        final = n == self.left  # the stage's last push carries the block state, as a checkpoint asks
        push = Push(seq=self.seq, first_step=self.step, steps=n, samples=seen, base_version=base,
                    have=self.view.version, attempt=self.attempt, lr=lr, density=density, loss_sum=loss_sum,
                    correct=correct, nnz=int(sent.nnz), compute_s=compute_s, wait_s=self.wait_s,
                    down_bytes=self.down_bytes, state_reset=self.reset, resync=self.view.resyncs > self.resyncs_sent,
                    pid=os.getpid(), executor=self.executor, payload=payload,
                    state=_state_arrays(self.state()) if self.send_state or final else ())
        self.resyncs_sent = self.view.resyncs
        if _hold_hit(spec, self.block, self.seq, self.attempt, self.held):  # chaos: this push arrives stale
            time.sleep(spec.chaos_hold_s)
        self.pending = (self.link.send(push), push, before, self.left)
        if self.attempt == 0 and _chaos_hit(spec, self.seq, self.block, 1, spec.chaos_kill_p):
            self.link.wait(self.pending[0])  # the push has landed: its retry must be a duplicate
            log.warning("chaos: killing the Python worker (block %s exchange %s)", self.block, self.seq)
            os._exit(17)
        self.reset = False
        self.seq, self.step, self.left = self.seq + 1, self.step + n, self.left - n
        self.exchanges += 1
        self.samples += seen


def _state_arrays(state: dict) -> tuple[StateArray, ...]:
    """A block state (flat float32 arrays by name) as a push carries it."""
    return tuple(StateArray(name, "float32", np.ascontiguousarray(a, np.float32).tobytes())
                 for name, a in sorted(state.items()))


def _hold_hit(spec: TaskSpec, block: int, seq: int, attempt: int, held: set) -> bool:
    """Chaos (``chaos.hold_every``): block 0 holds every n-th push once, so it arrives stale."""
    n = spec.chaos_hold_every
    if n <= 0 or block != 0 or attempt != 0 or seq % n != n - 1 or seq in held:
        return False
    held.add(seq)
    return True


def _stage_state(spec: TaskSpec, expect_state: int, root: str, block: int, initial: dict) -> tuple[dict, bool]:
    """The block state the stage continues from: the checkpoint's, or the previous stage's spill."""
    if block in initial:
        return dict(initial[block]), False
    return block_state_at(spec, root, block, expect_state)
