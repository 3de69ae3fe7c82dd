"""The exchange core on both transports: every step applied exactly once under forced staleness,
and the real stream engine fuzzed on the wire by a client that holds the token."""

import dataclasses
import json
import os
import struct
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparkcnn import streamsocket
from sparkcnn.metrics import read_jsonl
from sparkcnn.protocol import Done, Push, Reply
from sparkcnn.streamwire import decode, encode

ROWS_PER_BLOCK = 600  # tiny_data: 1200 training rows over 2 blocks


def _rounds(summary) -> list[dict]:
    return [r for r in read_jsonl(os.path.join(summary["run_dir"], "metrics.jsonl")) if r["kind"] == "round"]


def _steps_applied(rounds: list[dict]) -> list[tuple[int, int, int]]:
    """(block, epoch of its pass, step) of every step the applied exchanges carried."""
    return [(r["block"], r["block_epoch"], r["block_step"] + i) for r in rounds for i in range(r["steps"])]


@pytest.mark.spark
@pytest.mark.parametrize("transport", ["jobs", "stream"])
def test_stale_results_are_dropped_and_their_steps_trained_again_once(spark, tiny_cfg, transport):
    """Block 0 holds every 4th result for 1.5 s (chaos.hold_every), so it lands past
    ps.max_staleness and is dropped; its steps are trained again. Every (block, epoch, step) is
    applied at most once, each block's applied steps run from its first with no gap, and the
    samples add up to epochs x rows. (The stream trains each block's epochs exactly; on the jobs
    transport a faster block may start its next pass early, DESIGN §6.)"""
    from sparkcnn.backends.spark import SparkBackend
    from sparkcnn.train import train

    # the stream raises ps.max_staleness to 4 x blocks (its own overlap): one step per exchange
    # and small batches give the other block enough pushes during a hold to pass it
    cfg = tiny_cfg.replace(engine__mode="async", engine__transport=transport, train__batch_size=16,
                           train__steps_per_round=3 if transport == "jobs" else 1,
                           ps__max_staleness=1, chaos__hold_every=4, chaos__hold_s=1.5,
                           compression__method="threshold", compression__density=0.05,
                           compression__density_down=0.05, scheduler__target_job_seconds=0.05)
    summary = train(cfg, backend=SparkBackend(spark, f"t-stale-{transport}"))
    rounds = _rounds(summary)
    steps = _steps_applied(rounds)
    per_block = ROWS_PER_BLOCK // cfg.train.batch_size
    assert summary["stale_dropped"] > 0
    assert len(steps) == len(set(steps))  # no step applied twice
    for k in (0, 1):  # and none lost: a block's steps are the first n of its sequence
        mine = sorted(e * per_block + s for b, e, s in steps if b == k)
        assert mine == list(range(len(mine))), k
    assert len(steps) == cfg.train.epochs * 2 * per_block
    assert sum(r["samples"] for r in rounds) == cfg.train.epochs * 2 * per_block * cfg.train.batch_size
    assert summary["test_accuracy"] > 0.5


# -- the wire, fuzzed against the real engine ------------------------------------------------------
_GOOD = Push(seq=0, first_step=0, steps=1, samples=32, base_version=0, have=0, attempt=0, lr=0.05, density=0.05,
             loss_sum=1.0, correct=3, nnz=1, compute_s=0.01, wait_s=0.0, view_bytes=0, state_reset=False,
             replica_resync=False, pid=1, executor="fuzz:d", payload=b"x")
# where _GOOD's fields sit in its wire message (streamwire's layout): the name, seq .. down_bytes
# (7 ints, 3 floats, 2 ints, 2 floats, an int), the bools state_reset and resync, pid, executor
# (u32 length + text), payload (u64 length + bytes), then the u32 count of state
_BOOLS_AT = 4 + 2 + len(b"Push") + struct.calcsize("<7q3d2q2dq")
_STATE_COUNT_AT = _BOOLS_AT + 2 + 8 + 4 + len(_GOOD.executor) + 8 + len(_GOOD.payload)


