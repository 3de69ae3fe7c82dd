"""K = 2 parameter-server processes (ps.servers) serving disjoint blocks, driven by real stream
links (no Spark, no TensorFlow): four blocks push at once, each to its own server's service;
every push is applied once through its server's Run, into the one shared copy of the weights,
and the driver writes every server's records in one order and merges their cursors."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from sparkcnn.compression.codec import decode
from sparkcnn.protocol import Push, StreamTicket
from sparkcnn.server.run import Run, RunShape
from sparkcnn.server.sharedstore import SharedStore
from sparkcnn.transport.servers import ServerGroup
from sparkcnn.worker.streamlink import Link, ServerGone
from tests.unit.fake_run import BATCH, LOSS, FakeBackend, initial_weights, make_cfg, make_spec, payloads

BLOCKS, H, PUSHES, PASS = 4, 2, 25, 100


def _push(block: int, seq: int, reply, payload: bytes) -> Push:
    return Push(seq=seq, first_step=seq * H, steps=H, samples=H * BATCH, base_version=reply.dense_version,
                have=-1, attempt=0, lr=reply.lr, density=reply.density, loss_sum=LOSS * H * BATCH, correct=0,
                nnz=1, compute_s=0.01, wait_s=0.0, view_bytes=0, state_reset=False, replica_resync=False,
                pid=1, executor=f"fake:{block}", payload=payload)


def _block(ticket: StreamTicket, block: int, pool, errors: list) -> None:
    """One block's task: PUSHES pushes of H steps, each after the previous reply (a dropped one again)."""
    try:
        link = Link(ticket, block)
        reply, _ = link.start()
        seq = 0
        while seq < PUSHES:
            got, _ = link.wait(link.send(_push(block, seq, reply, pool[(block * PUSHES + seq) % len(pool)])))
            reply, seq = got, seq if got.retrain else seq + 1
            assert not got.refused, got.refused
        link.close()
    except BaseException as e:  # noqa: BLE001 - the test reports it
        errors.append(e)


@pytest.fixture()
def driver():
    cfg = make_cfg("async", h=H, blocks=BLOCKS, density_down=0.1,
                   extra=("engine.transport=stream", "engine.stream_timeout_s=20", "ps.servers=2"))
    spec, w0 = make_spec(cfg), initial_weights(5)
    store = SharedStore.create(w0, 4 * BLOCKS + 4)
    passes = {b: PASS for b in range(BLOCKS)}
    run = Run(cfg, spec, w0, RunShape(passes, bsp=False, downlink_every=2, inline_downlinks=4 * BLOCKS + 4),
              backend=FakeBackend(), evaluate=None, shared=store)
    group = ServerGroup(2, run, store, FakeBackend(), host="127.0.0.1", spec=spec, pass_steps=passes,
                        downlink_every=2, max_message_bytes=1 << 20, timeout_s=20)
    yield run, store, group, w0
    group.close()
    store.close()


def test_two_servers_apply_four_blocks_pushes_once_each(driver):
    run, store, group, w0 = driver
    pool = payloads("float16")
    group.start_stage(0)
    tickets = {b: StreamTicket(*group.server_of(b), group.token, 20.0) for b in range(BLOCKS)}
    assert {t.port for t in tickets.values()} == {p for _, p in group.locations}
    errors: list = []
    threads = [threading.Thread(target=_block, args=(tickets[b], b, pool, errors)) for b in range(BLOCKS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    group.end_stage(0)
    assert group.failure is None

    n = BLOCKS * PUSHES
    rounds = run.history
    assert [r["round"] for r in rounds] == list(range(n))  # one order, the servers' records merged
    assert sorted((r["block"], r["seq"]) for r in rounds) == [(b, s) for b in range(BLOCKS)
                                                               for s in range(PUSHES)]
    assert store.version == run.version == n and run.exchange.exchanges == n
    assert run.cursors.block_step == {b: PUSHES * H for b in range(BLOCKS)}
    assert run.cursors.last_seq == {b: PUSHES - 1 for b in range(BLOCKS)}
    assert run.cursors.samples_done == n * H * BATCH
    # the histogram and the services count every push judged, a dropped one too (pushed again)
    judged = n + run.counters["stale_dropped"]
    assert sum(run.exchange.staleness_hist.values()) == judged
    front = group.front()
    assert front["stream"]["streams"] == BLOCKS and front["stream"]["messages"] == judged

    # W = w0 - sum of every push's lambda(tau)/N . S, in whatever order the two servers applied them
    exact = w0.astype(np.float64)
    for r in rounds:
        d = decode(pool[(r["block"] * PUSHES + r["seq"]) % len(pool)], run.spec.layout)
        exact[d.indices] -= (np.float32(r["scale"]) * d.values).astype(np.float64)
    tol = n * np.finfo(np.float32).eps * (np.abs(exact) + 1e-2)
    assert (np.abs(run.W - exact) <= tol).all()
    log = store.latest()  # the downlinks both servers made: one chain
    assert log and all(b.base_version == a.version for a, b in zip(log, log[1:]))

    with pytest.raises(ServerGone):  # block 1 is server 1's: server 0 opens no stream for it
        Link(StreamTicket(*group.server_of(0), group.token, 5.0), 1).start()
