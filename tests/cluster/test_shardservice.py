"""Shard processes over the stream's sockets: two shards fed the coordinator's log and a task's pieces keep
bitwise one server's weights; strangers are refused; a killed shard is seen; none outlives
its coordinator."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import time

import numpy as np
import pytest

from sparkcnn import streamsocket
from sparkcnn.compression import codec
from sparkcnn.compression.delta import SparseDelta
from sparkcnn.compression.sparsify import Sparsifier
from sparkcnn.server.apply import apply_deltas
from sparkcnn.transport.shardservice import ShardProcess
from sparkcnn.protocol import Answer, Piece, PieceRef, ShardInit, ShardReply, ShardStep
from sparkcnn.ps import ParameterServer
from sparkcnn.shards import shard_ranges, split_delta, sum_squares
from sparkcnn.streamwire import decode, encode

LAYOUT = (288, 32, 9216, 32, 18432, 64, 2000, 10)
P = sum(LAYOUT)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _start(token, lo, hi, index=0):
    return ShardProcess("127.0.0.1", token, index, lo, hi, LAYOUT, density_down=0.05, selector="threshold",
                        dense_below=1000, value_dtype="float16", keep_downlinks=8, timeout_s=10,
                        max_message_bytes=1 << 22)


def _pieces_stream(port, token, stream):
    return streamsocket.connect("127.0.0.1", port, token, b'{"stream": %d}' % stream, 10)


def test_two_shard_processes_keep_one_servers_weights_bitwise():
    rng = np.random.default_rng(11)
    w0 = rng.standard_normal(P).astype(np.float32)
    token = secrets.token_urlsafe(16)
    ranges = shard_ranges(LAYOUT, 2)
    ref = ParameterServer(w0, LAYOUT, density_down=0.05, sparsifier=Sparsifier("threshold", 1000),
                          value_dtype="float16")
    shards = [_start(token, lo, hi, j) for j, (lo, hi) in enumerate(ranges)]
    streams = []
    try:
        for s in shards:
            s.send(ShardInit(W=w0.tobytes(), U=w0.tobytes(), version=0, view_version=0))
            streams.append(_pieces_stream(s.port, token, stream=5))
        for t in range(30):
            idx = np.sort(rng.choice(P, 300, replace=False)).astype(np.int64)
            d = SparseDelta(P, idx, (rng.standard_normal(300) * 0.01).astype(np.float32))
            factor = float(rng.uniform(0.2, 1.0))
            apply_deltas(ref, [codec.encode(d, LAYOUT, value_dtype="float16")], [64], [factor])
            ref.downlink(0.05)
            pieces = [codec.encode(p, LAYOUT, value_dtype="float16") for p in split_delta(d, ranges)]
            for conn, payload in zip(streams, pieces):
                conn.write(encode(Piece(stream=5, ordinal=t, have=t, payload=payload)))
            ref_piece = PieceRef(5, t, factor, 64, tuple(sum_squares(codec.decode(p, LAYOUT)) for p in pieces))
            for s in shards:
                s.send(ShardStep(version=t + 1, apply=(ref_piece,), downlink=0.05, answer=(Answer(5, t, False),)))
            for conn in streams:
                reply = decode(conn.read(), (ShardReply,))
                assert reply.dense == b"" and [m.version for m in reply.downlinks] == [t + 1]
        for (lo, hi), s in zip(ranges, shards):
            st = s.cut()
            assert (st.version, st.view_version) == (30, 30)
            assert st.W == ref.W[lo:hi].tobytes() and st.U == ref.U[lo:hi].tobytes()
        # a stranger, or a wrong token, reaches nothing: the shard closes its connection
        for bad in ("", "not-the-token"):
            conn = _pieces_stream(shards[0].port, bad, stream=6)
            with pytest.raises((EOFError, ConnectionError)):
                conn.write(encode(Piece(6, 0, 0, b"")))
                conn.read()
            conn.close()
    finally:
        for conn in streams:
            conn.close()
        for s in shards:
            s.close()
    for s in shards:
        assert s.proc.returncode == 0 and not _listening(s.port)


def test_a_killed_shard_is_seen_by_its_coordinator():
    token = secrets.token_urlsafe(16)
    s = _start(token, 0, P)
    try:
        s.send(ShardInit(W=np.zeros(P, np.float32).tobytes(), U=np.zeros(P, np.float32).tobytes(),
                         version=0, view_version=0))
        assert s.cut().version == 0
        os.kill(s.proc.pid, signal.SIGKILL)
        s.proc.wait(10)
        with pytest.raises((EOFError, OSError)):
            s.cut()
    finally:
        s.close()


def test_a_shard_exits_when_its_coordinator_is_gone():
    """The shard watches its stdin: a coordinator that dies closes it, and the shard exits."""
    s = _start(secrets.token_urlsafe(16), 0, P)
    port = s.port
    s.proc.stdin.close()  # what the coordinator's death does
    assert s.proc.wait(10) == 0
    deadline = time.monotonic() + 5
    while _listening(port) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _listening(port)
    s.close()
