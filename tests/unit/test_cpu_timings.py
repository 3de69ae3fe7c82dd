"""The driver's CPU per push, measured where the work happens: the stream records' ``Timings``
(``server_cpu_s`` > ``downlink_cpu_s`` > ``select_cpu_s``, ``encode_cpu_s``) and the service's
per-stream sums (``messages``, ``handler_cpu_s``, ``stream_cpu_s``). No timing is asserted,
only which part holds which."""

from __future__ import annotations

import types

import numpy as np
import pytest

from sparkcnn.compression.delta import SparseDelta
from sparkcnn.ps import ParameterServer
from sparkcnn.server.downlink import NO_CPU, Downlink
from sparkcnn.streamwire import encode
from sparkcnn.transport.service import PSService
from tests.unit.fake_run import FakeBackend
from tests.unit.test_wire_fuzz import CAP, Dispatch, Reader, Stream, Writer

LAYOUT, N = (6, 10, 1200, 3000), 4216


@pytest.mark.parametrize("candidates", [True, False])
def test_a_downlink_times_its_parts_and_the_scan_only_when_it_scans(candidates):
    w0 = np.random.default_rng(0).normal(0, 0.05, N).astype(np.float32)
    ps = ParameterServer(w0, LAYOUT, density_down=0.02, value_dtype="float16", candidates=candidates)
    spec = types.SimpleNamespace(sparse_downlink=True, layout=LAYOUT, value_dtype="float16")
    down = Downlink(ps, spec, FakeBackend(), keep_broadcasts=2, inline=4)
    assert down.cpu == NO_CPU and down.send(0.02) == 0 and down.cpu == NO_CPU  # nothing applied: none
    idx = np.arange(0, N, 500)
    ps.apply(SparseDelta(N, idx, np.full(idx.size, 0.01, np.float32)))
    assert down.send(0.02) > 0
    whole, select, enc = down.cpu
    assert whole > 0 and enc > 0 and whole >= select + enc
    assert (select > 0) == (not candidates)  # a few entries: the candidate set settles it
    ps.apply(SparseDelta(N, idx, np.full(idx.size, 0.01, np.float32)))
    assert down.send(0.02, every=2) == 0 and down.cpu == NO_CPU  # not due: no downlink, no CPU


def test_stream_records_and_the_service_carry_the_driver_s_cpu():
    dispatch = Dispatch()
    svc = PSService("127.0.0.1", dispatch, CAP)
    try:
        stream = Stream(svc, dispatch, mode="async", blocks=1, h=1, max_staleness=1000, seed=5)
        before = dict(svc.counters)
        writer, sent = Writer(), []

        def next_message():
            if len(sent) == 4:
                return ...
            reply = writer.replies[-1]  # the start, then each push's reply: what it offered
            stream.offered = (reply.lr, reply.density)
            sent.append(stream.next_push(stream.snapshot(), steps=1))
            return encode(sent[-1])

        svc.serve_stream(b'{"block": 0}', Reader(next_message), writer)
    finally:
        svc.close()
    assert not any(r.refused for r in writer.replies)
    got = {k: svc.counters[k] - before[k] for k in ("messages", "handler_cpu_s", "stream_cpu_s")}
    assert got["messages"] == 4 and 0 < got["handler_cpu_s"] <= got["stream_cpu_s"]
    records = stream.run.history
    assert len(records) == 4
    for r in records:
        assert r["server_cpu_s"] >= r["downlink_cpu_s"] >= r["select_cpu_s"] + r["encode_cpu_s"] >= 0
    assert sum(r["server_cpu_s"] for r in records) <= got["handler_cpu_s"]
    assert any(r["downlink_cpu_s"] > 0 for r in records)  # one block: a downlink after every push
