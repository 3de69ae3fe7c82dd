"""The streaming transport: one long-lived barrier task per block per epoch, exchanging with the
driver's parameter-server service every H steps, instead of one Spark job per exchange.

    for each epoch (a stage):
        plan every block: first seq, first step, steps, the state it continues from
        one barrier job over the placed blocks: worker.stream.run_stream_task per block
        each Push -> checked against the plan -> Run.accept (ASGD: applied on arrival; BSP: held
                     until every block's push of its round is in); the Reply carries the downlinks since
                     the task's replica (or a dense copy), the next lr and density
        stage done: evaluate, record, checkpoint

ASGD: a push is applied on arrival. A push too stale to apply is answered ``retrain``:
the task puts its block state back to what it was before that push and trains the same
steps again from the fresh view it is sent (every step is applied exactly once). BSP: a
push's reply waits until every block's push of that round has arrived, and the last
arrival applies them together; each round computes while the previous push travels, so
it starts from weights one round old (like ``engine.pipeline`` of the jobs transport).

Checkpoints inside a stage (``checkpoint.every_rounds`` applied exchanges, at most one per
50 times the last one's cost) are consistent cuts: the replies ask every block still
training for its state; a block's next push carries it, and its reply is held until all
have arrived, so the server state written holds exactly the pushes up to each block's
state push (:mod:`sparkcnn.transport.streamcut`). Each block's state at the stage's end (the
epoch-end cut) follows its last push once that push is answered, as a ``StageState`` of its
own: carried on the push, its megabytes kept that push on a 100 Mbit/s link long enough to be
dropped as stale, and the retrained push again. Spark still places, retries (a barrier stage
restarts as a whole; pushes already applied come back as duplicates and are dropped by their
key) and shows every stage. The service
(:mod:`sparkcnn.transport.service`) is closed when the run ends or fails.

``ps.shards`` > 1: K shard processes keep W and U by key range (:mod:`sparkcnn.shards`). The
core decides each push from its header as above, and every decision goes to every shard as
one entry of an ordered log before the lock is released; the shards apply the pieces the
tasks sent them and answer with their parts of the reply, at the version the log entry left.
The driver's own W and U are a cut of the shards at each stage's end and each checkpoint.

``ps.servers`` > 1: K server processes each serve the blocks b with b mod K = their index, each
with a Run of its own, over one copy of W, U, the versions and the downlink log in shared memory
(:mod:`sparkcnn.transport.servers`); each block's task gets its server's address in its ticket.
The driver plans each stage on every server, writes their records in order, and merges their
state at the stage's end, before it evaluates and checkpoints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time
from functools import partial

from sparkcnn.errors import BadInput
from sparkcnn.protocol import StreamTicket, steps_per_epoch
from sparkcnn.server.exchange import downlink_cadence
from sparkcnn.server.run import Run, RunShape
from sparkcnn.server.sharedstore import SharedStore
from sparkcnn.transport import tasks
from sparkcnn.transport.base import Transport
from sparkcnn.transport.pushes import PushHandler
from sparkcnn.transport.servers import ServerGroup
from sparkcnn.transport.service import PSService
from sparkcnn.transport.stage import Stage
from sparkcnn.transport.streamcut import Cut

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _frozen_heap():
    """During a stage, the cyclic GC leaves alone what the driver held before it (gc.freeze).

    A full collection walks every object of the process: with Keras and TensorFlow loaded,
    ~360 k of them, 0.3 s, during which the interpreter lock is held and no push is served
    (measured under 64 streams: three such pauses in the first 4 s of a stage). Frozen, a
    collection walks only what the stage made. Unfrozen at the stage's end, so the user's
    process collects as before."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def stream_task(spec, ticket: StreamTicket, initial: dict, tickets: dict | None = None):
    """``fn(block, ctx)`` running :func:`sparkcnn.worker.stream.run_stream_task` on the executor;
    ``tickets``: block -> its own ticket (``ps.servers`` > 1: its server's address)."""
    tickets = tickets or {}

    def fn(block, ctx):
        from sparkcnn.worker.stream import run_stream_task

        return run_stream_task(spec, tickets.get(block, ticket), initial, block, ctx)

    return fn


