"""The parameter-server service's handler: a stream task's messages, checked against its plan
and carried to :meth:`sparkcnn.server.run.Run.accept`.

    open(hello)   -> a session with the block's plan, or None (refused: no such block in the stage)
    push(p)       -> checked field by field (a WireError refuses it, nothing changed) -> Run.accept
        applied:    reply with the next lr, density, tau and the downlinks since the task's view
        retrain:    too stale (ASGD): reply ``retrain``; the task trains the same steps again
        held:       BSP: the reply waits until the round's last push applies it
        duplicate:  a rerun stage's push of an applied exchange: answered at once
    stage_state(m) -> a block's end-of-stage state, kept when it follows its last applied push

Every handler call runs under one lock; BSP pushes and checkpoint cuts wait on its condition.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from sparkcnn.protocol import Answer, Arrival, Push, Reply, StageState
from sparkcnn.server.records import Timings, Where
from sparkcnn.server.run import APPLIED, DUPLICATE, HELD, RETRAIN
from sparkcnn.streamwire import WireError
from sparkcnn.transport.stage import arrays

log = logging.getLogger(__name__)

STATE_DTYPES = ("float32",)  # block state arrays are flat float32 vectors


class Session:
    """One task's stream: its block and the (lr, density) pairs its replies offered, which its
    pushes must have trained with (another stream, even with the token, cannot change them)."""

    accept = (Push, StageState)

    def __init__(self, handler: "PushHandler", block: int, stream: int):
        self.handler, self.block, self.stream = handler, block, stream
        self.offered: deque = deque(maxlen=4)
        self.start: Reply | None = None
        self.ordinal = -1        # messages received on this stream, less one (a push's key on the shards)
        self.counted = False     # the last message was counted by push() (then refused: not again)
        self.shard_version = -1  # ps.shards > 1: the version the shards answered its last message at
        self.state_msg = False   # the message being taken is a StageState

    def started(self, reply: Reply) -> None:
        """The first reply, which the service sends when the stream opens."""
        self.start = reply

    def push(self, p: Push | StageState) -> Reply:
        if isinstance(p, StageState):  # not an exchange: no key on the shards, nothing to count
            self.state_msg = True
            reply = self.handler.stage_state(self, p)
            self.state_msg = False
            return reply
        self.ordinal += 1
        self.counted = True
        reply = self.handler.push(self, p)
        self.counted = False
        return reply

    def refused(self, why: str) -> Reply:
        """A message the service refused changed nothing: its sender trains those steps again
        (an end-of-stage state: it is not kept, and the reply says why)."""
        if self.state_msg:
            self.state_msg = False
            return self.handler.stage_state(self, None, refused=why)
        if not self.counted:
            self.ordinal += 1
        self.counted = False
        return self.handler.refuse(self, why)

    def answered(self, shards, sparse: bool) -> None:
        """The shards answered its message: at their view (sparse downlink) or weights' version."""
        self.shard_version = shards.view_version if sparse else shards.version


