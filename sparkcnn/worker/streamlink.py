"""The stream task's connection to the parameter server: one :mod:`sparkcnn.streamsocket`
connection to the coordinator and, with ``ps.shards`` > 1, one to each shard
(:mod:`sparkcnn.shards`), each authenticated under the run's secret of the ticket.

A push and its reply travel on one background thread (the push thread), so that the task
computes its next exchange meanwhile; the thread's CPU is summed (``Link.cpu_s``) for the
records' CPU outside TensorFlow. Every wait is bounded by the ticket's ``timeout_s``: a server
that does not answer, or closes the stream, is :class:`ServerGone`. Nothing here imports Spark.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from sparkcnn import streamsocket
from sparkcnn.protocol import Done, Piece, Push, Reply, ShardReply, StageState, StreamTicket
from sparkcnn.streamwire import WireError, decode, encode


class ServerGone(RuntimeError):
    """The parameter server did not answer in time or closed the stream."""


class Link:
    """One connection to the parameter server; every call bounded by ``timeout_s``."""

    def __init__(self, ticket: StreamTicket, block: int):
        self.ticket = ticket
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sparkcnn-push")
        self.conn = self._open(ticket.host, ticket.port, {"block": block})
        self.shards: list = []  # each shard's connection (ps.shards > 1)
        self.ordinal = -1       # pushes sent (their pieces' key on the shards, with the stream)
        self.stream = 0
        self.cpu_s = 0.0        # the push thread's CPU, summed (time.thread_time: waits excluded)

    def _open(self, host: str, port: int, hello: dict):
        # the socket's own timeout, a backstop for the push thread: the task's waits end at timeout_s
        try:
            return streamsocket.connect(host, port, self.ticket.token, json.dumps(hello).encode(),
                                        2 * self.ticket.timeout_s)
        except Exception as e:  # noqa: BLE001 - any failure to reach it means the same to the task
            raise ServerGone(f"parameter server at {host}:{port} unreachable ({type(e).__name__})") from None

    def _read(self, conn=None, kind=Reply):
        try:
            md = (conn or self.conn).read()
        except EOFError:
            raise ServerGone("the parameter server closed the stream") from None
        except Exception as e:  # noqa: BLE001 - a reset, a timeout or a frame that does not verify
            raise ServerGone(f"parameter server stream failed ({type(e).__name__})") from None
        if isinstance(md, int):
            raise WireError(f"a reply of {md} bytes over the cap")
        return decode(md, (kind,))

    @staticmethod
    def _write(conn, buf: bytes) -> None:
        try:
            conn.write(buf)
        except OSError as e:
            raise ServerGone(f"parameter server stream failed ({type(e).__name__})") from None

    def start(self):
        """The first Reply (the plan); with shards, and the shards' parts of its weights."""
        reply = self._wait(self._pool.submit(self._read))
        if not self.ticket.shards or reply.plan is None:
            return reply, None
        self.stream = reply.plan.stream
        self.shards = [self._open(h, p, {"stream": self.stream}) for h, p in self.ticket.shards]
        return reply, self._wait(self._pool.submit(self._pieces, [b""] * len(self.shards), -1, -1))

    def _pieces(self, payloads: list[bytes], have: int, ordinal: int) -> list[ShardReply]:
        self._write_pieces(payloads, have, ordinal)
        return [self._read(c, ShardReply) for c in self.shards]

    def _write_pieces(self, payloads, have: int, ordinal: int) -> None:
        for c, payload in zip(self.shards, payloads):
            self._write(c, encode(Piece(self.stream, ordinal, have, payload)))

    def send(self, push: Push, pieces: list[bytes] = ()):
        """Push (its pieces first, to the shards) on the background thread; returns a future of
        the reply and the shards' parts (None without shards)."""
        buf = encode(push)
        self.ordinal += 1
        ordinal = self.ordinal

        def roundtrip():
            if self.shards:  # the pieces reach the shards before the push reaches the coordinator
                self._write_pieces(pieces, push.have, ordinal)
            reply = self._exchange(buf)
            return reply, ([self._read(c, ShardReply) for c in self.shards] if self.shards else None)

        return self._pool.submit(self._timed, roundtrip)

    def send_state(self, msg: StageState) -> Reply:
        """A block's end-of-stage state to the coordinator (the shards hold no block state), and
        its reply; after the stage's last push was answered."""
        return self._wait(self._pool.submit(self._timed, self._exchange, encode(msg)))

    def _exchange(self, buf: bytes):
        """One message to the coordinator and its reply."""
        self._write(self.conn, buf)
        return self._read()

    def _timed(self, fn, *args):
        """``fn(*args)`` on the push thread, its CPU added to ``cpu_s`` (waits excluded)."""
        t = time.thread_time()
        try:
            return fn(*args)
        finally:
            self.cpu_s += time.thread_time() - t

    def _wait(self, fut):
        try:
            return fut.result(timeout=self.ticket.timeout_s)
        except FutureTimeout:
            raise ServerGone(f"parameter server at {self.ticket.host}:{self.ticket.port} did not answer "
                             f"within {self.ticket.timeout_s:g} s") from None

    def wait(self, fut):
        return self._wait(fut)

    def close(self) -> None:
        for conn in [self.conn, *self.shards]:
            try:
                conn.write(encode(Done()))
            except Exception:  # noqa: BLE001 - closing a stream to a server that is gone
                pass
            conn.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
