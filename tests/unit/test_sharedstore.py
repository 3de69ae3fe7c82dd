"""The parameter server's state shared by K processes (pure tier: numpy and processes, no Spark):
concurrent applies to the same entries lose nothing, the version counter is atomic, the downlink
log is one sequence every replica follows, and a process killed inside the critical section
leaves the others neither deadlocked nor unaware."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from types import SimpleNamespace

import numpy as np
import pytest

from sparkcnn.compression.codec import decode
from sparkcnn.compression.delta import SparseDelta
from sparkcnn.compression.sparsify import Sparsifier
from sparkcnn.ps import ParameterServer
from sparkcnn.replica import Downlink as ReplicaDownlink
from sparkcnn.replica import Replica, checksum
from sparkcnn.server.downlink import Downlink, Schedule
from sparkcnn.server.sharedstore import SharedStore, StoreAddress, StoreTorn

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYOUT = (300, 20000, 10)  # a bias, a large tensor, a small one
P = sum(LAYOUT)
HOT = np.arange(0, P, 97)  # entries every push touches: the two processes collide on them
SCALE = 0.5


def _weights() -> np.ndarray:
    return np.random.default_rng(0).standard_normal(P).astype(np.float32)


def _delta(seed: int, i: int) -> SparseDelta:
    """Push ``i`` of process ``seed``: the hot entries and a few of its own, values ~1e-2."""
    rng = np.random.default_rng([seed, i])
    idx = np.union1d(HOT, rng.choice(P, 40, replace=False))
    return SparseDelta(P, idx, (rng.standard_normal(idx.size) * 1e-2).astype(np.float32))


def _server(weights, memory=None, candidates=True) -> ParameterServer:
    return ParameterServer(weights, LAYOUT, density_down=0.02, sparsifier=Sparsifier("topk", dense_below=0),
                           value_dtype="float16", candidates=candidates, memory=memory)


def _downlink(ps, log=None) -> Downlink:
    spec = SimpleNamespace(sparse_downlink=True, layout=LAYOUT, value_dtype="float16")
    return Downlink(ps, spec, None, keep_broadcasts=0, inline=4, log=log)


def pusher(args: dict) -> None:
    """One server process: attach, wait for "go", apply its pushes (each followed by a due
    downlink), print the versions its applies got."""
    store = SharedStore.attach(StoreAddress(**args["address"]))
    ps = _server(store.W, memory=store)
    down = _downlink(ps, log=store)
    print("ready", flush=True)
    sys.stdin.readline()
    versions = []
    for i in range(args["pushes"]):
        versions.append(ps.apply(_delta(args["seed"], i), SCALE))
        if args["downlinks"]:
            down.send(0.02, every=1)
    print(json.dumps(versions), flush=True)
    store.close()


def holder(args: dict) -> None:
    """A process that dies inside the critical section: takes the lock, says so, sleeps."""
    store = SharedStore.attach(StoreAddress(**args["address"]))
    with store.lock:
        store.W[:10] = 0.0  # half a write
        print("inside", flush=True)
        time.sleep(60)


def _spawn(fn: str, store: SharedStore, **args) -> subprocess.Popen:
    code = f"import json, sys; from tests.unit.test_sharedstore import {fn}; {fn}(json.loads(sys.argv[1]))"
    payload = json.dumps({"address": asdict(store.address), **args})
    return subprocess.Popen([sys.executable, "-c", code, payload], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, pass_fds=(store.address.lock_fd,),
                            env=dict(os.environ, PYTHONPATH=REPO))


def _run_pushers(store: SharedStore, pushes: int, downlinks: bool) -> list[list[int]]:
    procs = [_spawn("pusher", store, seed=seed, pushes=pushes, downlinks=downlinks) for seed in (1, 2)]
    try:
        for p in procs:  # both attached before either starts: their pushes overlap
            assert p.stdout.readline().strip() == "ready"
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        out = [json.loads(p.stdout.readline()) for p in procs]
        assert [p.wait(60) for p in procs] == [0, 0]
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_two_processes_pushing_to_the_same_entries_lose_nothing():
    """K = 2: each process applies 300 pushes that all touch the same ~200 entries, at once. The
    weights equal the serially applied sum within float32 rounding (a lost update would be ~1e-2
    off), and every apply got its own version: 1 .. 600, each once."""
    w0, pushes = _weights(), 300
    store = SharedStore.create(w0, slots=4)
    try:
        versions = _run_pushers(store, pushes, downlinks=False)
        assert sorted(versions[0] + versions[1]) == list(range(1, 2 * pushes + 1))
        assert store.version == 2 * pushes
        serial = _server(w0)
        exact = w0.astype(np.float64)
        for seed in (1, 2):
            for i in range(pushes):
                d = _delta(seed, i)
                serial.apply(d, SCALE)
                exact[d.indices] -= (d.values * np.float32(SCALE)).astype(np.float64)
        # each entry rounds once per update it receives: at most 2 * pushes half-ulps of its size
        tol = 2 * pushes * np.finfo(np.float32).eps * (np.abs(exact) + 1e-2)
        assert (np.abs(store.W - exact) <= tol).all()
        assert (np.abs(store.W - serial.W) <= 2 * tol).all()
        moved = np.abs(store.W[HOT] - w0[HOT])  # the hot entries did move: the test tests something
        assert moved.mean() > 100 * tol[HOT].mean()
    finally:
        store.close()


def test_the_downlink_log_is_one_sequence_that_a_replica_follows():
    """Both processes make downlinks after their applies; the log they share is one chain of
    versions, and a replica of U that follows all of it checksum by checksum ends on the
    store's U, bitwise."""
    w0, pushes = _weights(), 40
    store = SharedStore.create(w0, slots=4 * pushes)
    try:
        _run_pushers(store, pushes, downlinks=True)
        log = store.latest()
        assert log and log[0].base_version == 0 and log[-1].version == store.view_version
        assert all(b.base_version == a.version for a, b in zip(log, log[1:]))
        replica = Replica()
        replica.load_snapshot(0, w0)
        replica.apply([ReplicaDownlink(m.version, decode(m.payload, LAYOUT), m.checksum_after, m.base_version,
                                       m.assign) for m in log])
        assert replica.U.tobytes() == store.U.tobytes()
        assert replica.checksum == f"{checksum(store.U):016x}"
    finally:
        store.close()