class PushHandler:
    """Checks a stage's messages and carries them to the run (module docstring)."""

    def __init__(self, cfg, spec, server, stage, cut, backend, pass_end: dict[int, int]):
        self.cfg, self.spec, self.server, self.stage, self.cut = cfg, spec, server, stage, cut
        self.backend, self.pass_end = backend, pass_end
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)  # BSP rounds, and blocks held for a checkpoint cut
        self.failure: BaseException | None = None
        self.tau: dict[int, int] = {}    # block -> staleness of its last applied push (its lookahead)

    def plan_stage(self) -> None:
        with self.lock:
            self.stage.plan(self.server.cursors, self.pass_end)
            self.cut.reset()

    def open(self, hello: dict) -> Session | None:
        """A task's stream, from its descriptor ``{"block": b}``; None (refused): no such block."""
        block = hello.get("block")
        if type(block) is not int:
            return None
        with self.lock:
            opened = self.stage.open(block)
            if opened is None:
                return None
            plan, stream = opened
            session = Session(self, block, stream)
            self._to_shards([(session, True)])  # the shards send the task's first view (its ordinal -1)
            session.started(self._reply(session, have=-1, plan=plan))
            return session

    def push(self, session: Session, p: Push) -> Reply:
        with self.lock:
            if self.failure is not None:  # the run is failing: no more pushes
                raise self.failure
            self._check(session, p)  # WireError: refused and counted by the service, nothing changed
            try:
                return self._take(session, p)
            except BaseException as e:  # noqa: BLE001 - the stage loop raises it when the stage ends
                if self.failure is None:
                    self.failure = e
                self.cond.notify_all()
                self.backend.stop()
                raise

    def refuse(self, session: Session, why: str) -> Reply:
        with self.lock:
            self._to_shards([(session, True)])
            return self._reply(session, have=-1, retrain=True, refused=why)

    def check_state(self, state) -> None:
        size = self.server.W.size
        for a in state:
            if a.dtype not in STATE_DTYPES or len(a.data) != 4 * size:
                raise WireError(f"Push.state {a.name!r}: expected {size} float32 values")

    def _check(self, session: Session, p: Push) -> None:
        """Refuse a push the plan cannot hold, naming the field, before anything changes."""
        block, c = session.block, self.server.cursors
        if block not in self.stage.plans:
            raise WireError(f"block {block} has no plan in this stage")
        if p.seq <= c.last_seq[block]:
            return  # a duplicate (a rerun stage): the run drops it by its key
        plan = self.stage.plans[block]  # the stage's share of the block's pass bounds its pushes
        want, left = c.last_seq[block] + 1, plan.first_step + plan.steps - c.cursor(block)
        h, batch = self.cfg.train.steps_per_round, self.cfg.train.batch_size
        if p.seq != want:
            raise WireError(f"Push.seq {p.seq}: block {block} expects {want}")
        if p.first_step != c.cursor(block):
            raise WireError(f"Push.first_step {p.first_step}: block {block} is at {c.cursor(block)}")
        if left <= 0:
            raise WireError(f"Push.seq {p.seq}: block {block} trained its {plan.steps} steps of the stage")
        if not 1 <= p.steps <= min(h, left):
            raise WireError(f"Push.steps {p.steps}: expected 1..{min(h, left)}")
        if p.samples != p.steps * batch:
            raise WireError(f"Push.samples {p.samples}: expected {p.steps * batch}")
        if not 0 <= p.base_version <= self.server.version:
            raise WireError(f"Push.base_version {p.base_version}: the server is at {self.server.version}")
        if (p.lr, p.density) not in session.offered:
            raise WireError(f"Push.lr/density {p.lr}/{p.density}: not offered on this stream")
        self.check_state(p.state)
        k = self.cfg.ps.shards
        if k > 1 and (p.payload or len(p.sumsq) != k):
            raise WireError(f"Push.sumsq: expected {k} pieces' norms and no payload (ps.shards={k})")
        if k == 1 and p.sumsq:
            raise WireError("Push.sumsq: this server has no shards")

    def _to_shards(self, answered: list) -> None:
        """ps.shards > 1: send the shards what the run just decided, and the pushes now answered
        ((session, retrain) pairs; a session's current ordinal), before the lock is released."""
        shards = self.server.shards
        if shards is not None:
            shards.step([Answer(s.stream, s.ordinal, retrain) for s, retrain in answered])
            for s, _ in answered:  # the version they answer at, which the reply must say (a cut may wait)
                s.answered(shards, self.spec.sparse_downlink)

    def _take(self, session: Session, p: Push) -> Reply:
        self.cut.wait_written(self.cond, lambda: self.failure is not None)
        block, t0, c0 = session.block, time.perf_counter(), time.thread_time()
        bsp = self.cfg.engine.mode == "sync"
        # one section of the store's lock from the apply to the reply's weights (several server
        # processes: one record lock per push, not one per write; the decode before stays outside)
        with self.server.ps.section():
            decision = self.server.accept(Arrival.of_push(block, p, (session.stream, session.ordinal)))
            t1, c1 = time.perf_counter(), time.thread_time()
            weights = None if decision.kind == HELD else self._weights(p.have)
        # the reply's weights are not the exchange's: its timings leave them out
        t0, c0 = t0 + time.perf_counter() - t1, c0 + time.thread_time() - c1
        if decision.kind == HELD:  # BSP: the round's last push applies it
            self.stage.keep_push(session, p)
            if not self.cond.wait_for(lambda: p.seq <= self.server.cursors.last_seq[block]
                                      or self.failure is not None, timeout=self.cfg.engine.stream_timeout_s):
                late = sorted(set(self.pass_end) - set(self.server.held_blocks(p.seq)))
                raise TimeoutError(f"sync stream exchange {p.seq}: blocks {late} did not push within "
                                   f"engine.stream_timeout_s")
            if self.failure is not None:
                raise self.failure
            return self._reply(session, p.have)
        if decision.kind in (DUPLICATE, RETRAIN):
            self._to_shards([(session, decision.kind == RETRAIN and not bsp)])
            # a dropped push's replica follows the downlinks since the push like any other reply:
            # a dense copy (0.9 MB) on a 20 Mbit/s link took long enough for the retrained push to
            # be stale again, ten times in a row in one run (a refusal, or shards, still send it)
            return self._reply(session, have=p.have, retrain=decision.kind == RETRAIN, weights=weights)
        held = self.stage.take_pushes(p.seq, decision.blocks, session, p) if bsp else [(session, p)]
        self._to_shards([(s, False) for s, _ in held])
        for s, q in held:
            self.tau[s.block] = decision.tau
            self.cut.take(s.block, q.state)
            if q.state:
                self.stage.keep_final(self.server.cursors, s.block, q.state)
        self._write(decision, p, t0, c0)
        if self.cut.open and (self.cut.complete() if bsp else session.block in self.cut.states):
            if bsp:
                self.cut.write()
            else:  # held until the checkpoint is written: the reply reads the weights after it
                self.cut.gather(self.cond, lambda: self.failure is not None)
                weights = None
        elif not self.cut.open and decision.checkpoint:
            self.cut.begin()
        if bsp:
            self.cond.notify_all()
        return self._reply(session, p.have, weights=weights)

    def _write(self, decision, p: Push, t0: float, c0: float) -> None:
        down, select, encode = self.server.downlink.cpu  # its parts' thread CPU (server/downlink.py)
        timings = Timings(compute_s=p.compute_s, exposed_comm_s=p.wait_s, round_overhead_s=p.wait_s,
                          task_overhead_cpu_s=p.overhead_cpu_s, apply_s=time.perf_counter() - t0,
                          images_per_s=decision.record.samples / max(1e-9, p.compute_s + p.wait_s),
                          server_cpu_s=time.thread_time() - c0, downlink_cpu_s=down, select_cpu_s=select,
                          encode_cpu_s=encode)
        t = self.cfg.train
        per_exchange = max(1, t.batch_size * t.steps_per_round)
        total = max(1, t.epochs * self.server.cursors.epoch_samples // per_exchange)
        line = self.server.write(decision, timings, Where(transport="stream"),
                                 progress_at=(decision.record.round, total))
        self.server.chaos_after(line["round"])

    def _weights(self, have: int):
        """The downlink's weights part of a reply to a replica at ``have`` (None: the shards')."""
        return None if self.server.shards is not None else self.server.downlink.since(have)

    def _reply(self, session: Session, have: int, *, retrain: bool = False, refused: str = "",
               plan=None, weights=None) -> Reply:
        """The next lr and density, the block's last staleness and the weights part (the
        downlink's, read now unless ``weights`` holds it, or the shards' at the version they
        answered)."""
        run, block = self.server, session.block
        lr, density = run.schedule_now()
        session.offered.append((lr, density))
        head = dict(lr=lr, density=density, tau=self.tau.get(block, 0), retrain=retrain, refused=refused,
                    send_state=self.cut.wants(block), plan=plan)
        if run.shards is not None:
            return Reply(**head, dense=b"", dense_version=session.shard_version)
        w = weights if weights is not None else self._weights(have)
        return Reply(**head, dense=w.dense, dense_version=w.dense_version, downlinks=w.downlinks)

    def stage_state(self, session: Session, m: StageState | None, refused: str = "") -> Reply:
        """Keep a block's end-of-stage state when ``m.seq`` is its last applied exchange and its
        pass of this stage is done; a state of any other exchange (a push dropped after it was
        sent, a stale rerun) changes nothing. Answered with the block's lr, density and tau, and
        ``refused`` (then ``m`` is None) for a state the service or the check refused."""
        with self.lock:
            if self.failure is not None:
                raise self.failure
            block, c = session.block, self.server.cursors
            if m is not None:
                self.check_state(m.state)  # WireError: refused by the service, back here with None
                if m.seq == c.last_seq[block]:
                    self.stage.keep_final(c, block, m.state)
            lr, density = self.server.schedule_now()
            return Reply(lr=lr, density=density, tau=self.tau.get(block, 0), retrain=False, send_state=False,
                         refused=refused, dense=b"", dense_version=-1)


__all__ = ["PushHandler", "Session", "arrays"]
