"""The streaming transport: one long-lived barrier task per block per epoch, exchanging with the
driver's parameter-server service every H steps, instead of one Spark job per exchange.

    for each epoch (a stage):
        plan every block: first seq, step offset, steps, the state it continues from
        one barrier job over the placed blocks: worker.stream.run_stream_task per block
        each push -> RoundDriver (dedup (block, seq) -> staleness rule -> decode + guard -> apply
                     -> downlink), exactly as the async jobs transport (engine.stream_downlink=round:
                     a downlink per N applied pushes, one per round as BSP); the reply carries the
                     downlinks since the worker's replica (or a dense resync), lr and density
        stage done: evaluate, record, checkpoint

ASGD: a push is applied on arrival, ``W -= lambda(tau) * S_k / N``. BSP (sync): a push's
reply waits until every block's push of that round has arrived, and the last arrival
applies them together (``W -= sum_k w_k S_k``); as every exchange computes while the
previous push travels, each round starts from the weights one round old (like
``engine.pipeline`` of the jobs transport). Spark still
places, retries (a barrier stage restarts as a whole; pushes already applied
come back as duplicates and are dropped by their key) and shows every stage.
The service (:mod:`sparkcnn.engine.psservice`) is closed when the run ends or fails.
"""

from __future__ import annotations

import logging
import threading
import time

from sparkcnn.checkpoint import int_keys, json_keys
from sparkcnn.engine.driver import DriverShorthands, RoundDriver
from sparkcnn.engine.psservice import PSService
from sparkcnn.errors import BadInput
from sparkcnn.protocol import RoundOrder, RoundResult, StreamTicket, steps_per_epoch
from sparkcnn.staleness import resolve_rule, staleness_scale

log = logging.getLogger(__name__)


def stream_task(spec, ticket: StreamTicket, initial: dict):
    """``fn(block, ctx)`` running :func:`sparkcnn.worker.stream.run_stream_task` on the executor."""

    def fn(block, ctx):
        from sparkcnn.worker.stream import run_stream_task

        return run_stream_task(spec, ticket, initial, block, ctx)

    return fn