def test_servers_over_the_store_are_one_server_bitwise():
    """The store is only where the state lives: two servers over it (as two processes hold
    them, each with its own downlink), taking turns to apply and to make downlinks, give bitwise
    the weights, view, versions and downlink bytes of one server in its own memory, and of one
    that scans W - U every time. The candidate set is the store's: one server's downlink sees the
    other's applies, and settles most downlinks without a scan."""
    w0 = _weights()
    store = SharedStore.create(w0, slots=3)
    try:
        a, b = _server(store.W, memory=store), _server(store.W, memory=store)
        local, scan = _server(w0), _server(w0, candidates=False)
        downs = {id(ps): _downlink(ps, log=store if ps in (a, b) else None) for ps in (a, b, local, scan)}
        unscanned = 0
        for i in range(30):
            for applier, maker in ((a if i % 2 else b, b if i % 3 else a), (local, local), (scan, scan)):
                applier.apply(_delta(3, i), SCALE)
                if i % 3 == 2:
                    downs[id(maker)].send(0.2, every=2)
                    unscanned += maker in (a, b) and maker.select_cpu_s == 0.0
        shared, down_s, down_l = a, downs[id(a)], downs[id(local)]
        for ref in (local, scan):
            assert shared.W.tobytes() == ref.W.tobytes() and shared.U.tobytes() == ref.U.tobytes()
            assert (shared.version, shared.view_version, shared.checksum) == \
                (ref.version, ref.view_version, ref.checksum)
        assert [(m.version, m.base_version, m.checksum_after, m.payload) for m in down_s.messages] == \
            [(m.version, m.base_version, m.checksum_after, m.payload) for m in down_l.messages[-3:]] == \
            [(m.version, m.base_version, m.checksum_after, m.payload) for m in downs[id(scan)].messages[-3:]]
        assert unscanned >= 5
        have = down_s.messages[0].base_version
        assert down_s.since(have) == down_l.since(have)
        state = local.state_dict()
        shared.load_state_dict(state)  # a restore: the versions back, the log and candidates forgotten
        assert shared.version == state["version"] and store.latest() == ()
        assert not store.candidate_set.known
    finally:
        store.close()


def test_a_process_killed_inside_the_critical_section_is_noticed_not_waited_for():
    store = SharedStore.create(_weights(), slots=2)
    try:
        p = _spawn("holder", store)
        assert p.stdout.readline().strip() == "inside"
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        t0 = time.monotonic()
        with pytest.raises(StoreTorn, match=f"process {p.pid} died"):
            with store.lock:
                pass
        assert time.monotonic() - t0 < 5  # the kernel released its lock
        with pytest.raises(StoreTorn):  # and it stays torn: the run resumes from its last cut
            _server(store.W, memory=store).apply(_delta(1, 0))
    finally:
        store.close()


def test_the_guards_factors_are_one_pair_for_every_process():
    """A Run's schedule over the store: one server's guard halving the lr halves it for all."""
    store = SharedStore.create(_weights(), slots=2)
    try:
        cfg = SimpleNamespace(train=None, compression=SimpleNamespace(density=0.01))
        a, b = Schedule(cfg, None, factors=store), Schedule(cfg, None, factors=store)
        assert (a.lr_factor, a.density_factor) == (1.0, 1.0)
        a.halve_lr()
        b.raise_density()
        b.raise_density()
        assert (b.lr_factor, a.density_factor) == (0.5, 16.0)
        for _ in range(4):
            a.raise_density()
        assert b.density_factor == 100.0  # capped at 1 / density, as in one process
        b.load_state_dict({"lr_factor": 0.25, "density_factor": 1.0})
        assert a.state_dict() == {"lr_factor": 0.25, "density_factor": 1.0}
    finally:
        store.close()
