"""Executor side of the streaming transport: one long-lived task trains its block and talks to
the driver's parameter server every H steps (H may be 1).

    start  <- plan (seq0, step offset, steps, H, lr, density) + weights (W, or the view U)
    loop:  V = replica (extrapolated, _Lookahead);  S = compute(V, next H minibatches)
           wait for the previous push's reply; apply its downlink to the replica
           push (seq, base version, S) on the background thread    # overlaps the next compute
    end:   wait for the last reply; keep the block state for the next stage

The push of exchange t and the reply that follows travel on a background thread
while exchange t+1 computes, so each exchange starts from a replica one reply
old (bounded staleness 1, measured by the server as usual). The time the task
waits for a reply is the exposed communication, reported per exchange.
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
from sparkcnn.protocol import StreamTicket, TaskContextInfo, TaskSpec
from sparkcnn.streamwire import pack, unpack
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
        return unpack(chunk.app_metadata)

    def start(self):
        return self._wait(self._pool.submit(self._read))

    def send(self, header: dict, *blobs: bytes):
        """Push on the background thread; returns a future of the reply."""
        buf = pack(header, *blobs)

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
            self.writer.write_metadata(self._pa.py_buffer(pack({"op": "done"})))
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

    def take(self, header: dict, blobs: list[bytes]) -> int:
        """Apply a start or reply message's weights part; returns the bytes it carried."""
        from sparkcnn.replica import Downlink

        nbytes = sum(len(b) for b in blobs)
        self.changed = _NOTHING
        if header.get("dense"):  # W itself, or a dense copy of U (start, resync)
            self.changed = None
            w = np.frombuffer(blobs[0], np.float32)
            if self.sparse:
                self.replica.load_snapshot(int(header["weights_version"]), w.copy())
                if header.get("op") != "start":
                    self.resyncs += 1
            else:
                self.w = w
            self.version = int(header["weights_version"])
            blobs = blobs[1:]
        if self.sparse and header.get("downlinks"):
            dls = [Downlink(d["version"], codec.decode(b, self.layout), d["checksum"], d["base_version"],
                            d["assign"]) for d, b in zip(header["downlinks"], blobs)]
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
                    ctx: TaskContextInfo) -> dict:
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
        start, blobs = link.start()
        plan = start["plan"]
        view = _View(spec.sparse_downlink, spec.layout)
        view.take(start, blobs)
        look = _Lookahead() if plan.get("lookahead") else None
        if look:
            look.observe(view.weights, view.version, None)
        state, reset = _stage_state(spec, plan, root, block, initial)
        policy = make_policy(spec.method, spec.momentum_mode, spec.per_step, spec.layout, spec.value_dtype,
                             spec.dense_below, spec.momentum, masking=spec.factor_masking)
        hold_state(spec, trainer, policy, state)  # the policy and the trainer keep it through the stage
        lr, density = float(plan["lr"]), float(plan["density"])
        attempt = max(ctx.attempt, int(plan.get("attempt", 0)))  # the stage's rerun count
        seq, offset, left, h = int(plan["seq0"]), int(plan["offset"]), int(plan["steps"]), int(plan["h"])
        executor = f"{socket.gethostname()}:{os.path.realpath(root)}"
        pending, exposed, exchanges, samples, last_seq, wait_s, down_bytes = None, 0.0, 0, 0, -1, 0.0, 0
        resyncs_sent = 0  # replica reloads already reported to the server
        while left > 0:
            n = min(h, left)
            batches = block_batches(spec, block, len(labels), offset, n)
            base = view.version
            w = look.weights(view.weights) if look else view.weights
            t0 = time.perf_counter()
            sent, _, loss_sum, correct, seen = compute(spec, trainer, policy, None, w, images, labels, batches,
                                                       lr, density, live=True)
            payload = codec.encode(sent, spec.layout, value_dtype=spec.value_dtype)
            t1 = time.perf_counter()
            if pending is not None:  # the previous push's reply: its downlink, the next lr and density
                tw = time.perf_counter()
                reply, rblobs = link.wait(pending)
                wait_s = time.perf_counter() - tw
                exposed += wait_s
                down_bytes = view.take(reply, rblobs)
                if look:
                    look.observe(view.weights, view.version, reply.get("tau"), view.changed)
                lr, density = float(reply["lr"]), float(reply["density"])
            header = {"op": "push", "seq": seq, "base_version": base, "have": view.version,
                      "attempt": attempt, "samples": seen,
                      "steps": len(batches), "loss_sum": loss_sum, "correct": correct, "nnz": int(sent.nnz),
                      "compute_s": t1 - t0, "wait_s": wait_s, "down_bytes": down_bytes, "state_reset": reset,
                      "resync": view.resyncs > resyncs_sent, "pid": os.getpid(), "executor": executor}
            resyncs_sent = view.resyncs
            pending = link.send(header, payload)
            if attempt == 0 and _chaos_hit(spec, seq, block, 1, spec.chaos_kill_p):
                link.wait(pending)  # the push has landed: its retry must be a duplicate
                log.warning("chaos: killing the Python worker (block %s exchange %s)", block, seq)
                os._exit(17)
            reset = False
            last_seq, seq, offset, left = seq, seq + 1, offset + n, left - n
            exchanges += 1
            samples += seen
        if pending is not None:
            tw = time.perf_counter()
            reply, rblobs = link.wait(pending)
            exposed += time.perf_counter() - tw
            view.take(reply, rblobs)
        if last_seq >= 0:
            blockstore.save_state(root, spec.run_id, block, last_seq, held_state(spec, trainer, policy))
    finally:
        link.close()
    return {"block": block, "exchanges": exchanges, "samples": samples, "last_seq": last_seq,
            "exposed_comm_s": exposed, "task_s": time.perf_counter() - t_task}


def _stage_state(spec: TaskSpec, plan: dict, root: str, block: int, initial: dict) -> tuple[dict, bool]:
    """The block state the stage continues from: the checkpoint's, or the previous stage's spill."""
    if block in initial:
        return dict(initial[block]), False
    return block_state_at(spec, root, block, int(plan["expect_state"]))