class StreamEngine(DriverShorthands):
    """Async (ASGD) or BSP over the streaming transport, on the same RoundDriver as the jobs transport."""

    COUNTERS = ("next_seq", "last_seq", "block_epoch", "block_step", "staleness_hist")  # int-keyed, checkpointed

    def __init__(self, cfg, backend, spec, block_rows: dict[int, int], weights, sink=None, progress=None,
                 run_dir: str | None = None):
        self.cfg, self.backend, self.spec, self.block_rows = cfg, backend, spec, block_rows
        self.num_blocks = len(block_rows)
        self.block_steps = {k: steps_per_epoch(n, cfg.train.batch_size) for k, n in block_rows.items()}
        # samples in one stage (full minibatches; sync: every block the smallest block's steps)
        self.n_train = (self.num_blocks * min(self.block_steps.values()) if cfg.engine.mode == "sync"
                        else sum(self.block_steps.values())) * cfg.train.batch_size
        self.total_samples = cfg.train.epochs * self.n_train
        self.h = cfg.train.steps_per_round
        self.driver = RoundDriver(cfg, backend, spec, weights, keep_broadcasts=2, sink=sink, progress=progress,
                                  run_dir=run_dir)
        # a replica may trail by the other blocks' pushes in flight: keep their downlinks
        self.driver.inline_downlinks = 4 * self.num_blocks + 4
        self.max_message_bytes = cfg.engine.max_message_bytes or 8 * int(self.W.size) + (1 << 20)
        self.lock = threading.Lock()
        self.sync = cfg.engine.mode == "sync"
        self.round_done = threading.Condition(self.lock)  # sync: a round's pushes applied together
        self.arrived: dict[int, dict[int, RoundResult]] = {}  # sync: round -> block -> its push
        self.completed: set[int] = set()                      # sync: rounds of this stage applied
        self.next_seq = {k: 0 for k in block_rows}     # the block's next exchange number
        self.last_seq = {k: -1 for k in block_rows}    # its last applied exchange (its state's tag)
        self.block_epoch = {k: 0 for k in block_rows}
        self.block_step = {k: 0 for k in block_rows}
        self.resync: set[int] = set()
        self.initial_states: dict = {}
        self.samples_done = 0
        self.exchanges = 0
        self.next_epoch = 0
        self.plans: dict[int, dict] = {}
        self.opens: dict[int, int] = {}  # streams opened per block in this stage (its attempt + 1)
        self.failure: BaseException | None = None
        self.staleness_hist: dict[int, int] = {}
        self.staleness_rule = resolve_rule(cfg.ps.staleness, cfg.engine.stream_lookahead)
        self.tau: dict[int, int] = {}  # block -> staleness of its last applied push (its lookahead)
        self.downlink_every = self.num_blocks if cfg.engine.stream_downlink == "round" else 1
        self.exposed_s = 0.0
        self.service: PSService | None = None

    @property
    def epoch_float(self) -> float:
        return self.samples_done / self.n_train

    # -- the service's handler ----------------------------------------------------------------
    def open(self, hello: dict):
        block = int(hello["block"])
        with self.lock:
            plan = self.plans[block]
            # a rerun barrier stage starts its tasks at Spark attempt 0 again: count the opens
            self.opens[block] = self.opens.get(block, 0) + 1
            lr, density = self.driver.schedule(min(self.epoch_float, self.cfg.train.epochs))
            header = {"op": "start", "plan": {**plan, "lr": lr, "density": density,
                                              "attempt": self.opens[block] - 1}}
            return self._weights_reply(header, block, have=-1)

    def refused(self, block: int, why: str):
        with self.lock:
            self.driver.counters["rejected_deltas"] += 1
            lr, density = self.driver.schedule(min(self.epoch_float, self.cfg.train.epochs))
            return self._weights_reply({"op": "reply", "lr": lr, "density": density, "refused": why}, block,
                                       have=-1)

    def push(self, block: int, h: dict, blobs: list[bytes]):
        with self.lock:
            if self.failure is not None:  # the run is failing: no more pushes
                raise self.failure
            try:
                if self.sync:
                    return self._push_sync(block, h, blobs[0] if blobs else b"")
                return self._push(block, h, blobs[0] if blobs else b"")
            except BaseException as e:  # noqa: BLE001 - the engine loop raises it when the stage ends
                if self.failure is None:
                    self.failure = e
                self.backend.stop()
                raise

    def _result(self, block: int, h: dict, payload: bytes) -> RoundResult:
        return RoundResult(block=block, seq=int(h["seq"]), attempt=int(h["attempt"]),
                        base_version=int(h["base_version"]), payload=payload, samples=int(h["samples"]),
                        steps=int(h["steps"]), loss_sum=float(h["loss_sum"]), correct=int(h["correct"]),
                        nnz=int(h["nnz"]), prep_s=0.0, compute_s=float(h["compute_s"]), encode_s=0.0,
                        task_s=float(h["compute_s"]) + float(h["wait_s"]), state_reset=bool(h["state_reset"]),
                        state_stale=False, replica_resync=bool(h["resync"]), view_bytes=int(h["down_bytes"]),
                        pid=int(h["pid"]), executor=str(h["executor"]))

    def _push(self, block: int, h: dict, payload: bytes):
        d = self.driver
        r = self._result(block, h, payload)
        lr, density = d.schedule(min(self.epoch_float, self.cfg.train.epochs))
        have = int(h["have"])
        fresh = d.take_fresh([r])
        if fresh:
            self._apply(r, lr, density, float(h["wait_s"]))
        return self._reply(block, have)

    def _push_sync(self, block: int, h: dict, payload: bytes):
        """BSP: the reply waits until every block's push of this round has arrived; the last
        arrival applies them together (samples-weighted, as a jobs round). A retried stage's
        pushes of rounds already applied are answered at once (their results are duplicates)."""
        r = self._result(block, h, payload)
        i = r.seq - self.plans[block]["seq0"]  # the round of this stage
        if i not in self.completed:
            self.arrived.setdefault(i, {})[block] = r
            if len(self.arrived[i]) == self.num_blocks:
                self._apply_round(i, self.arrived.pop(i), float(h["wait_s"]))
                self.round_done.notify_all()
            elif not self.round_done.wait_for(lambda: i in self.completed or self.failure is not None,
                                              timeout=self.cfg.engine.stream_timeout_s):
                raise TimeoutError(f"sync stream round {i}: blocks {sorted(set(self.block_rows) - set(self.arrived.get(i, {})))} "
                                   f"did not push within engine.stream_timeout_s")
            if self.failure is not None:
                raise self.failure
        return self._reply(block, int(h["have"]))

    def _reply(self, block: int, have: int):
        """A push's reply: the next lr and density, the staleness of the block's last applied
        push (its lookahead) and the weights part."""
        lr, density = self.driver.schedule(min(self.epoch_float, self.cfg.train.epochs))
        return self._weights_reply({"op": "reply", "lr": lr, "density": density, "tau": self.tau.get(block, 0)},
                                   block, have)

    def _apply_round(self, i: int, results: dict, wait_s: float) -> None:
        d, t0 = self.driver, time.perf_counter()
        self.completed.add(i)
        lr, density = d.schedule(min(self.epoch_float, self.cfg.train.epochs))
        fresh = d.take_fresh([results[k] for k in sorted(results)])
        if not fresh:
            return
        self.tau.update({r.block: d.staleness(r) for r in fresh})
        out = d.apply(fresh, lr)
        nnz_down = d.send_downlink(self.epoch_float)
        d.count_flags(fresh)
        order = RoundOrder(seq=fresh[0].seq, steps={r.block: r.steps for r in fresh}, step_offset={}, lr=lr,
                           density=density, base_version=min(r.base_version for r in fresh))
        rec = {"kind": "round", "round": self.exchanges, "stage_round": i, "steps": max(r.steps for r in fresh),
               "staleness": max(d.staleness(r) for r in fresh) - 1, **d.exchange_record(order, fresh, out, nnz_down)}
        self.exchanges += 1
        for r in fresh:
            self._advance(r)
        self._record(rec, fresh, wait_s, t0)

    def _advance(self, r: RoundResult) -> None:
        """An applied push moves its block's cursor (and the samples done)."""
        self.last_seq[r.block] = r.seq
        self.samples_done += r.samples
        self.block_step[r.block] += r.steps
        if self.block_step[r.block] >= self.plans[r.block]["stage_end"]:
            self.block_epoch[r.block] += 1
            self.block_step[r.block] = 0

    def _record(self, rec: dict, results: list, wait_s: float, t0: float) -> None:
        d = self.driver
        samples, compute = sum(r.samples for r in results), max(r.compute_s for r in results)
        d.check_loss(f"exchange {rec['round']}", rec["loss"], rec["samples"])
        rec.update(epoch=min(int(self.epoch_float - 1e-9) if self.samples_done else 0, self.cfg.train.epochs - 1),
                   compute_s=compute, exposed_comm_s=wait_s, round_overhead_s=wait_s,
                   apply_s=time.perf_counter() - t0,
                   images_per_s=samples / max(1e-9, compute + wait_s), transport="stream")
        d.record(rec)
        if d.progress:
            total = max(1, self.total_samples // max(1, self.cfg.train.batch_size * self.h))
            d.progress.round(rec, total)
        d.chaos_kill(rec["round"])

    def _apply(self, r: RoundResult, lr: float, density: float, wait_s: float) -> None:
        d, t0 = self.driver, time.perf_counter()
        tau = d.staleness(r)
        self.tau[r.block] = tau
        self.staleness_hist[tau] = self.staleness_hist.get(tau, 0) + 1
        if d.too_stale(r):
            self.resync.add(r.block)
            return
        scale = staleness_scale(tau, self.staleness_rule) / self.num_blocks
        out = d.apply([r], lr, factor=scale)
        # engine.stream_downlink: after every applied push (DESIGN), or one per N of them as a
        # BSP round has: each costs a selection and an encoding here and a decoding in every task
        nnz_down = 0
        if (self.exchanges + 1) % self.downlink_every == 0:  # this push is the exchange's count + 1
            nnz_down = d.send_downlink(self.epoch_float)
        d.count_flags([r])
        order = RoundOrder(seq=r.seq, steps={r.block: r.steps}, step_offset={}, lr=lr, density=density,
                           base_version=r.base_version)
        rec = {"kind": "round", "round": self.exchanges, "seq": r.seq, "block": r.block,
               "block_epoch": self.block_epoch[r.block], "block_step": self.block_step[r.block],
               "staleness": tau, "scale": scale, "steps": r.steps, **d.exchange_record(order, [r], out, nnz_down)}
        self.exchanges += 1
        self._advance(r)
        self._record(rec, [r], wait_s, t0)

    def _weights_reply(self, header: dict, block: int, have: int):
        """The reply's weights part: W (dense downlink), or the downlinks since ``have``, or a
        dense copy of U when the replica cannot follow them (a start, a drop, a long lag)."""
        d = self.driver
        if not self.spec.sparse_downlink:
            return {**header, "dense": True, "weights_version": d.version}, [d.W.tobytes()]
        v = d.ps.view_version
        if have == v and block not in self.resync:
            return header, []
        dls = [m for m in d.downlinks if m.version > have]
        if have >= 0 and block not in self.resync and dls and dls[0].base_version == have:
            meta = [{"version": m.version, "base_version": m.base_version, "checksum": m.checksum_after,
                     "assign": m.assign} for m in dls]
            return {**header, "downlinks": meta}, [m.payload for m in dls]
        self.resync.discard(block)
        return {**header, "dense": True, "weights_version": v}, [d.ps.U.tobytes()]

    # -- the loop -----------------------------------------------------------------------------
    def _plan_stage(self) -> None:
        """Each block's share of the next stage. Sync: every block the same steps (the smallest
        block's), so each round has a push from every block; the others skip their last minibatch."""
        self.plans, self.arrived, self.completed, self.opens = {}, {}, set(), {}
        even = min(self.block_steps.values())
        for k in self.block_rows:
            end = even if self.sync else self.block_steps[k]
            self.plans[k] = {"seq0": self.next_seq[k], "offset": self.block_epoch[k] * self.block_steps[k]
                             + self.block_step[k], "steps": end - self.block_step[k], "stage_end": end,
                             "h": self.h, "expect_state": self.last_seq[k],
                             "lookahead": self.cfg.engine.stream_lookahead}
            self.next_seq[k] += -(-self.plans[k]["steps"] // self.h)

    def check_limits(self) -> None:
        """A barrier stage needs a slot per block at once and no dynamic allocation (one-line errors)."""
        if self.backend.dynamic_allocation():
            raise BadInput("engine.transport=stream runs barrier stages, which Spark refuses under dynamic "
                           "allocation: set spark.dynamicAllocation.enabled=false")
        slots = self.backend.stage_slots()
        if slots is None and self.sync:
            raise BadInput("engine.transport=stream with engine.mode=sync needs every block running at once: "
                           "use a Spark master, not engine.master=inprocess")
        if slots is not None and self.num_blocks > slots:
            raise BadInput(f"engine.transport=stream runs one barrier task per block at once: data.num_blocks="
                           f"{self.num_blocks} exceeds the {slots} task slots of this session")

    def run(self, start_round: int = 0, on_epoch=None) -> dict:
        self.check_limits()
        t_start = time.perf_counter()
        d = self.driver
        self.service = PSService(self.backend.driver_host(), self, self.max_message_bytes)
        ticket = StreamTicket(self.service.host, self.service.port, self.service.token,
                              self.cfg.engine.stream_timeout_s)
        try:
            while self.next_epoch < self.cfg.train.epochs:
                e = self.next_epoch
                self._plan_stage()
                initial, self.initial_states = self.initial_states, {}
                desc = f"sparkcnn {self.spec.run_id} epoch {e + 1} stream"
                try:
                    totals = self.backend.run_stage(stream_task(self.spec, ticket, initial), self.num_blocks, desc)
                except BaseException:
                    if self.failure is not None:
                        raise self.failure from None
                    raise
                if self.failure is not None:
                    raise self.failure
                missing = [k for k in self.block_rows if self.block_step[k] or self.block_epoch[k] <= e]
                if missing:
                    log.warning("epoch %s: blocks %s did not finish their steps", e + 1, missing)
                exposed = sum(t["exposed_comm_s"] for t in totals)  # the tasks' waits, the last reply's too
                self.exposed_s += exposed
                d.write_epoch(e, time.perf_counter() - t_start, on_epoch,
                              staleness_histogram={str(k): v for k, v in sorted(self.staleness_hist.items())},
                              exposed_comm_s=exposed)
                self.next_epoch = e + 1
                if d.run_dir is not None:
                    self.save_checkpoint()
        finally:
            self.service.close()
        out = d.summary(time.perf_counter() - t_start)
        steps = max(1, sum(r.get("steps", 0) for r in d.history))
        out.update(transport="stream", exposed_comm_ms_per_step=1000 * self.exposed_s / steps,
                   stream={k: v for k, v in self.service.counters.items()})
        return out

    # -- checkpoints --------------------------------------------------------------------------
    def save_checkpoint(self) -> str:
        """At a stage end every block's state is spilled with its last exchange's tag: read them."""
        blocks = self.driver.block_states(self.last_seq, self.num_blocks)
        st = {"next_epoch": self.next_epoch, "samples_done": self.samples_done, "exchanges": self.exchanges,
              **{name: json_keys(getattr(self, name)) for name in self.COUNTERS}}
        return self.driver.save_checkpoint(self.next_epoch, st, blocks)

    def restore(self, ckpt) -> int:
        st = self.driver.restore(ckpt)
        self.next_epoch, self.samples_done = int(st["next_epoch"]), int(st["samples_done"])
        self.exchanges = int(st["exchanges"])
        for name in self.COUNTERS:
            setattr(self, name, int_keys(st[name]))
        self.initial_states = {int(k): v for k, v in ckpt.blocks.items()}
        return self.next_epoch