@st.composite
def bad_messages(draw) -> bytes:
    """A message the engine must refuse: broken framing, a type it does not take, a push cut
    short or with bytes after it, a bool or a count its bytes cannot be, or a well-formed push
    its plan cannot hold (with a garbage payload)."""
    kind = draw(st.sampled_from(["bytes", "type", "truncated", "trailing", "bool", "count", "plan"]))
    good = encode(_GOOD)
    if kind == "bytes":
        return draw(st.binary(min_size=1, max_size=80))
    if kind == "type":
        other = draw(st.sampled_from([Reply(lr=0.1, density=1.0, tau=0, retrain=False, send_state=False, refused="",
                                            dense=b"", dense_version=0), _GOOD]))
        buf = encode(other)
        return buf if other is not _GOOD else buf.replace(b"Push", b"Pash", 1)
    if kind == "truncated":
        return good[:draw(st.integers(1, len(good) - 1))]
    if kind == "trailing":
        return good + draw(st.binary(min_size=1, max_size=8))
    if kind == "bool":
        at = _BOOLS_AT + draw(st.integers(0, 1))
        return good[:at] + bytes([draw(st.integers(2, 255))]) + good[at + 1:]
    if kind == "count":
        return good[:_STATE_COUNT_AT] + struct.pack("<I", draw(st.integers(1, 2**32 - 1))) + good[_STATE_COUNT_AT + 4:]
    # well formed, but no plan holds it: an exchange far ahead, or steps beyond H
    seq = draw(st.integers(10**6, 10**9))
    steps = draw(st.integers(-5, 100))
    return encode(dataclasses.replace(_GOOD, seq=seq, steps=steps, payload=draw(st.binary(max_size=64))))


def _fuzz(svc, engine, messages: list[bytes], out: dict) -> None:
    """A client holding the token: opens a stream for block 0 once the stage is planned and
    sends every message, reading each reply (an exception is kept for the test to show)."""
    try:
        _send_all(svc, engine, messages, out)
    except Exception as e:  # noqa: BLE001
        out["error"] = repr(e)


def _send_all(svc, engine, messages: list[bytes], out: dict) -> None:
    import time

    deadline = time.monotonic() + 120
    while not engine.stage.plans and time.monotonic() < deadline:
        time.sleep(0.01)
    conn = streamsocket.connect(svc.host, svc.port, svc.token, b'{"block": 0}', 60)
    decode(conn.read(), (Reply,))  # the start
    for m in messages:
        conn.write(m)
        reply = decode(conn.read(), (Reply,))
        out.setdefault("refused", []).append(reply.refused)
    conn.write(encode(Done()))
    conn.close()


