"""The stream task's bookkeeping (pure tier): its cursor through retrains and reruns, the
tally its pushes report, and the CPU it counts outside TensorFlow."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from sparkcnn.protocol import StreamPlan
from sparkcnn.worker.streamstate import CpuMeter, Cursor, Tally


def _plan(seq0=5, first_step=40, steps=10):
    return StreamPlan(seq0=seq0, first_step=first_step, steps=steps, h=4, expect_state=seq0 - 1,
                      lookahead=False, overlap=True, attempt=0)


def test_cursor_moves_past_pushes_and_back_to_a_push_sent_back():
    c = Cursor(_plan(), attempt=0)
    assert (c.seq, c.step, c.left, c.last_seq) == (5, 40, 10, -1)
    assert c.first_try()
    pushed = SimpleNamespace(seq=c.seq, first_step=c.step)  # the Push fields a rewind reads
    c.advance(4)
    assert (c.seq, c.step, c.left) == (6, 44, 6)
    assert c.first_try()
    c.advance(4)
    c.rewind(pushed, 10)  # exchange 5 sent back: its steps train again, as seq 5
    assert (c.seq, c.step, c.left) == (5, 40, 10)
    assert not c.first_try() and c.seq == 5  # a retrain is no first try
    c.advance(4)
    assert not c.first_try()  # seq 6 was pushed before too
    c.advance(4)
    assert c.first_try()  # seq 7 was not
    c.kept(5)
    assert c.last_seq == 5


def test_a_rerun_is_never_a_first_try():
    assert not Cursor(_plan(), attempt=1).first_try()


def test_refusals_count_in_a_row_and_a_kept_push_or_a_stale_drop_clears_them():
    c = Cursor(_plan(), attempt=0)
    assert [c.refused("malformed message") for _ in range(3)] == [1, 2, 3]
    assert c.refused("") == 0  # dropped as too stale: not a refusal
    c.refused("oversize")
    c.kept(5)
    assert c.refusals == 0


def test_tally_reports_the_last_reply_and_sums_the_stage():
    t = Tally(reset=True)
    t.waited(0.25)
    t.took(1000)
    t.pushed(64)
    assert (t.wait_s, t.down_bytes, t.reset, t.exchanges, t.samples) == (0.25, 1000, False, 1, 64)
    t.waited(0.5)
    t.pushed(32)
    assert t.wait_s == 0.5 and t.exposed == pytest.approx(0.75) and (t.exchanges, t.samples) == (2, 96)
    t.resynced(2)
    assert t.resyncs_sent == 2


def test_cpu_meter_counts_this_thread_less_tf_plus_the_push_thread():
    trainer, link = SimpleNamespace(tf_thread_s=0.0), SimpleNamespace(cpu_s=0.0)
    meter = CpuMeter(trainer, link)
    t = time.thread_time()
    while time.thread_time() - t < 0.02:  # burn 20 ms of this thread's CPU
        pass
    spent = time.thread_time() - t
    trainer.tf_thread_s, link.cpu_s = 0.005, 0.003  # 5 ms of it in TF; 3 ms on the push thread
    assert meter.overhead() == pytest.approx(spent - 0.005 + 0.003, abs=0.003)
    assert meter.overhead() == pytest.approx(0.0, abs=0.003)  # since the last call only


def test_a_dropped_exchange_puts_the_per_step_policy_back():
    """At one step per exchange the block state kept before an exchange (``BlockWork.snapshot``)
    is the policy's references; held again after a dropped push it is the state before that
    push, bitwise, so the retrained step starts from it (DESIGN §10: the residual is restored)."""
    import numpy as np

    from sparkcnn.compression.feedback import make_policy
    from sparkcnn.protocol import Reply
    from sparkcnn.worker.streamwork import BlockWork
    from sparkcnn.worker.task import TaskStart
    from tests.unit.fake_run import P, make_cfg, make_spec

    spec = make_spec(make_cfg("async", h=1, blocks=2))
    policy = make_policy(spec.method, spec.momentum_mode, spec.per_step, spec.layout, spec.value_dtype,
                         spec.dense_below, spec.momentum)
    task = TaskStart(spec, 0, "", "here", np.zeros((4, 4, 4, 1), np.uint8), np.zeros(4, np.int32), None,
                     policy, 0.0)
    start = Reply(lr=0.05, density=0.05, tau=0, retrain=False, send_state=False, refused="",
                  dense=np.zeros(P, np.float32).tobytes(), dense_version=0)
    work = BlockWork(task, start, None, 0, lookahead=False)
    rng = np.random.default_rng(2)
    for _ in range(3):
        policy.step(rng.standard_normal(P).astype(np.float32), 0.05, lr=0.05, weights=None)
    before, kept = work.snapshot(), work.state()
    policy.step(rng.standard_normal(P).astype(np.float32), 0.05, lr=0.05, weights=None)  # its push dropped
    work.hold(before)
    assert sorted(kept) == sorted(work.state()) == ["policy.momentum", "policy.velocity"]
    assert all(np.array_equal(work.state()[k].view(np.uint32), kept[k].view(np.uint32)) for k in kept)

