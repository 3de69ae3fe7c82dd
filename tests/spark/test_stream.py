"""The streaming transport: barrier tasks exchanging with the driver's parameter-server service."""

import os
import socket
import struct
import time

import numpy as np
import pytest

from sparkcnn import streamsocket
from sparkcnn.transport.service import PSService
from sparkcnn.errors import BadInput
from sparkcnn.metrics import read_jsonl
from sparkcnn.protocol import Done, Push, Reply, StreamPlan, StreamTicket
from sparkcnn.streamwire import decode, encode
from tests.native_env import compiled

def _cfg(tiny_cfg, **kw):
    """Async over the stream, H = 1, sparse both ways (uplink 0.01, downlink 0.05)."""
    opts = dict(engine__mode="async", engine__transport="stream", train__steps_per_round=1,
                compression__method="threshold", compression__density=0.01, compression__density_down=0.05)
    return tiny_cfg.replace(**{**opts, **kw})


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _reply(**kw):
    return Reply(**{**dict(lr=0.1, density=1.0, tau=0, retrain=False, send_state=False, refused="", dense=b"",
                          dense_version=0), **kw})


def _push(**kw):
    return Push(**{**dict(seq=0, first_step=0, steps=1, samples=32, base_version=0, have=0, attempt=0, lr=0.1,
                          density=1.0, loss_sum=1.0, correct=3, nnz=1, compute_s=0.01, wait_s=0.0,
                          view_bytes=0, state_reset=False, replica_resync=False, pid=1, executor="h:d",
                          payload=b"payload"), **kw})


# where a push's fields sit in its wire message (streamwire's layout): the name, then seq ..
# down_bytes (7 ints, 3 floats, 2 ints, 2 floats, an int), then the bool state_reset
PUSH_STATE_RESET_AT = 4 + 2 + len(b"Push") + struct.calcsize("<7q3d2q2dq")


def _with_byte(buf: bytes, at: int, value: int) -> bytes:
    """``buf`` with its byte ``at`` set to ``value`` (to build bad messages)."""
    return buf[:at] + bytes([value]) + buf[at + 1:]


class _Recorder:
    """A stand-in handler of the service alone (the real engine is fuzzed in tests/spark/test_exchange.py):
    each stream's session records what reaches it."""

    def __init__(self):
        self.pushes = []

    def open(self, hello):
        rec, block = self, hello["block"]

        class Session:
            start = _reply(plan=StreamPlan(seq0=0, first_step=0, steps=1, h=1, expect_state=-1, lookahead=False,
                                           overlap=True, attempt=0))

            def push(self, p):
                rec.pushes.append((block, p))
                return _reply(tau=len(rec.pushes))

            def refused(self, why):
                return _reply(retrain=True, refused=why)

        return Session()


