"""The test bed of separate hosts: shaped links that cost what they say, and nothing left behind.

The README's spark-submit route on the test bed, on both transports, is in tests/cluster/test_dist.py.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from sparkcnn.testing import testbed
from sparkcnn.testing.standalone import _processes

WHY = testbed.unavailable_reason()
needs_bed = pytest.mark.skipif(WHY is not None, reason=WHY or "")

SEND = r"""
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
data = b"\0" * int(sys.argv[3])
t0 = time.perf_counter()
s.sendall(data)
s.shutdown(socket.SHUT_WR)
s.recv(1)
print(time.perf_counter() - t0)
"""


def _bed_processes(prefix: str) -> list[str]:
    """Command lines of every process that names an address of the test-bed range."""
    return sorted(args for _, _, state, args in _processes() if prefix in args and not state.startswith("Z"))


def _upload_seconds(bed, host: int, nbytes: int) -> float:
    """Seconds for host ``host`` to send ``nbytes`` to a socket on the driver's address."""
    srv = socket.create_server((bed.driver_host, 0))
    got = []

    def sink():
        conn, _ = srv.accept()
        n = 0
        while chunk := conn.recv(1 << 16):
            n += len(chunk)
        got.append(n)
        conn.sendall(b"k")
        conn.close()

    t = threading.Thread(target=sink, daemon=True)
    t.start()
    proc = subprocess.run(["ip", "netns", "exec", bed.netns(host), sys.executable, "-c", SEND, bed.driver_host,
                           str(srv.getsockname()[1]), str(nbytes)], capture_output=True, text=True, timeout=120)
    t.join(10)
    srv.close()
    assert proc.returncode == 0 and got == [nbytes], (proc.stderr, got)
    return float(proc.stdout)  # from the first byte sent to the receiver's acknowledgement


@needs_bed
@pytest.mark.cluster
def test_test_bed_shapes_its_links_and_leaves_nothing_behind_when_a_run_fails():
    testbed.reap_orphans()  # what a killed earlier run left is not this test's
    before = testbed.leftovers(), _bed_processes("198.18.")
    with pytest.raises(RuntimeError, match="the run failed"):
        with testbed.TestBed(hosts=2, rate="100mbit") as bed:
            during = testbed.leftovers()
            assert during["netns"] == sorted([bed.netns(0), bed.netns(1)])
            assert set(during["links"]) >= {bed.bridge, bed.veth(0), bed.veth(1)}
            assert bed.cluster.alive_workers() == 2 and bed.cluster.master_url == f"spark://{bed.driver_host}:" \
                f"{bed.cluster.port}"
            running = _bed_processes(f"198.18.{bed.subnet}.")
            assert sum("deploy.worker.Worker" in a for a in running) == 2, running
            # each worker JVM runs inside its own host's namespace
            for i, pid in bed.cluster.worker_pids().items():
                assert str(pid) in subprocess.run(["ip", "netns", "pids", bed.netns(i)], capture_output=True,
                                                  text=True).stdout.split()
            # 2.5 MB at 100 Mbit/s takes >= 0.2 s; at 1 Gbit/s ~0.02 s
            shaped = _upload_seconds(bed, 0, 2_500_000)
            bed.reshape("1gbit")
            fast = _upload_seconds(bed, 0, 2_500_000)
            assert shaped >= 0.18 and fast < shaped / 2, (shaped, fast)
            raise RuntimeError("the run failed")
    assert (testbed.leftovers(), _bed_processes("198.18.")) == before
    assert not {bed.bridge, bed.netns(0), bed.netns(1), bed.veth(0)} & {*before[0]["netns"], *before[0]["links"]}


ORPHAN = """
import os, signal, subprocess, sys
from sparkcnn.testing.testbed import TestBed
bed = TestBed(hosts=2)
bed._claim()
bed._network()
sleeper = subprocess.Popen(["ip", "netns", "exec", bed.netns(1), "sleep", "600"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(bed.subnet, sleeper.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # killed outright: no stop(), no exit handler
"""


@needs_bed
def test_a_bed_whose_owner_was_killed_is_deleted_and_a_live_one_is_kept():
    live = testbed.TestBed(hosts=1)
    live._claim()
    try:
        out = subprocess.run([sys.executable, "-c", ORPHAN], capture_output=True, text=True, timeout=60)
        assert out.returncode == -signal.SIGKILL, out.stderr
        subnet, sleeper = map(int, out.stdout.split())
        left = testbed.leftovers()
        assert {f"scn{subnet}h0", f"scn{subnet}h1"} <= set(left["netns"]) and f"scnb{subnet}" in left["links"]
        assert os.path.exists(f"/proc/{sleeper}")
        assert subnet in testbed.reap_orphans() and live.subnet not in testbed.reap_orphans()
        left = testbed.leftovers()
        assert not [n for n in left["netns"] + left["links"] if n.startswith((f"scn{subnet}", f"scnb{subnet}"))]
        assert live.bridge in left["links"]
        for _ in range(50):  # killed; gone once its parent (init) has reaped it
            if not os.path.exists(f"/proc/{sleeper}"):
                break
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{sleeper}")
    finally:
        live.stop()
    assert live.bridge not in testbed.leftovers()["links"]


def test_without_root_or_iproute2_the_test_bed_says_why_in_one_line(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert testbed.unavailable_reason() == "the test bed needs root (network namespaces)"
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(testbed.shutil, "which", lambda tool: None if tool == "tc" else "/bin/" + tool)
    assert testbed.unavailable_reason() == "the test bed needs iproute2's 'tc'"


def test_link_rates_are_read_in_tc_units_and_refused_otherwise():
    assert testbed.parse_rate("100mbit") == 1e8 and testbed.parse_rate("1gbit") == 1e9
    assert testbed.parse_rate(None) is None
    with pytest.raises(ValueError, match="link rate '100mb'"):
        testbed.parse_rate("100mb")