def check_limits(backend, num_blocks: int, sync: bool) -> None:
    """A barrier stage needs a slot per block at once and no dynamic allocation (one-line errors);
    checked before the blocks are placed, which on the stream is a barrier stage too."""
    if backend.cluster.dynamic_allocation():
        raise BadInput("engine.transport=stream runs barrier stages, which Spark refuses under dynamic "
                       "allocation: set spark.dynamicAllocation.enabled=false")
    slots = backend.cluster.stage_slots()
    if backend.spark is None and sync:
        raise BadInput("engine.transport=stream with engine.mode=sync needs every block running at once: "
                       "use a Spark master, not engine.master=inprocess")
    if slots is not None and num_blocks > slots:
        raise BadInput(f"engine.transport=stream runs one barrier task per block at once: data.num_blocks="
                       f"{num_blocks} exceeds the {slots} task slots of this session")


class StreamEngine(Transport):
    """Async (ASGD) or BSP over the streaming transport, through the same Run as the jobs transport."""

    def __init__(self, cfg, backend, spec, block_rows: dict[int, int], weights, progress=None,
                 run_dir: str | None = None, warmup_started: float | None = None):
        self.cfg, self.backend, self.spec = cfg, backend, spec
        sync, h, n = cfg.engine.mode == "sync", cfg.train.steps_per_round, len(block_rows)
        steps = {k: steps_per_epoch(r, cfg.train.batch_size) for k, r in block_rows.items()}
        # sync: every block trains the smallest block's steps, so each round has a push from every block
        pass_end = {k: min(steps.values()) if sync else s for k, s in steps.items()}
        # one step per exchange: the next step computes while the push travels (its staleness
        # compensated by the lookahead); at H > 1 an exchange waits for its reply first, which
        # costs ~1 % of an exchange's compute and keeps tau near the jobs transport's (measured
        # 1 epoch on 12,000 rows: 0.43 with the overlap and lambda = 1/tau, 0.71 on jobs).
        # And the lookahead with it: the convergence matrix (2 epochs) had the stream at H = 1
        # without it 2-9 points below the jobs transport, async and sync, dense and sparse
        overlap = h == 1
        # a replica may trail by the other blocks' pushes in flight: keep their downlinks
        every = downlink_cadence(cfg.ps.downlink_every, n)
        if cfg.ps.servers > 1 and not backend.resident:
            raise BadInput(f"ps.servers={cfg.ps.servers} needs a session whose executors keep the blocks' "
                           "state between stages (not Spark Connect)")
        # ps.servers > 1: W, U, the versions, the downlinks and the run's progress, for every server
        self.store = SharedStore.create(weights, 4 * n + 4) if cfg.ps.servers > 1 else None
        self.server = Run(cfg, spec, weights,
                          RunShape(pass_end, bsp=sync, compensated=overlap, downlink_every=every,
                                   keep_broadcasts=2, inline_downlinks=4 * n + 4),
                          backend=backend, evaluate=partial(tasks.evaluate, backend, spec), progress=progress,
                          run_dir=run_dir, shared=self.store)
        stage = Stage(h, lookahead=overlap, overlap=overlap)
        cut = Cut(self.server, stage, backend, spec, sorted(block_rows), cfg.engine.stream_timeout_s)
        self.handler = PushHandler(cfg, spec, self.server, stage, cut, backend, pass_end)
        self.service: PSService | None = None
        self.group: ServerGroup | None = None  # ps.servers > 1
        self.exposed_s = 0.0
        self.warmup_s = self.warmed_up(warmup_started)

    @property
    def stage(self) -> Stage:
        return self.handler.stage

    @property
    def num_blocks(self) -> int:
        return len(self.handler.pass_end)

    @property
    def max_message_bytes(self) -> int:
        return self.cfg.engine.max_message_bytes or 8 * int(self.W.size) + (1 << 20)

    # -- the loop -----------------------------------------------------------------------------
    def run(self, start_round: int = 0, on_epoch=None) -> dict:
        t_start = time.perf_counter()
        run = self.server
        try:
            ticket = self._open()
            while self.stage.epoch < self.cfg.train.epochs:
                self._stage(ticket, t_start, on_epoch)
        finally:
            self._close()
        out = run.summary(time.perf_counter() - t_start)
        steps = max(1, sum(r.get("steps", 0) for r in run.history))
        if self.group is not None:
            front = self.group.front()
        else:
            s = self.service
            front = dict(stream=dict(s.counters), ps_address=f"{s.host}:{s.port}",
                         ps_peers=sorted(s.peer_hosts))
        out.update(transport="stream", exposed_comm_ms_per_step=1000 * self.exposed_s / steps, **front)
        return out

    def _open(self) -> StreamTicket:
        """The service (or ``ps.shards``' shards, or ``ps.servers``' processes) and the tasks' ticket."""
        run, timeout = self.server, self.cfg.engine.stream_timeout_s
        if self.cfg.ps.servers > 1:
            self.group = ServerGroup(self.cfg.ps.servers, run, self.store, self.backend,
                                     host=self.backend.driver_host(), spec=self.spec,
                                     pass_steps=dict(self.handler.pass_end),
                                     downlink_every=run.shape.downlink_every,
                                     max_message_bytes=self.max_message_bytes, timeout_s=timeout,
                                     run_dir=run.checkpoints.run_dir, write_cut=self._write_cut)
            host, port = self.group.server_of(0)
            return StreamTicket(host, port, self.group.token, timeout)
        self.service = PSService(self.backend.driver_host(), self.handler, self.max_message_bytes)
        if self.cfg.ps.shards > 1:
            run.attach_shards(self._start_shards())
        return StreamTicket(self.service.host, self.service.port, self.service.token, timeout,
                            shards=run.shards.locations if run.shards is not None else ())

    def _close(self) -> None:
        run = self.server
        if self.service is not None:
            self.service.close()
        if run.shards is not None:
            run.shards.close()
            run.attach_shards(None)
        if self.group is not None:
            self.group.close()
        if self.store is not None:
            self.store.close()  # the driver's W stays readable: its views keep the memory mapped

    def _write_cut(self, states: dict, t0: float) -> None:
        """``ps.servers`` > 1: a checkpoint inside a stage, from the blocks' states the servers
        sent (a block that sent none: the state it started the stage from)."""
        start = {k: s for k, s in self.stage.start.items() if s is not None}
        self.handler.cut.save(t0, {**start, **states}, read=False)

    def _failure(self) -> BaseException | None:
        """What failed the run during a stage: a push on the driver's service, or a server process."""
        if self.handler.failure is not None:
            return self.handler.failure
        return self.group.failure if self.group is not None else None

    def _stage(self, ticket: StreamTicket, t_start: float, on_epoch) -> None:
        """One epoch: a barrier stage of a task per block, then evaluation and the checkpoint."""
        run, h, e, group = self.server, self.handler, self.stage.epoch, self.group
        h.plan_stage()
        tickets = None
        if group is not None:  # each server plans its blocks; each block's task goes to its server
            group.start_stage(e)
            tickets = {b: dataclasses.replace(ticket, host=group.server_of(b)[0], port=group.server_of(b)[1])
                       for b in h.pass_end}
        initial = self.stage.task_states(self.backend.resident)
        desc = f"sparkcnn {self.spec.run_id} epoch {e + 1} stream"
        try:
            with _frozen_heap():
                fn = stream_task(self.spec, ticket, initial, tickets)
                totals = self.backend.run_stage(fn, self.num_blocks, desc)
        except BaseException:
            if self._failure() is not None:
                raise self._failure() from None
            raise
        if self._failure() is not None:
            raise self._failure()
        if group is not None:
            group.end_stage(e)
        missing = [k for k in h.pass_end if not self.stage.done(run.cursors, k)]
        if missing:
            log.warning("epoch %s: blocks %s did not finish their steps", e + 1, missing)
        if run.shards is not None:  # the driver's W and U, for the evaluation and the checkpoint
            run.shards.refresh(run.ps)
        exposed = sum(t.exposed_comm_s for t in totals)  # the tasks' waits, the last reply's too
        self.exposed_s += exposed
        run.write_epoch(e, time.perf_counter() - t_start, on_epoch, staleness=True, exposed_comm_s=exposed)
        self.stage.ended()
        if run.checkpoints.enabled:
            h.cut.save(time.perf_counter(), dict(self.stage.final))

    def _start_shards(self):
        """ps.shards > 1: the shard processes, started from the driver's W and U (a restored run's)."""
        from sparkcnn.transport.shardgroup import ShardCoordinator

        c, run = self.cfg.compression, self.server
        return ShardCoordinator(self.cfg.ps.shards, self.service.host, self.service.token, run.ps,
                                selector=run.schedule.plan.selector, dense_below=c.dense_below,
                                value_dtype=self.spec.value_dtype, keep_downlinks=run.downlink.inline,
                                timeout_s=self.cfg.engine.stream_timeout_s,
                                max_message_bytes=self.max_message_bytes)

    # -- checkpoints --------------------------------------------------------------------------
    def restore(self, ckpt) -> int:
        st = self.server.restore(ckpt)
        self.stage.restore(int(st["next_epoch"]), ckpt.blocks)
        return self.stage.epoch