def test_service_refuses_strangers_caps_and_rejects_bad_messages():
    rec = _Recorder()
    svc = PSService("127.0.0.1", rec, max_message_bytes=1000)
    try:
        # a wrong secret, and a peer that never proves one: refused and closed, nothing reaches the engine
        stranger = streamsocket.connect("127.0.0.1", svc.port, "not-the-token", b'{"block": 0}', 10)
        with pytest.raises((EOFError, ConnectionError)):
            stranger.read()
        stranger.close()
        silent = socket.create_connection(("127.0.0.1", svc.port), timeout=10)
        silent.sendall(b"\0" * 36)  # a frame header of length 0: nothing authentic is that short
        assert silent.recv(100)[:4] == b"SCS1" and silent.recv(100) == b""
        silent.close()
        deadline = time.monotonic() + 10
        while svc.counters["unauthenticated_refused"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert svc.counters["unauthenticated_refused"] == 2 and rec.pushes == []
        # with the secret: an oversized message and a malformed one are refused, a good one goes through
        conn = streamsocket.connect("127.0.0.1", svc.port, svc.token, b'{"block": 0}', 10)

        def answer():
            return decode(conn.read(), (Reply,))

        assert answer().plan is not None
        conn.write(b"\0" * 5000)
        assert "over the cap" in answer().refused
        conn.write(b"SCW3 garbage")
        assert answer().refused.startswith("malformed message")
        bad = _with_byte(encode(_push()), PUSH_STATE_RESET_AT, 7)
        conn.write(bad)  # a field its type cannot hold, refused by name
        assert answer().refused == "malformed message: Push.state_reset: expected a bool (0 or 1), got 7"
        conn.write(encode(_push(seq=1)))
        assert answer().tau == 1
        assert svc.counters["oversize_refused"] == 1 and svc.counters["malformed_refused"] == 2
        assert rec.pushes == [(0, _push(seq=1))]
        conn.write(encode(Done()))
        conn.close()
    finally:
        svc.close()
    assert not _listening(svc.port)


def test_worker_stops_when_the_server_is_gone(tiny_cfg):
    """A stream task whose server does not answer fails within its timeout, with a clear error."""
    from sparkcnn.worker.streamlink import Link, ServerGone

    with socket.socket() as s:  # a port that was free: nobody listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(ServerGone, match=r"parameter server .* (unreachable|stream failed|did not answer)"):
        Link(StreamTicket("127.0.0.1", port, "t", timeout_s=2.0), 0).start()
    assert time.monotonic() - t0 < 10

    import threading

    entered, release = threading.Event(), threading.Event()

    class Silent(_Recorder):
        def open(self, hello):
            entered.set()
            release.wait()  # silent until the test is done: only the task's own timeout ends the wait
            return super().open(hello)

    svc = PSService("127.0.0.1", Silent(), 1000)
    try:
        t0 = time.monotonic()
        with pytest.raises(ServerGone, match=r"did not answer within 1 s"):
            Link(StreamTicket("127.0.0.1", svc.port, svc.token, timeout_s=1.0), 0).start()
        assert entered.is_set()  # the server was reached, and had not answered
        assert time.monotonic() - t0 < 10
    finally:
        release.set()
        svc.close()


def test_stream_run_in_process(tiny_cfg, tmp_path, monkeypatch):
    """H = 1, sparse both ways: every push applied once, the listener closed, the token nowhere;
    the task froze the heap before streaming and the server during the stage (no full collection
    walks TF's objects mid-stage), and the driver's process collects as before once it is over."""
    import gc

    from sparkcnn.train import train

    monkeypatch.setattr("sparkcnn.worker.task._HEAP_FROZEN", False)
    gc.unfreeze()
    cfg = _cfg(tiny_cfg, engine__master="inprocess")
    seen = {}
    import sparkcnn.transport.pushes as pushes_mod
    import sparkcnn.transport.stream as stream_mod

    real = stream_mod.PSService

    def spy(*a, **kw):
        svc = real(*a, **kw)
        seen["svc"] = svc
        return svc

    stream_mod.PSService = spy
    frozen = []  # objects frozen whenever a push arrives
    real_push = pushes_mod.PushHandler.push
    monkeypatch.setattr(pushes_mod.PushHandler, "push",
                        lambda self, *a: frozen.append(gc.get_freeze_count()) or real_push(self, *a))
    try:
        summary = train(cfg)
    finally:
        stream_mod.PSService = real
    svc = seen["svc"]
    import sparkcnn.worker.task as task_mod

    assert task_mod._HEAP_FROZEN and frozen and min(frozen) > 0 and gc.get_freeze_count() == 0
    assert summary["transport"] == "stream" and summary["epochs"] == 2
    assert summary["test_accuracy"] > 0.6
    rounds = [r for r in read_jsonl(os.path.join(summary["run_dir"], "metrics.jsonl")) if r["kind"] == "round"]
    keys = [(r["block"], r["seq"]) for r in rounds]
    assert len(keys) == len(set(keys)) and summary["duplicates_dropped"] == 0
    assert sum(r["samples"] for r in rounds) == 2 * 2 * (600 // 32) * 32  # epochs x blocks x full batches
    assert all(r["transport"] == "stream" and r["exposed_comm_s"] >= 0 for r in rounds)
    assert summary["exposed_comm_ms_per_step"] >= 0
    # what bench/linkmodel.py reads of a stream run: its exchanges in time order, 20 slices
    from bench.accuracy import exchange_slices

    sl = exchange_slices(read_jsonl(os.path.join(summary["run_dir"], "metrics.jsonl")))
    assert [len(sl[k]) for k in ("bytes", "period_s", "server_s")] == [20] * 3
    assert min(sl["period_s"]) > 0 and min(sl["server_s"]) > 0
    assert sum(sl["bytes"]) / 20 == pytest.approx(sum(r["bytes_up"] + r["bytes_down"] for r in rounds) / len(rounds),
                                                  rel=0.05)
    # each push reports its task's CPU outside TensorFlow: its thread less its TF calls' share
    from sparkcnn.worker.trainer import _TRAINERS

    overhead = [r["task_overhead_cpu_s"] for r in rounds]
    assert min(overhead) >= 0 and sum(overhead) > 0
    assert any(t.tf_thread_s > 0 for t in _TRAINERS.values())
    assert summary["bytes_down"] < summary["dense_bytes_down"] / 5  # sparse downlink
    assert all(r["nnz_down"] > 0 for r in rounds)  # a downlink after every applied push
    assert not _listening(svc.port)
    token = svc.token.encode()
    for dirpath, _, files in os.walk(summary["run_dir"]):
        for f in files:
            with open(os.path.join(dirpath, f), "rb") as fh:
                assert token not in fh.read(), f


@pytest.mark.spark
def test_stream_on_spark_names_its_stages_and_checks_slots(spark, tiny_cfg):
    from sparkcnn.backends.spark import SparkBackend
    from sparkcnn.train import train

    cfg = _cfg(tiny_cfg, train__epochs=1, train__steps_per_round=4)
    backend = SparkBackend(spark, "t-stream")
    summary = train(cfg, backend=backend)
    assert summary["transport"] == "stream" and summary["test_accuracy"] > 0.3
    assert summary["stream"]["streams"] == 2 and summary["rounds"] > 0
    tracker = spark.sparkContext.statusTracker()
    stages = [s for j in tracker.getJobIdsForGroup("sparkcnn-t-stream") for s in tracker.getJobInfo(j).stageIds]
    names = [tracker.getStageInfo(s).name for s in stages if tracker.getStageInfo(s) is not None]
    assert f"sparkcnn {summary['run_id']} epoch 1 stream" in names, names  # the barrier stage, by name

    with pytest.raises(BadInput, match=r"^engine\.transport=stream runs one barrier task per block at once: "
                                       r"data\.num_blocks=3 exceeds the 2 task slots of this session$"):
        train(_cfg(tiny_cfg, data__num_blocks=3), backend=SparkBackend(spark, "t-stream-slots"))


def test_stream_config_is_checked():
    from sparkcnn import config

    with pytest.raises(BadInput, match=r"engine\.transport must be one of auto, jobs, stream, got 'carrier'"):
        config.load(None, ["engine.transport=carrier"])
    with pytest.raises(BadInput, match=r"unknown config key 'engine\.stream_downlink'"):
        config.load(None, ["engine.stream_downlink=round"])  # the per-round downlink went: it diverged
    with pytest.raises(BadInput, match=r"unknown config key 'engine\.stream_lookahead'"):
        config.load(None, ["engine.stream_lookahead=false"])  # without it H = 1 trained 2-9 points lower
    with pytest.raises(BadInput, match=r"^ps\.staleness=none diverges on the async stream at "
                                       r"train\.steps_per_round > 1 \(got 10\): use auto or inverse$"):
        config.load(None, ["engine.transport=stream", "engine.mode=async", "ps.staleness=none",
                           "train.steps_per_round=10"])
    assert np.isfinite(config.load(None, ["engine.stream_timeout_s=5"]).engine.stream_timeout_s)


@pytest.mark.spark
def test_sync_stream_applies_rounds_together(spark, tiny_cfg, monkeypatch):
    """BSP over the stream: one record per round with every block's push in it, nothing dropped.
    The driver's heap is frozen while it serves the stage (its tasks run in other processes),
    and unfrozen after."""
    import gc

    import sparkcnn.transport.pushes as pushes_mod
    from sparkcnn.backends.spark import SparkBackend
    from sparkcnn.train import train

    frozen = []
    real_push = pushes_mod.PushHandler.push
    monkeypatch.setattr(pushes_mod.PushHandler, "push",
                        lambda self, *a: frozen.append(gc.get_freeze_count()) or real_push(self, *a))
    cfg = _cfg(tiny_cfg, engine__mode="sync", train__steps_per_round=4)
    summary = train(cfg, backend=SparkBackend(spark, "t-stream-sync"))
    assert frozen and min(frozen) > 0 and gc.get_freeze_count() == 0
    rounds = [r for r in read_jsonl(os.path.join(summary["run_dir"], "metrics.jsonl")) if r["kind"] == "round"]
    per_stage = -(-(600 // 32) // 4)  # ceil(18 steps / H) rounds per epoch
    assert len(rounds) == 2 * per_stage and all(r["blocks"] == 2 for r in rounds)
    assert [r["seq"] for r in rounds] == list(range(2 * per_stage))
    assert summary["duplicates_dropped"] == 0 and summary["test_accuracy"] > 0.6

    with pytest.raises(BadInput, match=r"engine\.mode=sync needs every block running at once"):
        train(cfg.replace(engine__master="inprocess"))


@pytest.mark.spark
def test_stream_exactly_once_when_python_workers_die(spark, tiny_cfg):
    """Python workers killed mid-stage (chaos): Spark reruns the barrier stage, the pushes it
    had applied come back as duplicates and are dropped, each (block, seq) is applied once."""
    from sparkcnn.backends.spark import SparkBackend
    from sparkcnn.train import train

    cfg = _cfg(tiny_cfg, train__epochs=1, train__steps_per_round=3, chaos__kill_worker_probability=0.3,
               run__seed=5)
    summary = train(cfg, backend=SparkBackend(spark, "t-stream-chaos"))
    rounds = [r for r in read_jsonl(os.path.join(summary["run_dir"], "metrics.jsonl")) if r["kind"] == "round"]
    keys = [(r["block"], r["seq"]) for r in rounds]
    assert len(keys) == len(set(keys))
    assert summary["duplicates_dropped"] > 0  # the rerun stage repeated applied pushes
    assert sum(r["samples"] for r in rounds) == 2 * (600 // 32) * 32


def test_listener_closes_when_the_run_fails(tiny_cfg, monkeypatch):
    """A run that fails mid-stage leaves no listener behind."""
    import sparkcnn.transport.stream as stream_mod
    from sparkcnn.server.exchange import Exchange
    from sparkcnn.train import train

    seen = {}
    real_service = stream_mod.PSService

    def spy(*a, **kw):
        seen["svc"] = real_service(*a, **kw)
        return seen["svc"]

    calls = {"n": 0}
    real_apply = Exchange.apply

    def failing_apply(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("injected apply failure")
        return real_apply(self, *a, **kw)

    monkeypatch.setattr(stream_mod, "PSService", spy)
    monkeypatch.setattr(Exchange, "apply", failing_apply)
    with pytest.raises(RuntimeError, match="injected apply failure"):
        train(_cfg(tiny_cfg, engine__master="inprocess", train__epochs=1))
    assert calls["n"] == 5 and not _listening(seen["svc"].port)


def test_lookahead_is_bitwise_the_same_compiled_and_on_numpy():
    from sparkcnn.worker.view import Lookahead

    rng = np.random.default_rng(4)
    views = [rng.standard_normal(1000).astype(np.float32)]
    for _ in range(4):
        views.append(views[-1] + rng.standard_normal(1000).astype(np.float32) * np.float32(1e-3))

    def run():
        look, out = Lookahead(), []
        for i, (w, tau) in enumerate(zip(views, [None, 2, 3, 1, 5])):
            look.observe(w, 3 * i, tau)
            out.append(look.weights(w).copy())
        return np.stack(out).view(np.uint32)

    fast = run()
    with compiled(False):
        assert np.array_equal(run(), fast)


def test_lookahead_follows_sparse_views_in_place_bitwise():
    """Given the indices each reply moved, the lookahead updates velocity and weights there only,
    bitwise the full passes: over sparse moves (some landing where the last ones did), a tau that
    changes, stays or drops to 0, a reply that moves nothing, a dense reload, negative zeros."""
    from sparkcnn.worker.view import Lookahead

    rng = np.random.default_rng(6)
    P = 5000
    w = rng.standard_normal(P).astype(np.float32)
    w[::97] = -0.0
    steps = []  # (view, version, tau, changed or None)
    version = 0
    for i in range(40):
        w = w.copy()
        if i == 25:  # a dense reload: everything may move
            w += rng.standard_normal(P).astype(np.float32) * np.float32(1e-2)
            changed = None
        elif i % 9 == 4:
            changed = np.empty(0, np.int64)  # nothing new
        else:
            changed = np.concatenate([np.sort(rng.choice(P, 40, replace=False)) for _ in range(2)])
            w[changed] += rng.standard_normal(changed.size).astype(np.float32) * np.float32(1e-3)
            version += int(rng.integers(1, 3))
        steps.append((w, version, [None, 1, 2, 2, 0, 3][i % 6], changed))

    def run(sparse: bool):
        look, out = Lookahead(), []
        for w, v, tau, changed in steps:
            look.observe(w, v, tau, changed if sparse else None)
            out.append(look.weights(w).copy())
        return np.stack(out).view(np.uint32)

    assert np.array_equal(run(True), run(False))
    with compiled(False):
        assert np.array_equal(run(True), run(False))


def test_lookahead_extrapolates_the_view_by_the_measured_staleness():
    """Delay compensation: a push lands tau versions after its view; the task computes at the view
    moved on by tau versions of the server's measured motion (exact for steady motion)."""
    from sparkcnn.worker.view import Lookahead

    rng = np.random.default_rng(2)
    w0, v = rng.standard_normal(50).astype(np.float32), rng.standard_normal(50).astype(np.float32)
    look = Lookahead()
    look.observe(w0, 4, None)
    assert look.weights(w0) is w0  # no motion seen yet: the view itself
    w1 = w0 + 3 * v  # three versions later
    look.observe(w1, 7, 2)
    np.testing.assert_allclose(look.weights(w1), w1 + 2 * v, rtol=1e-5, atol=1e-5)
    look.observe(w1, 7, 0)  # same version again: the motion stays, tau 0 means the view
    assert look.weights(w1) is w1
    w2 = w1 + 2 * v
    look.observe(w2, 9, 3)
    np.testing.assert_allclose(look.weights(w2), w2 + 3 * v, rtol=1e-5, atol=1e-5)
    from sparkcnn.staleness import resolve_rule

    assert resolve_rule("auto", True) == "none" and resolve_rule("auto", False) == "inverse"
    assert resolve_rule("inverse", True) == "inverse" and resolve_rule("none", False) == "none"


def test_a_block_done_with_its_pass_gets_no_steps_in_the_stage(tiny_cfg):
    """As after a mid-epoch checkpoint that fell once block 0 had finished its pass: the stage
    plans no steps for it, so the epoch trains epochs x rows, not a pass more (which ran the
    schedule's lr to 0 before block 1 was done, and the server refused a scale of 0)."""
    from sparkcnn.backends.inprocess import LocalBackend
    from sparkcnn.train import build_engine

    cfg = _cfg(tiny_cfg, engine__master="inprocess", train__epochs=1, train__steps_per_round=1,
               train__lr_warmup_epochs=0.0)
    backend = LocalBackend("t-done-block")
    engine, _ = build_engine(cfg, backend, backend.run_id)
    c, steps0 = engine.server.cursors, engine.handler.pass_end[0]
    c.block_epoch[0], c.block_step[0], c.last_seq[0] = 1, 0, steps0 - 1
    c.samples_done = steps0 * cfg.train.batch_size
    summary = engine.run()
    assert c.samples_done == c.epoch_samples and c.block_epoch == {0: 1, 1: 1}
    assert engine.stage.plans[0].steps == 0 and engine.stage.plans[1].steps == engine.handler.pass_end[1]
    assert summary["epochs"] == 1


def test_a_stage_state_follows_the_last_push_and_only_the_last_applied_one_is_kept(tiny_cfg, monkeypatch):
    """No push carries the block state unless a checkpoint asks; each block's state at a stage's
    end comes as a StageState after its last push was answered, and is what the epoch's
    checkpoint holds. A state of another exchange changes nothing; a malformed one is refused."""
    from sparkcnn.transport import pushes as pushes_mod
    from sparkcnn.transport import streamcut as streamcut_mod
    from sparkcnn.protocol import StageState, StateArray
    from sparkcnn.streamwire import WireError
    from sparkcnn.train import train

    cfg = _cfg(tiny_cfg, engine__master="inprocess")
    state_on_pushes, calls, checkpoints = [], [], []
    real_push, real_state = pushes_mod.PushHandler.push, pushes_mod.PushHandler.stage_state
    real_save = streamcut_mod.Cut.save

    def push(self, session, p):
        state_on_pushes.append(len(p.state))
        return real_push(self, session, p)

    def stage_state(self, session, m, refused=""):
        if m is None:
            return real_state(self, session, m, refused)
        block = session.block
        kept = self.stage.final.get(block)
        other = real_state(self, session, StageState(m.seq - 1, m.state))  # not its last applied exchange
        unchanged = self.stage.final.get(block) is kept and not other.refused
        try:
            real_state(self, session, StageState(m.seq, (StateArray("momentum", "float32", b"\0" * 8),)))
            malformed = "kept"
        except WireError as e:
            malformed = str(e)
        reply = real_state(self, session, m)
        calls.append({"block": block, "seq": m.seq, "last_seq": self.server.cursors.last_seq[block],
                      "names": sorted(a.name for a in m.state), "unchanged": unchanged, "malformed": malformed,
                      "kept": self.stage.final.get(block)})
        return reply

    def save_checkpoint(self, t0, states, read=True):
        checkpoints.append((self.stage.epoch, dict(states)))
        return real_save(self, t0, states, read)

    monkeypatch.setattr(pushes_mod.PushHandler, "push", push)
    monkeypatch.setattr(pushes_mod.PushHandler, "stage_state", stage_state)
    monkeypatch.setattr(streamcut_mod.Cut, "save", save_checkpoint)
    summary = train(cfg)
    assert summary["epochs"] == 2 and state_on_pushes and not any(state_on_pushes)
    assert sorted((c["block"], c["seq"] == c["last_seq"]) for c in calls) == [(0, True), (0, True), (1, True),
                                                                             (1, True)]
    assert all(c["unchanged"] and "expected" in c["malformed"] for c in calls)
    assert all(c["names"] == ["policy.momentum", "policy.velocity"] for c in calls)
    assert [e for e, _ in checkpoints] == [1, 2]
    for epoch, states in checkpoints:  # what each block sent at the end of that stage
        sent = {c["block"]: c["kept"] for c in calls[2 * (epoch - 1):2 * epoch]}
        assert sorted(states) == [0, 1]
        for block, state in states.items():
            assert state is sent[block] and np.abs(state["policy.velocity"]).sum() > 0


@pytest.mark.parametrize("density_down", [0.05, 0.6])
def test_a_lagging_replica_gets_the_downlinks_it_misses_unless_a_copy_is_lighter(tiny_cfg, monkeypatch,
                                                                                   density_down):
    """A reply to a replica some versions behind (a push dropped as stale, answered ``retrain``)
    carries the retained downlinks since its version when they chain from it and weigh less than
    a dense copy of U; a replica behind the retained ones, or one whose downlinks outweigh the
    copy, gets the copy."""
    from sparkcnn.transport import pushes as pushes_mod
    from sparkcnn.train import train

    cfg = _cfg(tiny_cfg, engine__master="inprocess", compression__density_down=density_down,
               compression__density=max(0.01, density_down))  # heavy downlinks need heavy pushes
    seen = []
    real = pushes_mod.PushHandler._take

    def push_async(self, session, p):
        reply = real(self, session, p)
        dls, U = self.server.downlink.messages, self.server.ps.U
        if not seen and len(dls) >= 6:
            dense = 4 * U.size
            for back in (1, 3, len(dls)):
                have = dls[-back].base_version
                r = self._reply(session, have=have, retrain=True)
                seen.append((back, sum(len(m.payload) for m in dls[-back:]) < dense, bool(r.dense),
                             [m.version for m in r.downlinks], [m.version for m in dls[-back:]]))
            r = self._reply(session, have=dls[0].base_version - 1, retrain=True)  # not retained
            seen.append((None, None, bool(r.dense), [m.version for m in r.downlinks], []))
        return reply

    monkeypatch.setattr(pushes_mod.PushHandler, "_take", push_async)
    train(cfg)
    assert len(seen) == 4 and seen[-1][2:4] == (True, [])
    for back, lighter, dense, got, retained in seen[:3]:
        assert (dense, got) == ((False, retained) if lighter else (True, [])), (back, lighter)
    lighter = [s[1] for s in seen[:3]]
    assert all(lighter) if density_down == 0.05 else not all(lighter)  # both cases are exercised


def test_the_downlink_warm_up_starts_at_its_own_initial_density(tiny_cfg):
    """``compression.initial_density_down`` starts the downlink's density warm-up below the
    uplink's (left at 0 it follows ``initial_density``): the first downlink carries about that
    share of the model, and after the warm-up both runs send at ``density_down``."""
    from sparkcnn.train import train

    def first_and_late(**kw):
        cfg = _cfg(tiny_cfg, engine__master="inprocess", compression__dense_below=0,
                   compression__initial_density=0.5, compression__warmup_epochs=1, **kw)
        summary = train(cfg)
        rounds = [r for r in read_jsonl(os.path.join(summary["run_dir"], "metrics.jsonl")) if r["kind"] == "round"]
        first = min(rounds, key=lambda r: r["round"])
        size = first["dense_bytes"] // 4 // first["blocks"]  # the model's entries
        late = [r["nnz_down"] / size for r in rounds if r["epoch"] == 1]
        return first["nnz_down"] / size, max(late), summary["test_accuracy"]

    same, same_late, acc = first_and_late()
    own, own_late, own_acc = first_and_late(compression__initial_density_down=0.1)
    # the first push sends about half the model: the first downlink all of it, or a tenth of the model
    assert same > 0.35 and 0.05 < own < 0.15, (same, own)
    assert max(same_late, own_late) < 0.08  # density_down (0.05) after the warm-up, in both runs
    assert min(acc, own_acc) > 0.6
