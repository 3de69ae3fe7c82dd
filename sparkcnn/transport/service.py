"""The parameter server as a network service on the driver: the one listener sparkcnn opens
(with ``ps.shards`` > 1, each key-range shard process opens one more under the same rules and
the same token: :mod:`sparkcnn.transport.shardservice`).

One Arrow Flight ``DoExchange`` stream per stream task (block); every message
is a :mod:`sparkcnn.streamwire` buffer sent as Flight app metadata::

    task  -> server   descriptor {"block"}; then Push, Push, ..., StageState, Done
    server -> task    a Reply with the block's StreamPlan and weights; then one Reply per message

Rules of the listener:
- it binds one address the executors reach (``spark.driver.host``), never all
  interfaces, on a free port;
- every call must carry ``authorization: Bearer <token>``, a per-run secret from
  :mod:`secrets` handed to the tasks in the job closure; the middleware refuses
  any other call when it starts, before the handler reads a message (counted);
- a message longer than ``max_message_bytes`` is refused before it is parsed,
  decoded or applied (counted) and the stream goes on; so is a message that
  is not a well-typed ``Push`` (:func:`sparkcnn.streamwire.decode` names the
  field) or that the engine's plan refuses (:class:`~sparkcnn.streamwire.WireError`
  raised by the handler before it changes anything). Flight (gRPC) offers no
  cap before a message is read into memory: gRPC's own receive limit is not
  exposed by pyarrow's server, so the cap acts after the read, before any use;
- :meth:`close` shuts it down; the engine calls it in ``finally`` when the run
  ends or fails.

Besides the refusals, ``counters`` sums over the streams that ended: ``messages`` handed to
the handler, ``handler_cpu_s`` (the thread CPU of those calls: check, the run's part, reply)
and ``stream_cpu_s`` (the thread CPU of the whole stream, Flight's reads and writes included);
each stream adds them once, when it ends.

The token is never logged and never written anywhere by this module.
"""

from __future__ import annotations

import hmac
import json
import logging
import secrets
import threading
import time

import pyarrow as pa
import pyarrow.flight as flight

from sparkcnn.protocol import Done, Push
from sparkcnn.streamwire import WireError, decode, encode

log = logging.getLogger(__name__)


class _Auth(flight.ServerMiddlewareFactory):
    def __init__(self, token: str, service):
        super().__init__()
        self._expected = f"Bearer {token}".encode()
        self._service = service

    def start_call(self, info, headers):
        got = headers.get("authorization") or headers.get(b"authorization") or []
        given = got[0] if got else ""
        given = given.encode() if isinstance(given, str) else bytes(given)
        if not hmac.compare_digest(given, self._expected):
            self._service.count("unauthenticated_refused")
            raise flight.FlightUnauthenticatedError("sparkcnn parameter server: missing or wrong token")
        return None


class _Server(flight.FlightServerBase):
    def __init__(self, location: str, service, middleware):
        super().__init__(location, middleware=middleware)
        self._service = service

    def do_exchange(self, context, descriptor, reader, writer):
        self._service.saw_peer(context.peer())
        try:
            self._service.serve_stream(descriptor.command, reader, writer)
        except flight.FlightError:
            raise
        except Exception as e:  # the task sees a Flight error; the driver keeps the cause
            log.error("parameter server: stream failed: %s", e, exc_info=True)
            raise flight.FlightServerError(f"sparkcnn parameter server: {type(e).__name__}") from None


class PSService:
    """Flight front of a stream engine or a shard: ``handler.open(descriptor)`` (the stream's
    descriptor, a JSON object) returns the stream's session, whose ``start`` is the first reply
    (None: none), ``accept`` the message classes it takes (default Push; Done ends a stream),
    ``push(message) -> reply`` (None: no reply) and ``refused(why) -> reply``; messages the
    service refuses never reach ``push``. The session raises :class:`WireError` for a message
    its plan refuses, before it changes any state. ``token``: the run's secret (default: a new one)."""

    def __init__(self, host: str, handler, max_message_bytes: int, token: str | None = None):
        self.token = token or secrets.token_urlsafe(32)
        self.host = host
        self.handler = handler
        self.max_message_bytes = int(max_message_bytes)
        self.counters = {"unauthenticated_refused": 0, "oversize_refused": 0, "malformed_refused": 0,
                         "streams": 0, "messages": 0, "handler_cpu_s": 0.0, "stream_cpu_s": 0.0}
        self.peer_hosts: set[str] = set()  # the addresses tasks reached the service from
        self._lock = threading.Lock()
        self._server = _Server(f"grpc+tcp://{host}:0", self, {"auth": _Auth(self.token, self)})
        self.port = int(self._server.port)
        self._closed = False
        log.info("parameter server listening on %s:%s", host, self.port)

    @property
    def location(self) -> str:
        return f"grpc+tcp://{self.host}:{self.port}"

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counters[key] = self.counters.get(key, 0) + n

    def saw_peer(self, peer) -> None:
        """Record the host of a caller, from gRPC's peer string (``ipv4:198.18.1.11:40312``)."""
        peer = peer.decode() if isinstance(peer, bytes) else str(peer or "")
        kind, _, rest = peer.partition(":")
        host = rest.rsplit(":", 1)[0].strip("[]") if kind in ("ipv4", "ipv6") else kind
        with self._lock:
            self.peer_hosts.add(host)

    def serve_stream(self, command: bytes, reader, writer) -> None:
        c0 = time.thread_time()
        spent = [0, 0.0]  # messages handed to the handler, their thread CPU
        try:
            self._serve(command, reader, writer, spent)
        finally:
            with self._lock:
                self.counters["messages"] += spent[0]
                self.counters["handler_cpu_s"] += spent[1]
                self.counters["stream_cpu_s"] += time.thread_time() - c0

    def _serve(self, command: bytes, reader, writer, spent: list) -> None:
        try:
            hello = json.loads(command)
            session = self.handler.open(hello) if isinstance(hello, dict) else None
        except (ValueError, KeyError, TypeError):  # not JSON, or a shard's handler refusing it
            session = None
        if session is None:  # no stream of that descriptor: refused
            self.count("malformed_refused")
            raise flight.FlightServerError("sparkcnn parameter server: bad stream descriptor") from None
        self.count("streams")
        block = hello.get("block")
        accept = (*getattr(session, "accept", (Push,)), Done)
        if session.start is not None:
            writer.write_metadata(pa.py_buffer(encode(session.start)))
        while True:
            try:
                chunk = reader.read_chunk()
            except StopIteration:
                return
            md = chunk.app_metadata
            if md is None:  # an empty message, or data where only metadata is spoken: answered
                md = pa.py_buffer(b"")
            if md.size > self.max_message_bytes:  # refused before it is parsed, decoded or applied
                self.count("oversize_refused")
                log.warning("block %s: message of %d bytes over engine.max_message_bytes=%d refused",
                            block, md.size, self.max_message_bytes)
                reply = session.refused(f"message of {md.size} bytes over the cap")
            else:
                try:
                    msg = decode(md, accept)
                    if isinstance(msg, Done):
                        return
                    c0 = time.thread_time()
                    reply = session.push(msg)
                    spent[0] += 1
                    spent[1] += time.thread_time() - c0
                except WireError as e:
                    self.count("malformed_refused")
                    log.warning("block %s: malformed message refused (%s)", block, e)
                    reply = session.refused(f"malformed message: {e}")
            if reply is not None:
                writer.write_metadata(pa.py_buffer(encode(reply)))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._server.shutdown()
            log.info("parameter server on %s:%s closed", self.host, self.port)
