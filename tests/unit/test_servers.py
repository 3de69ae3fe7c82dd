"""K = 2 parameter-server processes (ps.servers) serving disjoint blocks, driven by real stream
links (no Spark, no TensorFlow): four blocks push at once, each to its own server's service;
every push is applied once through its server's Run, into the one shared copy of the weights,
and the driver writes every server's records in one order and merges their cursors. With
checkpoints inside the stage, every checkpoint is a consistent cut across the two servers."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from sparkcnn.checkpoint import load_checkpoint
from sparkcnn.compression.codec import decode
from sparkcnn.protocol import Push, StateArray, StreamTicket
from sparkcnn.server.run import Run, RunShape
from sparkcnn.server.sharedstore import SharedStore
from sparkcnn.transport.servers import ServerGroup
from sparkcnn.worker.streamlink import Link, ServerGone
from tests.unit.fake_run import BATCH, LOSS, P, FakeBackend, initial_weights, make_cfg, make_spec, payloads

BLOCKS, H, PUSHES = 4, 2, 25
PASS = PUSHES * H  # each block's stage: its pushes


def _push(block: int, seq: int, reply, payload: bytes) -> Push:
    state = ()
    if reply.send_state:  # a cut asks: the block's state after this push says which push it follows
        state = (StateArray("momentum", "float32", np.full(P, seq, np.float32).tobytes()),)
    return Push(seq=seq, first_step=seq * H, steps=H, samples=H * BATCH, base_version=reply.dense_version,
                have=-1, attempt=0, lr=reply.lr, density=reply.density, loss_sum=LOSS * H * BATCH, correct=0,
                nnz=1, compute_s=0.01, wait_s=0.0, view_bytes=0, state_reset=False, replica_resync=False,
                pid=1, executor=f"fake:{block}", payload=payload, state=state)


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


def _expected(run, w0: np.ndarray, pool, rounds: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """W = w0 - sum of the rounds' lambda(tau)/N . S (float64), and its float32 rounding bound
    (the servers applied them in an order of their own)."""
    exact = w0.astype(np.float64)
    for r in rounds:
        d = decode(pool[(r["block"] * PUSHES + r["seq"]) % len(pool)], run.spec.layout)
        exact[d.indices] -= (np.float32(r["scale"]) * d.values).astype(np.float64)
    return exact, max(1, len(rounds)) * np.finfo(np.float32).eps * (np.abs(exact) + 1e-2)


def _driver(tmp_path, every_rounds: int, write_cut=None):
    cfg = make_cfg("async", h=H, blocks=BLOCKS, density_down=0.1,
                   extra=("engine.transport=stream", "engine.stream_timeout_s=20", "ps.servers=2",
                          f"checkpoint.every_rounds={every_rounds}"))
    spec, w0 = make_spec(cfg), initial_weights(5)
    store = SharedStore.create(w0, 4 * BLOCKS + 4)
    passes = {b: PASS for b in range(BLOCKS)}
    run = Run(cfg, spec, w0, RunShape(passes, bsp=False, downlink_every=2, inline_downlinks=4 * BLOCKS + 4),
              backend=FakeBackend(), evaluate=None, shared=store, run_dir=str(tmp_path))
    group = ServerGroup(2, run, store, FakeBackend(), host="127.0.0.1", spec=spec, pass_steps=passes,
                        downlink_every=2, max_message_bytes=1 << 20, timeout_s=20, run_dir=str(tmp_path),
                        write_cut=write_cut)
    return run, store, group, w0


def _stage(group, pool) -> None:
    """One stage: every block's task pushing at once, each to its server."""
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


@pytest.fixture()
def driver(tmp_path):
    run, store, group, w0 = _driver(tmp_path, 0)
    yield run, store, group, w0
    group.close()
    store.close()


def test_two_servers_apply_four_blocks_pushes_once_each(driver):
    run, store, group, w0 = driver
    pool = payloads("float16")
    _stage(group, pool)

    n = BLOCKS * PUSHES
    rounds = run.history
    assert [r["round"] for r in rounds] == list(range(n))  # one order, the servers' records merged
    assert sorted((r["block"], r["seq"]) for r in rounds) == [(b, s) for b in range(BLOCKS)
                                                               for s in range(PUSHES)]
    assert store.version == run.version == n and run.exchange.exchanges == n
    # a push's apply, its number and its record's version are one section of the store's lock
    assert [r["version"] for r in rounds] == [r["round"] + 1 for r in rounds]
    assert run.cursors.block_epoch == {b: 1 for b in range(BLOCKS)}  # each ended its pass
    assert run.cursors.block_step == {b: 0 for b in range(BLOCKS)}
    assert run.cursors.last_seq == {b: PUSHES - 1 for b in range(BLOCKS)}
    assert run.cursors.samples_done == n * H * BATCH
    # the histogram and the services count every push judged, a dropped one too (pushed again)
    judged = n + run.counters["stale_dropped"]
    assert sum(run.exchange.staleness_hist.values()) == judged
    front = group.front()
    assert front["stream"]["streams"] == BLOCKS and front["stream"]["messages"] == judged

    # W = w0 - sum of every push's lambda(tau)/N . S, in whatever order the two servers applied them
    exact, tol = _expected(run, w0, pool, rounds)
    assert (np.abs(run.W - exact) <= tol).all()
    log = store.latest()  # the downlinks both servers made: one chain
    assert log and all(b.base_version == a.version for a, b in zip(log, log[1:]))

    with pytest.raises(ServerGone):  # block 1 is server 1's: server 0 opens no stream for it
        Link(StreamTicket(*group.server_of(0), group.token, 5.0), 1).start()


def test_a_checkpoint_inside_the_stage_is_a_cut_across_both_servers(tmp_path):
    """checkpoint.every_rounds = 10: a server whose apply makes a checkpoint due begins the cut,
    the other joins it, and the driver writes it once both have every block held. Each
    checkpoint holds exactly the pushes up to each block's state push: its W is w0 less the
    pushes its cursors count, its version their number, and each block's state the one it sent
    after its last counted push."""
    pool, seen = payloads("float16"), []

    def write_cut(states, t0):
        run.checkpoint(run.exchange.exchanges, {"next_epoch": 0}, states, t0=t0)
        ckpt = load_checkpoint(str(tmp_path))
        last = {int(b): s for b, s in ckpt.state["engine"]["last_seq"].items()}
        counted = [r for r in run.history if r["seq"] <= last[r["block"]]]
        assert len(counted) == len(run.history) == ckpt.state["ps"]["version"]  # nothing after it applied
        exact, tol = _expected(run, w0, pool, counted)
        assert (np.abs(ckpt.arrays["W"] - exact) <= tol).all()
        for b, st in ckpt.blocks.items():  # a block's state: after its last applied push
            assert last[b] >= 0 and (st["momentum"] == last[b]).all()
        seen.append(sorted(ckpt.blocks))

    run, store, group, w0 = _driver(tmp_path, 10, write_cut)
    try:
        _stage(group, pool)
        assert seen and all(blocks for blocks in seen), seen
        assert run.cursors.last_seq == {b: PUSHES - 1 for b in range(BLOCKS)}
        assert [r["round"] for r in run.history] == list(range(BLOCKS * PUSHES))
    finally:
        group.close()
        store.close()
