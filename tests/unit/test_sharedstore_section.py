"""One push, one record lock: a server over the shared store (ps.servers > 1) takes the store's
critical section once per push, from its apply to its reply's weights, where each write used to
enter it on its own; and the pushes it serves come out as they do from a server of its own
memory: the same weights, versions, records and replies."""

from __future__ import annotations

import fcntl

import numpy as np
import pytest

from sparkcnn.protocol import Push
from sparkcnn.server.run import Run, RunShape
from sparkcnn.server.sharedstore import SharedStore
from sparkcnn.transport.pushes import PushHandler
from sparkcnn.transport.stage import Stage
from sparkcnn.transport.streamcut import Cut
from tests.unit.fake_run import BATCH, LOSS, FakeBackend, initial_weights, make_cfg, make_spec, payloads

BLOCKS, PUSHES = 3, 8


class Counted:
    """fcntl.lockf, counting the exclusive locks taken."""

    def __init__(self, lockf):
        self.lockf, self.taken = lockf, 0

    def __call__(self, fd, cmd, *args):
        self.taken += cmd == fcntl.LOCK_EX
        return self.lockf(fd, cmd, *args)


def _handler(store):
    cfg = make_cfg("async", h=1, blocks=BLOCKS, density_down=0.1, max_staleness=2,
                   extra=("engine.transport=stream", "engine.stream_timeout_s=20"))
    spec, backend, passes = make_spec(cfg), FakeBackend(), {b: PUSHES for b in range(BLOCKS)}
    shape = RunShape(passes, bsp=False, compensated=True, downlink_every=2, inline_downlinks=32)
    run = Run(cfg, spec, store.W if store is not None else initial_weights(4), shape, backend=backend,
              evaluate=None, shared=store)
    stage = Stage(1, lookahead=True, overlap=True)
    handler = PushHandler(cfg, spec, run, stage, Cut(run, stage, backend, spec, list(passes), 20), backend,
                          passes)
    handler.plan_stage()
    return run, handler


def _push(seq: int, first_step: int, reply, have: int, payload: bytes) -> Push:
    return Push(seq=seq, first_step=first_step, steps=1, samples=BATCH, base_version=reply.dense_version,
                have=have, attempt=0, lr=reply.lr, density=reply.density, loss_sum=LOSS * BATCH, correct=3,
                nnz=1, compute_s=0.01, wait_s=0.0, view_bytes=0, state_reset=False, replica_resync=False,
                pid=1, executor="t:0", payload=payload)


def _serve(handler, run, lockf: Counted | None) -> list[tuple]:
    """Every block's pushes in turn, with a stale one (dropped, pushed again) and a duplicate;
    what each reply said, and the record locks each push took."""
    sessions = {b: handler.open({"block": b}) for b in range(BLOCKS)}
    last = {b: s.start for b, s in sessions.items()}
    have = {b: -1 for b in range(BLOCKS)}
    pool, out = payloads("float16"), []
    for i in range(BLOCKS * (PUSHES + 1)):
        b = i % BLOCKS
        seq = run.cursors.last_seq[b] + 1
        if seq >= PUSHES:
            continue
        p = _push(seq, run.cursors.cursor(b), last[b], have[b], pool[i % len(pool)])
        if i == 20:  # based on version 0: staleness past ps.max_staleness (4 N on the stream), dropped
            p = _push(seq, run.cursors.cursor(b), sessions[b].start, have[b], pool[i % len(pool)])
        before = lockf.taken if lockf else 0
        reply = sessions[b].push(p)
        if i == 10:  # the same push again: a duplicate
            reply = sessions[b].push(p)
        out.append((b, seq, reply.retrain, reply.dense_version, len(reply.dense),
                    tuple(m.version for m in reply.downlinks), (lockf.taken - before) if lockf else None))
        last[b], have[b] = reply, reply.dense_version
    return out


@pytest.fixture()
def store():
    s = SharedStore.create(initial_weights(4), 32)
    yield s
    s.close()


def test_a_push_takes_the_stores_lock_once_and_serves_as_its_own_memory_does(store, monkeypatch):
    own_run, own = _handler(None)
    expected = _serve(own, own_run, None)

    run, handler = _handler(store)
    lockf = Counted(fcntl.lockf)
    monkeypatch.setattr(fcntl, "lockf", lockf)
    got = _serve(handler, run, lockf)

    # the push sent twice takes two: the duplicate's section is its reply's weights
    assert [g[-1] for g in got] == [2 if i == 10 else 1 for i in range(len(got))]
    assert [g[:-1] for g in got] == [e[:-1] for e in expected]
    assert got[20][2] and run.counters["duplicates_dropped"] == 1  # a drop and a duplicate seen
    assert run.cursors.last_seq == {b: PUSHES - 1 for b in range(BLOCKS)}
    assert any(g[5] for g in got)  # replies carried downlinks, made and read in the same sections
    assert np.array_equal(run.W, own_run.W) and np.array_equal(store.U, own_run.ps.U)
    assert store.version == own_run.version and run.exchange.exchanges == own_run.exchange.exchanges
    measured = {"apply_s", "server_cpu_s", "downlink_cpu_s", "select_cpu_s", "encode_cpu_s"}  # CPU clocks
    assert [{k: v for k, v in r.items() if k not in measured} for r in run.history] == \
           [{k: v for k, v in r.items() if k not in measured} for r in own_run.history]


def test_a_section_takes_the_lock_at_its_first_entry_and_keeps_it_to_its_end(store, monkeypatch):
    lockf = Counted(fcntl.lockf)
    monkeypatch.setattr(fcntl, "lockf", lockf)
    with store.lock.section():
        assert lockf.taken == 0  # nothing taken before the first entry
        store.count()
        store.add_samples(8)
        store.bump()
        assert lockf.taken == 1
    assert (store.exchanges, store.samples, store.version) == (1, 8, 1)
    store.count()  # outside a section: each entry its own
    store.count()
    assert lockf.taken == 3
    with store.lock.section():
        pass
    assert lockf.taken == 3
