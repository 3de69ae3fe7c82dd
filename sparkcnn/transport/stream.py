"""The streaming transport: one long-lived barrier task per block per epoch, exchanging with the
driver's parameter-server service every H steps, instead of one Spark job per exchange.

    for each epoch (a stage):
        plan every block: first seq, first step, steps, the state it continues from
        one barrier job over the placed blocks: worker.stream.run_stream_task per block
        each Push -> checked against the plan -> ExchangeCore.accept (ASGD) or, once every block's
                     push of a round is in, accept_round (BSP); the Reply carries the downlinks since
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
dropped as stale, and the retrained push again. Spark still places, retries (a barrier stage restarts as a whole; pushes already applied
come back as duplicates and are dropped by their key) and shows every stage. The service
(:mod:`sparkcnn.transport.service`) is closed when the run ends or fails.

``ps.shards`` > 1: K shard processes keep W and U by key range (:mod:`sparkcnn.shards`). The
core decides each push from its header as above, and every decision goes to every shard as
one entry of an ordered log before the lock is released; the shards apply the pieces the
tasks sent them and answer with their parts of the reply, at the version the log entry left.
The driver's own W and U are a cut of the shards at each stage's end and each checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import threading
import time
from collections import deque
from functools import partial

from sparkcnn.transport import tasks
from sparkcnn.server.driver import DriverShorthands, RoundDriver
from sparkcnn.server.exchange import ExchangeCore
from sparkcnn.transport.service import PSService
from sparkcnn.transport.streamcut import StageCheckpoints
from sparkcnn.errors import BadInput
from sparkcnn.protocol import Answer, Push, Reply, RoundResult, StageState, StreamPlan, StreamTicket, steps_per_epoch
from sparkcnn.staleness import resolve_rule
from sparkcnn.streamwire import WireError

log = logging.getLogger(__name__)

STATE_DTYPES = ("float32",)  # block state arrays are flat float32 vectors


class _Session:
    """One task's stream: its block and the (lr, density) pairs its replies offered, which its
    pushes must have trained with (another stream, even with the token, cannot change them)."""

    def __init__(self, engine: "StreamEngine", block: int, stream: int):
        self.engine, self.block, self.stream = engine, block, stream
        self.offered: deque = deque(maxlen=4)
        self.start: Reply | None = None
        self.ordinal = -1       # messages received on this stream, less one (a push's key on the shards)
        self.counted = False    # the last message was counted by push() (then refused: not again)
        self.shard_version = -1  # ps.shards > 1: the version the shards answered its last message at
        self.state_msg = False   # the message being taken is a StageState

    accept = (Push, StageState)

    def push(self, p: Push | StageState) -> Reply:
        if isinstance(p, StageState):  # not an exchange: no key on the shards, nothing to count
            self.state_msg = True
            reply = self.engine.stage_state(self, p)
            self.state_msg = False
            return reply
        self.ordinal += 1
        self.counted = True
        reply = self.engine.push(self, p)
        self.counted = False
        return reply

    def refused(self, why: str) -> Reply:
        """A message the service refused changed nothing: its sender trains those steps again
        (an end-of-stage state: it is not kept, and the reply says why)."""
        if self.state_msg:
            self.state_msg = False
            return self.engine.stage_state(self, None, refused=why)
        if not self.counted:
            self.ordinal += 1
        self.counted = False
        with self.engine.lock:
            self.engine._to_shards([(self, True)])
            return self.engine._reply(self, have=-1, retrain=True, refused=why)


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


def stream_task(spec, ticket: StreamTicket, initial: dict):
    """``fn(block, ctx)`` running :func:`sparkcnn.worker.stream.run_stream_task` on the executor."""

    def fn(block, ctx):
        from sparkcnn.worker.stream import run_stream_task

        return run_stream_task(spec, ticket, initial, block, ctx)

    return fn


def check_limits(backend, num_blocks: int, sync: bool) -> None:
    """A barrier stage needs a slot per block at once and no dynamic allocation (one-line errors);
    checked before the blocks are placed, which on the stream is a barrier stage too."""
    if backend.dynamic_allocation():
        raise BadInput("engine.transport=stream runs barrier stages, which Spark refuses under dynamic "
                       "allocation: set spark.dynamicAllocation.enabled=false")
    slots = backend.stage_slots()
    if backend.spark is None and sync:
        raise BadInput("engine.transport=stream with engine.mode=sync needs every block running at once: "
                       "use a Spark master, not engine.master=inprocess")
    if slots is not None and num_blocks > slots:
        raise BadInput(f"engine.transport=stream runs one barrier task per block at once: data.num_blocks="
                       f"{num_blocks} exceeds the {slots} task slots of this session")


class StreamEngine(DriverShorthands, StageCheckpoints):
    """Async (ASGD) or BSP over the streaming transport, through the same exchange core as the jobs transport."""

    def __init__(self, cfg, backend, spec, block_rows: dict[int, int], weights, sink=None, progress=None,
                 run_dir: str | None = None):
        self.cfg, self.backend, self.spec, self.block_rows = cfg, backend, spec, block_rows
        self.num_blocks = len(block_rows)
        self.sync = cfg.engine.mode == "sync"
        self.h = cfg.train.steps_per_round
        block_steps = {k: steps_per_epoch(n, cfg.train.batch_size) for k, n in block_rows.items()}
        # sync: every block trains the smallest block's steps, so each round has a push from every block
        self.pass_end = {k: min(block_steps.values()) if self.sync else s for k, s in block_steps.items()}
        self.driver = RoundDriver(cfg, backend, spec, weights, evaluate=partial(tasks.evaluate, backend, spec),
                                  keep_broadcasts=2, sink=sink, progress=progress, run_dir=run_dir)
        # a replica may trail by the other blocks' pushes in flight: keep their downlinks
        self.driver.inline_downlinks = 4 * self.num_blocks + 4
        # one step per exchange: the next step computes while the push travels (its staleness
        # compensated by the lookahead); at H > 1 an exchange waits for its reply first, which
        # costs ~1 % of an exchange's compute and keeps tau near the jobs transport's (measured
        # 1 epoch on 12,000 rows: 0.43 with the overlap and lambda = 1/tau, 0.71 on jobs)
        self.overlap = self.h == 1
        # and the lookahead with it: the convergence matrix (2 epochs) had the stream at H = 1 without
        # it 2-9 points below the jobs transport, async and sync, dense and sparse
        self.lookahead = self.overlap
        self.core = ExchangeCore(self.driver, block_steps, batch_size=cfg.train.batch_size,
                                 staleness_rule=resolve_rule(cfg.ps.staleness, self.lookahead))
        self.core.n_train = sum(self.pass_end.values()) * cfg.train.batch_size
        self.total_samples = cfg.train.epochs * self.core.n_train
        floor = 4 * self.num_blocks  # the overlap alone makes tau about 2-3 at 2 blocks
        if not self.sync and self.core.max_staleness < floor:
            log.info("ps.max_staleness %s raised to %s on the stream: its own overlap makes pushes that stale",
                     self.core.max_staleness, floor)
            self.core.max_staleness = floor
        self.max_message_bytes = cfg.engine.max_message_bytes or 8 * int(self.W.size) + (1 << 20)
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)  # sync rounds, and blocks held for a checkpoint cut
        self.arrived: dict[int, dict[int, RoundResult]] = {}  # sync: seq -> block -> its push
        self.plans: dict[int, StreamPlan] = {}
        self.opens: dict[int, int] = {}       # streams opened per block in this stage (its attempt + 1)
        self.tau: dict[int, int] = {}         # block -> staleness of its last applied push (its lookahead)
        self.failure: BaseException | None = None
        self.next_epoch = 0
        self.initial_states: dict = {}        # block -> state from a checkpoint, for the next stage
        self.final_states: dict = {}          # block -> state its last push of the stage carried
        self.stage_states: dict = {}          # block -> state it started this stage from (when known)
        self.cut: dict | None = None          # a checkpoint being gathered: block -> its state
        self.ckpt_at, self.ckpt_cost_s, self.ckpt_t = 0, 0.0, 0.0
        self.exposed_s = 0.0
        self.service: PSService | None = None
        self.streams = 0                      # streams opened in the run (each one's number on the shards)

    # -- the service's handler ----------------------------------------------------------------
    def open(self, hello: dict) -> "_Session":
        """A task's stream, from its descriptor ``{"block": b}`` (KeyError/TypeError: refused)."""
        block = hello["block"]
        if type(block) is not int:
            raise TypeError(block)
        with self.lock:
            plan = self.plans[block]  # a block of no plan: KeyError, the service refuses the stream
            # a rerun barrier stage starts its tasks at Spark attempt 0 again: count the opens
            self.opens[block] = self.opens.get(block, 0) + 1
            self.streams += 1
            session = _Session(self, block, self.streams)
            self._to_shards([(session, True)])  # the shards send the task's first view (its ordinal -1)
            session.start = self._reply(session, have=-1, plan=dataclasses.replace(
                plan, attempt=self.opens[block] - 1, stream=self.streams))
            return session

    def push(self, session: "_Session", p: Push) -> Reply:
        with self.lock:
            if self.failure is not None:  # the run is failing: no more pushes
                raise self.failure
            self._check(session, p)  # WireError: refused and counted by the service, nothing changed
            try:
                return self._push_sync(session, p) if self.sync else self._push_async(session, p)
            except BaseException as e:  # noqa: BLE001 - the engine loop raises it when the stage ends
                if self.failure is None:
                    self.failure = e
                self.cond.notify_all()
                self.backend.stop()
                raise

    def _check_state(self, state) -> None:
        for a in state:
            if a.dtype not in STATE_DTYPES or len(a.data) != 4 * self.W.size:
                raise WireError(f"Push.state {a.name!r}: expected {self.W.size} float32 values")

    def _check(self, session: "_Session", p: Push) -> None:
        """Refuse a push the plan cannot hold, naming the field, before anything changes."""
        block = session.block
        c, plan = self.core, self.plans.get(block)
        if plan is None:
            raise WireError(f"block {block} has no plan in this stage")
        if p.seq <= c.last_seq[block]:
            return  # a duplicate (a rerun stage): dropped by its key
        want = c.last_seq[block] + 1
        left = self.pass_end[block] - c.block_step[block]
        if p.seq != want:
            raise WireError(f"Push.seq {p.seq}: block {block} expects {want}")
        if p.first_step != c.cursor(block):
            raise WireError(f"Push.first_step {p.first_step}: block {block} is at {c.cursor(block)}")
        if not 1 <= p.steps <= min(self.h, left):
            raise WireError(f"Push.steps {p.steps}: expected 1..{min(self.h, left)}")
        if p.samples != p.steps * self.cfg.train.batch_size:
            raise WireError(f"Push.samples {p.samples}: expected {p.steps * self.cfg.train.batch_size}")
        if not 0 <= p.base_version <= self.driver.version:
            raise WireError(f"Push.base_version {p.base_version}: the server is at {self.driver.version}")
        if (p.lr, p.density) not in session.offered:
            raise WireError(f"Push.lr/density {p.lr}/{p.density}: not offered on this stream")
        self._check_state(p.state)
        k = self.cfg.ps.shards
        if k > 1 and (p.payload or len(p.sumsq) != k):
            raise WireError(f"Push.sumsq: expected {k} pieces' norms and no payload (ps.shards={k})")
        if k == 1 and p.sumsq:
            raise WireError("Push.sumsq: this server has no shards")

    def _to_shards(self, answered: list) -> None:
        """ps.shards > 1: send the shards what the core just decided, and the pushes now answered
        ((session, retrain) pairs; a session's current ordinal), before the lock is released."""
        shards = self.driver.shards
        if shards is not None:
            shards.step([Answer(s.stream, s.ordinal, retrain) for s, retrain in answered])
            for s, _ in answered:  # the version they answer at, which the reply must say (a cut may wait)
                s.shard_version = shards.view_version if self.spec.sparse_downlink else shards.version

    def _result(self, session: "_Session", p: Push) -> RoundResult:
        return RoundResult(block=session.block, seq=p.seq, attempt=p.attempt, base_version=p.base_version,
                           payload=p.payload, samples=p.samples, steps=p.steps, loss_sum=p.loss_sum,
                           correct=p.correct, nnz=p.nnz, prep_s=0.0, compute_s=p.compute_s, encode_s=0.0,
                           task_s=p.compute_s + p.wait_s, state_reset=p.state_reset, state_stale=False,
                           replica_resync=p.resync, view_bytes=p.down_bytes, pid=p.pid, executor=p.executor,
                           lr=p.lr, density=p.density, first_step=p.first_step, sumsq=p.sumsq,
                           piece=(session.stream, session.ordinal))

    def _push_async(self, session: "_Session", p: Push) -> Reply:
        block, t0 = session.block, time.perf_counter()
        out = self.core.accept(self._result(session, p), pass_end=self.pass_end[block])
        self._to_shards([(session, out is not None and out.dropped)])
        if out is None:  # a duplicate
            return self._reply(session, p.have)
        if out.dropped:
            # its replica follows the downlinks since the push like any other reply: a dense copy
            # (0.9 MB) on a 20 Mbit/s link took long enough for the retrained push to be stale again,
            # ten times in a row in one run (a refusal, or shards, still send the dense copy)
            return self._reply(session, have=p.have, retrain=True)
        self.tau[block] = out.tau
        self._take_state(block, p)
        self._record(out.record, p, t0)
        if self.cut is None and self._checkpoint_due():
            self.cut = {}
        if self.cut is not None and block in self.cut:
            self._gather_cut()
        return self._reply(session, p.have)

    def _push_sync(self, session: "_Session", p: Push) -> Reply:
        """BSP: the reply waits until every block's push of this round has arrived; the last
        arrival applies them together. A rerun stage's pushes of applied rounds are answered at once."""
        block = session.block
        if p.seq <= self.core.last_seq[block]:
            self._to_shards([(session, False)])
        else:
            self.arrived.setdefault(p.seq, {})[block] = (self._result(session, p), p, session)
            if len(self.arrived[p.seq]) == self.num_blocks:
                t0 = time.perf_counter()
                got = self.arrived.pop(p.seq)
                out = self.core.accept_round([r for r, _, _ in got.values()], p.seq,
                                             pass_end=self.pass_end[block])
                self._to_shards([(s, False) for _, _, s in got.values()])
                self.tau.update({k: out.tau for k in got})
                for k, (_, q, _) in got.items():
                    self._take_state(k, q)
                self._record(out.record, p, t0)
                if self.cut is not None and len(self.cut) == self.num_blocks:
                    self._write_cut()
                elif self.cut is None and self._checkpoint_due():
                    self.cut = {}
                self.cond.notify_all()
            elif not self.cond.wait_for(lambda: p.seq <= self.core.last_seq[block] or self.failure is not None,
                                        timeout=self.cfg.engine.stream_timeout_s):
                late = sorted(set(self.block_rows) - set(self.arrived.get(p.seq, {})))
                raise TimeoutError(f"sync stream exchange {p.seq}: blocks {late} did not push within "
                                   f"engine.stream_timeout_s")
            if self.failure is not None:
                raise self.failure
        return self._reply(session, p.have)

    def _reply(self, session: "_Session", have: int, *, retrain: bool = False, refused: str = "",
               plan: StreamPlan | None = None) -> Reply:
        """The next lr and density, the block's last staleness and the weights part: W (dense
        downlink), or the downlinks since ``have``, or a dense copy of U when the replica cannot
        follow them (a start, a refusal, a long lag) or when they weigh more than the copy (a
        replica many warm-up downlinks behind)."""
        d, block = self.driver, session.block
        lr, density = d.schedule(min(self.core.epoch_float, self.cfg.train.epochs))
        session.offered.append((lr, density))
        head = dict(lr=lr, density=density, tau=self.tau.get(block, 0), retrain=retrain, refused=refused,
                    send_state=self.cut is not None and block not in self.cut, plan=plan)
        if d.shards is not None:  # the weights part comes from the shards, at the version they answered
            return Reply(**head, dense=b"", dense_version=session.shard_version)
        if not self.spec.sparse_downlink:
            return Reply(**head, dense=d.W.tobytes(), dense_version=d.version)
        v = d.ps.view_version
        dls = tuple(m for m in d.downlinks if m.version > have)
        if have == v:
            return Reply(**head, dense=b"", dense_version=v)
        if (have >= 0 and dls and dls[0].base_version == have
                and sum(len(m.payload) for m in dls) < 4 * d.ps.U.size):
            return Reply(**head, dense=b"", dense_version=v, downlinks=dls)
        return Reply(**head, dense=d.ps.U.tobytes(), dense_version=v)

    def _record(self, rec: dict, p: Push, t0: float) -> None:
        d = self.driver
        rec.update(epoch=min(int(self.core.epoch_float - 1e-9) if self.core.samples_done else 0,
                             self.cfg.train.epochs - 1),
                   compute_s=p.compute_s, exposed_comm_s=p.wait_s, round_overhead_s=p.wait_s,
                   task_overhead_cpu_s=p.overhead_cpu_s,
                   apply_s=time.perf_counter() - t0,
                   images_per_s=rec["samples"] / max(1e-9, p.compute_s + p.wait_s), transport="stream")
        d.record(rec)
        if d.progress:
            total = max(1, self.total_samples // max(1, self.cfg.train.batch_size * self.h))
            d.progress.round(rec, total)
        d.chaos_kill(rec["round"])

    # -- the loop -----------------------------------------------------------------------------
    def _plan_stage(self) -> None:
        """Each block's share of the next stage, from its cursor. A block that finished this
        stage's pass before a mid-epoch checkpoint (a resumed run) has no steps in it: its
        cursor is already at the next pass, which the next stage trains."""
        c = self.core
        self.stage_states = {**self.final_states, **self.initial_states}  # what each block starts from
        left = {k: 0 if c.block_epoch[k] > self.next_epoch else self.pass_end[k] - c.block_step[k]
                for k in self.block_rows}
        # a block with no steps ends the stage where it starts it
        self.final_states = {k: s for k, s in self.stage_states.items() if not left[k]}
        self.arrived, self.opens, self.cut = {}, {}, None
        self.plans = {k: StreamPlan(seq0=c.last_seq[k] + 1, first_step=c.cursor(k), steps=left[k], h=self.h,
                                    expect_state=c.last_seq[k], lookahead=self.lookahead,
                                    overlap=self.overlap, attempt=0)
                      for k in self.block_rows}

    def run(self, start_round: int = 0, on_epoch=None) -> dict:
        t_start = time.perf_counter()
        d = self.driver
        self.service = PSService(self.backend.driver_host(), self, self.max_message_bytes)
        try:
            if self.cfg.ps.shards > 1:
                d.shards = self._start_shards()
            ticket = StreamTicket(self.service.host, self.service.port, self.service.token,
                                  self.cfg.engine.stream_timeout_s,
                                  shards=d.shards.locations if d.shards is not None else ())
            while self.next_epoch < self.cfg.train.epochs:
                e = self.next_epoch
                self._plan_stage()
                initial, self.initial_states = self.initial_states, {}
                if not self.backend.resident:  # no executor keeps a block's state: it comes from the driver
                    initial = {**self.final_states, **initial}
                desc = f"sparkcnn {self.spec.run_id} epoch {e + 1} stream"
                try:
                    with _frozen_heap():
                        totals = self.backend.run_stage(stream_task(self.spec, ticket, initial), self.num_blocks,
                                                        desc)
                except BaseException:
                    if self.failure is not None:
                        raise self.failure from None
                    raise
                if self.failure is not None:
                    raise self.failure
                missing = [k for k in self.block_rows if self.core.block_epoch[k] <= e]
                if missing:
                    log.warning("epoch %s: blocks %s did not finish their steps", e + 1, missing)
                if d.shards is not None:  # the driver's W and U, for the evaluation and the checkpoint
                    d.shards.refresh(d.ps)
                exposed = sum(t.exposed_comm_s for t in totals)  # the tasks' waits, the last reply's too
                self.exposed_s += exposed
                d.write_epoch(e, time.perf_counter() - t_start, on_epoch,
                              staleness_histogram={str(k): v for k, v in sorted(self.core.staleness_hist.items())},
                              exposed_comm_s=exposed)
                self.next_epoch = e + 1
                if d.run_dir is not None:
                    self.save_checkpoint(self.next_epoch, self.final_states)
        finally:
            self.service.close()
            if d.shards is not None:
                d.shards.close()
                d.shards = None
        out = d.summary(time.perf_counter() - t_start)
        steps = max(1, sum(r.get("steps", 0) for r in d.history))
        out.update(transport="stream", exposed_comm_ms_per_step=1000 * self.exposed_s / steps,
                   stream={k: v for k, v in self.service.counters.items()},
                   ps_address=f"{self.service.host}:{self.service.port}", ps_peers=sorted(self.service.peer_hosts))
        return out

    def _start_shards(self):
        """ps.shards > 1: the shard processes, started from the driver's W and U (a restored run's)."""
        from sparkcnn.transport.shardgroup import ShardCoordinator

        c, d = self.cfg.compression, self.driver
        return ShardCoordinator(self.cfg.ps.shards, self.service.host, self.service.token, d.ps,
                                selector=d.plan.selector, dense_below=c.dense_below, value_dtype=self.spec.value_dtype,
                                keep_downlinks=d.inline_downlinks, timeout_s=self.cfg.engine.stream_timeout_s,
                                max_message_bytes=self.max_message_bytes)
