"""The stream's wire fuzzed against the real service path, without Spark or TensorFlow.

Each example builds the stream engine's server side as ``StreamEngine.__init__`` does (a real
``Run``, ``Stage``, ``Cut`` and ``PushHandler``, the fake backend of tests/unit/fake_run.py)
and feeds one block's stream through ``PSService.serve_stream``, the code every stream's
connection runs (the listener itself is started once for the module, and one test below
goes through it with a client holding the run's secret). The messages: random bytes, empty
ones, truncated, bit-flipped and trailing-byte copies of a valid push or end-of-stage state,
types the stream does not take, messages over the size cap, pushes with one field its plan
cannot hold, duplicates, stale pushes (ASGD), pushes whose payload does not decode, and valid
next pushes; then a genuine push, which must still be applied.

Every message is checked against an oracle written from the documented rules (DESIGN §10,
transport/pushes.py and service.py): a message is refused (a non-empty ``Reply.refused``,
counted by the service) unless it is a well-formed ``Push`` or ``StageState`` its plan
holds; nothing but a valid next push moves W, the version or the cursors; and the service
path raises nothing (a WireError is the service's to catch, anything else fails the stream).
A valid next push whose payload the codec refuses is taken as its exchange, as server/apply.py
takes a delta the guard rejects: its cursor moves, W and the version do not, rejected_deltas
counts it, and its reply refuses nothing.

Sync: with 2 blocks, the other block's push of each round is held (on a thread, as the
handler's condition makes its reply wait) before each message of the fuzzed stream, so a
valid push completes the round and a refused one leaves it held.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from sparkcnn import streamsocket
from sparkcnn.protocol import Done, Push, Reply, StageState, StateArray
from sparkcnn.server.run import RunShape
from sparkcnn.streamwire import WireError, decode, encode
from sparkcnn.transport.pushes import PushHandler
from sparkcnn.transport.service import PSService
from sparkcnn.transport.stage import Stage
from sparkcnn.transport.streamcut import Cut
from tests.unit.fake_run import (BATCH, LOSS, P, FakeBackend, apply_expected, decodes, initial_weights,
                                 make_cfg, make_run, make_spec, payloads, server_scale, staleness_lambda)

CAP = 16 * 1024  # engine.max_message_bytes of these runs: a dense float16 payload and a state fit
PASS = 100       # steps in a block's pass: no fuzzed stage ends (a push past it: the test below)
FIELDS = ("seq", "first_step", "steps", "samples", "base_version", "lr", "density", "state", "sumsq")
KINDS = ("valid", "stale", "duplicate", "payload", "bytes", "empty", "truncated", "flipped", "trailing",
         "type", "state", "oversize", *(f"field.{f}" for f in FIELDS))  # field.x: a push with a wrong x


class Dispatch:
    """The module's service handler: each example's PushHandler in turn."""

    def __init__(self):
        self.handler: PushHandler | None = None
        self.session = None

    def open(self, hello: dict):
        self.session = self.handler.open(hello)
        return self.session


@pytest.fixture(scope="module")
def service():
    dispatch = Dispatch()
    svc = PSService("127.0.0.1", dispatch, CAP)
    yield svc, dispatch
    svc.close()


class Writer:
    """The replies the service writes, decoded (the first: the stream's start)."""

    def __init__(self):
        self.replies: list[Reply] = []

    def write(self, buf) -> None:
        self.replies.append(decode(buf, (Reply,)))


class Reader:
    """Messages from ``next_message()`` until it returns ``...`` (then the stream ends), as
    :meth:`sparkcnn.streamsocket.Conn.read` gives them: one over the cap as its length alone."""

    def __init__(self, next_message):
        self.next_message = next_message

    def read(self):
        md = self.next_message()
        if md is ...:
            raise EOFError
        md = md or b""
        return len(md) if len(md) > CAP else md


def serve(svc, block: int, messages) -> list[Reply]:
    """One stream of ``block`` through the service path; its replies (the start's first)."""
    it, writer = iter(messages), Writer()
    svc.serve_stream(json.dumps({"block": block}).encode(), Reader(lambda: next(it, ...)), writer)
    return writer.replies


def state_array(name: str = "momentum", *, dtype: str = "float32", n: int = P) -> StateArray:
    return StateArray(name=name, dtype=dtype, data=np.zeros(n, np.dtype(dtype)).tobytes())


class Stream:
    """One example: the server side of a stream engine, block 0's fuzzed stream, and (sync with
    2 blocks) block 1's push of each round, held."""

    def __init__(self, svc, dispatch, *, mode: str, blocks: int, h: int, max_staleness: int, seed: int):
        self.svc, self.mode, self.blocks, self.h = svc, mode, blocks, h
        self.cfg = make_cfg(mode, h=h, blocks=blocks, max_staleness=max_staleness, density_down=0.1,
                            extra=("engine.transport=stream", "engine.stream_timeout_s=20"))
        spec = make_spec(self.cfg)
        self.backend = FakeBackend()
        pass_end = {k: PASS for k in range(blocks)}
        overlap = h == 1
        self.run = make_run(self.cfg, spec, initial_weights(seed),
                            RunShape(pass_end, bsp=mode == "sync", compensated=overlap,
                                     downlink_every=-(-blocks // 2), keep_broadcasts=2,
                                     inline_downlinks=4 * blocks + 4), self.backend)
        stage = Stage(h, lookahead=overlap, overlap=overlap)
        cut = Cut(self.run, stage, self.backend, spec, list(range(blocks)), self.cfg.engine.stream_timeout_s)
        self.handler = PushHandler(self.cfg, spec, self.run, stage, cut, self.backend, pass_end)
        self.handler.plan_stage()
        dispatch.handler = self.handler
        self.rng = random.Random(seed)
        self.pool = payloads(spec.value_dtype)
        self.offered: tuple[float, float] | None = None  # the (lr, density) the start reply offered
        self.partner = self.handler.open({"block": 1}) if mode == "sync" and blocks == 2 else None
        self.partner_push: Push | None = None
        self.partner_thread: threading.Thread | None = None
        self.partner_out: list = []
        self.seen = {"applied": 0, "refused": 0, "duplicate": 0, "retrain": 0, "rejected": 0, "kept": 0}

    # -- what the run is at -------------------------------------------------------------------------
    def snapshot(self) -> dict:
        run, c = self.run, self.run.cursors
        return dict(W=run.W.copy(), version=run.version, exchanges=run.exchange.exchanges,
                    last=dict(c.last_seq), epoch=dict(c.block_epoch), step=dict(c.block_step),
                    samples=c.samples_done, counters=run.counters.as_dict(), service=dict(self.svc.counters))

    def cursor(self, s: dict, k: int = 0) -> int:
        return s["epoch"][k] * PASS + s["step"][k]

    # -- messages -----------------------------------------------------------------------------------
    def next_push(self, s: dict, *, block: int = 0, steps: int | None = None, base: int | None = None,
                  state: tuple = ()) -> Push:
        """The valid next push of ``block`` at snapshot ``s``."""
        steps = steps or self.rng.randint(1, min(self.h, PASS - s["step"][block]))
        lr, density = self.offered
        return Push(seq=s["last"][block] + 1, first_step=self.cursor(s, block), steps=steps,
                    samples=steps * BATCH, base_version=s["version"] if base is None else base,
                    have=self.rng.choice([-1, s["version"]]), attempt=0, lr=lr, density=density,
                    loss_sum=LOSS * steps * BATCH, correct=self.rng.randint(0, steps * BATCH), nnz=1,
                    compute_s=0.01, wait_s=0.0, view_bytes=0, state_reset=False, replica_resync=False, pid=1,
                    executor="fuzz:0", payload=self.rng.choice(self.pool), state=state)

    def wrong(self, p: Push, s: dict, f: str) -> Push:
        """``p`` with a value of field ``f`` its plan cannot hold."""
        r = self.rng
        left = min(self.h, PASS - s["step"][0])
        bad = {"seq": lambda: p.seq + r.choice([1, 2, 10**6, 2**62]),
               "first_step": lambda: p.first_step + r.choice([-1, 1, 5, -(10**9), 2**62]),
               "steps": lambda: r.choice([0, -1, left + 1, left + 7, 2**40]),
               "samples": lambda: p.samples + r.choice([-1, 1, BATCH, -p.samples, 2**50]),
               "base_version": lambda: r.choice([-1, -(2**40), s["version"] + 1, s["version"] + 10**6]),
               "lr": lambda: r.choice([p.lr * 2, p.lr + 1e-12, -p.lr, 0.0, math.nan, math.inf]),
               "density": lambda: r.choice([p.density / 2, 1.0, math.nan, -1.0]),
               "state": lambda: (state_array(dtype=r.choice(["float64", "int64", "float16"])),)
                                if r.random() < 0.5 else (state_array(n=r.choice([0, 1, P - 1, P + 1])),),
               "sumsq": lambda: (1.0,) * r.randint(1, 3)}[f]()
        if f == "steps" and r.random() < 0.7:  # samples to match: only the steps are wrong
            return dataclasses.replace(p, steps=bad, samples=bad * BATCH)
        return dataclasses.replace(p, **{f: bad})

    def flip(self, buf: bytes) -> bytes:
        b = bytearray(buf)
        for _ in range(self.rng.randint(1, 3)):
            i = self.rng.randrange(len(b) * 8)
            b[i // 8] ^= 1 << (i % 8)
        try:
            m = decode(bytes(b), (Push, StageState, Done))
        except WireError:
            return bytes(b)
        # flips that change the training loss are not kept: a non-finite loss stops the run (the
        # guard, by design) and another may be judged a spike or a loss at chance level
        if isinstance(m, Push) and m.loss_sum != decode(buf, (Push, StageState)).loss_sum:
            return buf
        return bytes(b)

    def message(self, kind: str, s: dict) -> bytes | None:
        r = self.rng
        good = self.next_push(s, state=(state_array(),) if r.random() < 0.2 else ())
        if kind == "valid":
            return encode(good)
        if kind == "stale":  # ASGD: dropped past ps.max_staleness (mostly); BSP: a round from older weights
            past = s["version"] - self.cfg.ps.max_staleness - 1
            base = r.randint(0, past) if past >= 0 and r.random() < 0.7 else r.randint(0, s["version"])
            return encode(dataclasses.replace(good, base_version=base))
        if kind.startswith("field."):
            return encode(self.wrong(good, s, kind[len("field."):]))
        if kind == "duplicate":  # a rerun stage's push of an applied exchange: whatever its other fields
            bad = self.wrong(good, s, r.choice(FIELDS))
            return encode(dataclasses.replace(bad, seq=r.randint(-3, s["last"][0])))
        if kind == "payload":
            p = good.payload
            junk = r.choice([r.randbytes(r.randint(0, 64)), p[:r.randint(0, len(p) - 1)], self.flip(p)])
            return encode(dataclasses.replace(good, payload=junk))
        if kind == "bytes":
            head = r.choice([b"", b"SCW3", b"SCW3\x04\x00Push"])
            return head + r.randbytes(r.randint(0, 300))
        if kind == "empty":
            return None
        end = StageState(seq=s["last"][0], state=(state_array(),))
        base = encode(good) if r.random() < 0.7 else encode(end)
        if kind == "truncated":
            return base[:r.randrange(len(base))]
        if kind == "flipped":
            return self.flip(base)
        if kind == "trailing":
            return base + r.randbytes(r.randint(1, 9))
        if kind == "type":
            reply = Reply(lr=0.1, density=1.0, tau=0, retrain=False, send_state=False, refused="", dense=b"",
                          dense_version=0)
            renamed = base.replace(b"Push", b"Pash", 1).replace(b"StageState", b"StageStatf", 1)
            return r.choice([encode(reply), renamed])
        if kind == "state":
            arrays = r.choice([(), (state_array(),), (state_array(dtype="float64"),), (state_array(n=3),)])
            return encode(StageState(seq=r.randint(-1, s["last"][0] + 2), state=arrays))
        assert kind == "oversize"  # refused unread: even a valid push
        return encode(dataclasses.replace(good, payload=good.payload + b"\0" * CAP))

    # -- the rules: what a message must do -----------------------------------------------------------
    def expect(self, md: bytes | None, s: dict) -> tuple[str, object, bool]:
        """(what it must do, a detail, whether the reply says retrain): ("refused", the service's
        counter) | ("kept", None) | ("duplicate", None) | ("retrain", None) | ("applied", the push)."""
        if md is not None and len(md) > CAP:
            return "refused", "oversize_refused", True
        try:
            m = decode(md or b"", (Push, StageState))
        except WireError:
            return "refused", "malformed_refused", True
        ok_state = all(a.dtype == "float32" and len(a.data) == 4 * P for a in m.state)
        if isinstance(m, StageState):  # answered, not an exchange: no retrain either way
            return ("kept", None, False) if ok_state else ("refused", "malformed_refused", False)
        if m.seq <= s["last"][0]:
            return "duplicate", None, False
        valid = (m.seq == s["last"][0] + 1 and m.first_step == self.cursor(s)
                 and 1 <= m.steps <= min(self.h, PASS - s["step"][0]) and m.samples == m.steps * BATCH
                 and 0 <= m.base_version <= s["version"] and (m.lr, m.density) == self.offered
                 and ok_state and not m.sumsq)
        if not valid:
            return "refused", "malformed_refused", True
        if self.mode == "async" and s["version"] - m.base_version > self.cfg.ps.max_staleness:
            return "retrain", None, True
        return "applied", m, False

    def check(self, want: tuple, s: dict, reply: Reply) -> None:
        kind, what, retrain = want
        now = self.snapshot()
        counters, service = dict(s["counters"]), dict(s["service"])
        assert (reply.lr, reply.density) == self.offered
        assert bool(reply.refused) == (kind == "refused"), (kind, reply.refused)
        assert reply.retrain == retrain, kind
        if kind == "refused":
            service[what] += 1
        if kind == "duplicate":
            counters["duplicates_dropped"] += 1
        if kind == "retrain":
            counters["stale_dropped"] += 1
        state = ("version", "exchanges", "last", "epoch", "step", "samples")
        if kind != "applied":
            assert np.array_equal(now["W"], s["W"]), f"a {kind} message moved W"
            assert {k: now[k] for k in state} == {k: s[k] for k in state}, f"a {kind} message moved the run"
        else:
            self.check_applied(what, s, now, counters)
        assert now["counters"] == counters, kind
        assert now["service"] == service, kind
        self.seen["rejected" if kind == "applied" and not decodes(what.payload) else kind] += 1

    def check_applied(self, p: Push, s: dict, now: dict, counters: dict) -> None:
        """``p`` applied: alone (ASGD, or BSP of one block) or with block 1's held push."""
        held = []
        if self.partner is not None:
            self.partner_thread.join(20)
            assert not self.partner_thread.is_alive(), "the held push of block 1 was not answered"
            (got,) = self.partner_out
            assert isinstance(got, Reply) and got.refused == "", got
            held = [self.partner_push]
            self.partner_thread, self.partner_out = None, []
        pushes = held + [p]
        good = [q for q in pushes if decodes(q.payload)]
        counters["rejected_deltas"] += len(pushes) - len(good)
        for q in pushes:  # what the task said of its state and replica (a flipped bool says otherwise)
            counters["state_resets"] += q.state_reset
            counters["replica_resyncs"] += q.replica_resync
        if self.mode == "async":
            tau = s["version"] - p.base_version
            w = staleness_lambda(tau, "inverse") / self.blocks * server_scale(self.h, p.lr)
            terms = [(w, q.payload) for q in good]
        else:
            total = sum(q.samples for q in good)
            terms = [(server_scale(self.h, pushes[0].lr) * q.samples / total, q.payload) for q in good]
        np.testing.assert_allclose(now["W"], apply_expected(s["W"], terms), rtol=1e-5, atol=1e-6)
        assert now["version"] == s["version"] + bool(good)
        assert now["exchanges"] == s["exchanges"] + 1
        for k, q in zip((1, 0) if held else (0,), pushes):  # held: block 1's push came first
            assert now["last"][k] == q.seq and self.cursor(now, k) == self.cursor(s, k) + q.steps
        assert now["samples"] == s["samples"] + sum(q.samples for q in pushes)

    # -- block 1's push of the round, held (sync with 2 blocks) ---------------------------------------
    def hold_partner(self) -> None:
        if self.partner is None or self.partner_thread is not None:
            return
        s = self.snapshot()
        self.partner_push = dataclasses.replace(self.next_push(s, block=1, steps=1), executor="fuzz:1")

        def push():
            try:
                self.partner_out.append(self.partner.push(self.partner_push))
            except BaseException as e:  # noqa: BLE001 - shown by check_applied
                self.partner_out.append(e)

        self.partner_thread = threading.Thread(target=push, daemon=True)
        self.partner_thread.start()
        deadline = time.monotonic() + 20
        while True:
            with self.handler.lock:
                if 1 in self.run.exchange.held.get(self.partner_push.seq, {}) or self.partner_out:
                    break
            assert time.monotonic() < deadline, "block 1's push was not held"
            time.sleep(0.0005)
        assert not self.partner_out, self.partner_out

    def release(self) -> None:
        """A failed example: wake a held push so that its thread ends."""
        if self.partner_thread is not None:
            with self.handler.lock:
                self.handler.failure = RuntimeError("the example is over")
                self.handler.cond.notify_all()
            self.partner_thread.join(5)

    # -- one example --------------------------------------------------------------------------------
    def fuzz(self, kinds: list[str]) -> None:
        writer, todo, last = Writer(), list(kinds) + ["genuine"], {}

        def next_message():
            if self.offered is None:  # the start reply came first
                start = writer.replies[0]
                assert start.plan is not None and start.plan.steps == PASS and start.refused == ""
                self.offered = (start.lr, start.density)
            if last:
                self.check(last["want"], last["s"], writer.replies[-1])
                if last["kind"] == "genuine":
                    assert last["want"][0] == "applied" and decodes(last["want"][1].payload)
            if not todo:
                return ...
            kind = todo.pop(0)
            self.hold_partner()
            s = self.snapshot()
            if kind == "genuine":  # a fresh valid push: applied, whatever came before
                md = encode(self.next_push(s, steps=1))
            else:
                md = self.message(kind, s)
            last.update(kind=kind, want=self.expect(md, s), s=s)
            return md

        self.svc.serve_stream(b'{"block": 0}', Reader(next_message), writer)
        assert len(writer.replies) == len(kinds) + 2
        assert self.handler.failure is None and not self.backend.stopped


@pytest.mark.parametrize("mode", ["async", "sync"])
@settings(max_examples=200, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(blocks=st.integers(1, 2), h=st.integers(1, 3), max_staleness=st.sampled_from([1, 1000]),
       warm=st.sampled_from([0, 3, 12, 24]), kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=24),
       seed=st.integers(0, 2**32 - 1))
def test_fuzzed_messages_are_refused_or_taken_by_the_rules_and_a_valid_push_still_applies(
        service, mode, blocks, h, max_staleness, warm, kinds, seed):
    """``warm`` valid pushes first, so that stale base versions exist (the async stream raises
    ps.max_staleness to 4 x blocks); ``max_staleness`` 1000 rules drops out."""
    svc, dispatch = service
    stream = Stream(svc, dispatch, mode=mode, blocks=blocks, h=h, max_staleness=max_staleness, seed=seed)
    try:
        stream.fuzz(["valid"] * warm + kinds)
    finally:
        stream.release()
    for name, n in stream.seen.items():  # --hypothesis-show-statistics: what the examples hit
        event(f"{name}: {'some' if n else 'none'}")


def test_over_the_socket_a_token_holder_s_garbage_is_refused_and_a_valid_push_applied(service):
    """The same path through the listener: a client with the run's secret opens block 0's
    stream, sends an empty message, garbage, a push its plan cannot hold and a valid push;
    without the secret it is refused before any handler runs."""
    svc, dispatch = service
    stream = Stream(svc, dispatch, mode="async", blocks=1, h=1, max_staleness=1000, seed=3)
    counted = dict(svc.counters)
    stranger = streamsocket.connect(svc.host, svc.port, "not-the-secret", b'{"block": 0}', 20)
    with pytest.raises((EOFError, ConnectionError)):
        stranger.read()
    stranger.close()
    conn = streamsocket.connect(svc.host, svc.port, svc.token, b'{"block": 0}', 20)
    try:
        start = decode(conn.read(), (Reply,))
        stream.offered = (start.lr, start.density)
        s = stream.snapshot()
        push = stream.next_push(s, steps=1)
        replies = []
        for md in (b"", b"\x00garbage", encode(dataclasses.replace(push, seq=7)), encode(push)):
            conn.write(md)
            replies.append(decode(conn.read(), (Reply,)))
        conn.write(encode(Done()))
    finally:
        conn.close()
    assert [bool(r.refused) for r in replies] == [True, True, True, False]
    deadline = time.monotonic() + 10
    while svc.counters["unauthenticated_refused"] == counted["unauthenticated_refused"] and \
            time.monotonic() < deadline:
        time.sleep(0.01)  # the stranger's refusal is counted by its connection's thread
    assert {k: svc.counters[k] - counted[k] for k in ("unauthenticated_refused", "malformed_refused")} == \
           {"unauthenticated_refused": 1, "malformed_refused": 3}
    now = stream.snapshot()
    assert (now["version"], now["last"][0], stream.cursor(now)) == (1, 0, 1)
    np.testing.assert_allclose(now["W"], apply_expected(s["W"], [(server_scale(1, push.lr), push.payload)]),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_push_past_the_stage_plan_is_refused(service, mode):
    """A stage plans 2 steps of block 0 (its pass); both are applied, then a push of step 2: the
    plan holds no such push, so it is refused and the run does not move."""
    svc, dispatch = service
    cfg = make_cfg(mode, h=1, blocks=1, epochs=2, extra=("engine.transport=stream",))
    spec, backend = make_spec(cfg), FakeBackend()
    run = make_run(cfg, spec, initial_weights(0), RunShape({0: 2}, bsp=mode == "sync", compensated=True),
                   backend)
    stage = Stage(1, lookahead=True, overlap=True)
    handler = PushHandler(cfg, spec, run, stage, Cut(run, stage, backend, spec, [0], 20), backend, {0: 2})
    handler.plan_stage()
    dispatch.handler = handler
    pool = payloads(spec.value_dtype)
    lr, density = run.schedule_now()

    def push(k: int) -> bytes:
        return encode(Push(seq=k, first_step=k, steps=1, samples=BATCH, base_version=k, have=-1, attempt=0,
                           lr=lr, density=density, loss_sum=LOSS * BATCH, correct=0, nnz=1, compute_s=0.01,
                           wait_s=0.0, view_bytes=0, state_reset=False, replica_resync=False, pid=1,
                           executor="fuzz:0", payload=pool[k]))

    start, *replies = serve(svc, 0, [push(0), push(1), push(2)])
    assert start.plan.steps == 2 and [r.refused for r in replies[:2]] == ["", ""]
    assert stage.done(run.cursors, 0)
    assert replies[2].refused and (run.version, run.cursors.cursor(0)) == (2, 2)