@pytest.mark.spark
@settings(max_examples=1, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(messages=st.lists(bad_messages(), min_size=40, max_size=40))
def test_malformed_pushes_are_refused_counted_and_the_run_goes_on(spark, tiny_cfg, messages):
    """During a real stream run on local Spark, a client holding the token sends 40 bad
    messages: each is refused and counted, none reaches W, and the run ends within 1 point of
    the same run without it."""
    import sparkcnn.transport.stream as stream_mod
    from sparkcnn.backends.spark import SparkBackend
    from sparkcnn.train import train

    cfg = tiny_cfg.replace(engine__mode="sync", engine__transport="stream", train__steps_per_round=2,
                           compression__method="threshold", compression__density=0.05,
                           compression__density_down=0.05)
    clean = train(cfg, backend=SparkBackend(spark, "t-fuzz-clean"))

    real, out, threads = stream_mod.PSService, {}, []

    def spy(host, handler, cap):
        svc = real(host, handler, cap)
        threads.append(threading.Thread(target=_fuzz, args=(svc, handler, messages, out), daemon=True))
        threads[-1].start()
        return svc

    stream_mod.PSService = spy
    try:
        fuzzed = train(cfg, backend=SparkBackend(spark, "t-fuzz"))
    finally:
        stream_mod.PSService = real
    threads[0].join(60)
    assert "error" not in out, out["error"]
    assert len(out["refused"]) == len(messages) and all(out["refused"])  # every one refused, with a reason
    refusals = fuzzed["stream"]["malformed_refused"] + fuzzed["rejected_deltas"]
    assert refusals == len(messages) and clean["rejected_deltas"] == 0
    assert fuzzed["epochs"] == clean["epochs"] == cfg.train.epochs
    assert abs(fuzzed["test_accuracy"] - clean["test_accuracy"]) <= 0.01
    assert sum(r["samples"] for r in _rounds(fuzzed)) == sum(r["samples"] for r in _rounds(clean))


# -- a driver killed mid-epoch resumes from its last checkpoint ------------------------------------
@pytest.mark.spark
def test_stream_resumes_mid_epoch_after_driver_sigkill(tiny_data, tmp_path):
    """Sync, H = 10 (async H = 1: tests/spark/test_connect.py, the same engine over Connect, and
    tests/spark/test_stream_shards.py; async H = 10: bench/killresume.py). Checkpoints every 2 exchanges (capped by the 2 % time floor) and at epoch ends; the driver
    is SIGKILLed two exchanges before the end of the last epoch, after at least 3 checkpoints.
    ``--resume`` keeps the records its last checkpoint covers as they were, records no
    exchange twice, and completes every epoch with every step once."""
    import glob
    import re
    import subprocess
    import sys

    def cli(args):
        return subprocess.run([sys.executable, "-m", "sparkcnn", *args], capture_output=True, text=True,
                              env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"), timeout=900)

    epochs, batch, per_block, h = 3, 24, ROWS_PER_BLOCK // 24, 10
    per_epoch = -(-per_block // h)  # exchanges (BSP rounds) per epoch
    common = ["-v", "train", "--no-progress", "--set", f"data.path={tiny_data}", "--set", "engine.master=local[2]",
              "--set", "engine.mode=sync", "--set", "engine.transport=stream", "--set", f"train.epochs={epochs}",
              "--set", f"train.batch_size={batch}", "--set", f"train.steps_per_round={h}",
              "--set", "train.lr_warmup_epochs=0", "--set", "checkpoint.every_rounds=2",
              "--set", "compression.method=threshold", "--set", "compression.density=0.05",
              "--set", "compression.density_down=0.05", "--set", f"run.out_dir={tmp_path / 'runs'}"]
    kill = epochs * per_epoch - 3  # the round index of the third-to-last exchange: mid last epoch
    killed = cli([*common, "--set", f"chaos.kill_driver_round={kill}"])
    assert killed.returncode == -9, killed.stderr[-3000:]
    saved = re.findall(r"checkpoint \S+ saved", killed.stderr)
    assert len(saved) >= 3, killed.stderr[-3000:]
    (run_dir,) = glob.glob(str(tmp_path / "runs" / "*"))
    before = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    latest = open(os.path.join(run_dir, "checkpoints", "LATEST")).read().strip()
    with open(os.path.join(run_dir, "checkpoints", latest, "state.json")) as f:
        covered = json.load(f)["records"]
    assert 0 < covered < len(before)  # the kill fell after the last checkpoint, mid-epoch
    resumed = cli(["train", "--no-progress", "--resume", run_dir, "--set", "chaos.kill_driver_round=-1"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert after[:covered] == before[:covered]  # what the checkpoint covers stays as it was
    rounds = [r for r in after if r["kind"] == "round"]
    assert [r["round"] for r in rounds] == list(range(len(rounds)))  # no exchange recorded twice
    assert [r["epoch"] for r in after if r["kind"] == "epoch"] == list(range(epochs))
    assert sum(r["samples"] for r in rounds) == epochs * 2 * per_block * batch
