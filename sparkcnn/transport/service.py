"""The parameter server as a network service on the driver: the one listener sparkcnn opens
(with ``ps.shards`` > 1, each key-range shard process opens one more under the same rules and
the same secret: :mod:`sparkcnn.transport.shardservice`).

One TCP connection per stream task (block), framed and authenticated by
:mod:`sparkcnn.streamsocket`; every message is a :mod:`sparkcnn.streamwire` buffer::

    task  -> server   descriptor {"block"}; then Push, Push, ..., StageState, Done
    server -> task    a Reply with the block's StreamPlan and weights; then one Reply per message

Each connection has a thread of its own that reads a message, hands it to the handler and
writes the reply: one thread hand-over per message (the kernel waking that thread), the fewest
of the wires ``bench/flightfloor.py`` measured (docs/transports.md, "The wire"). A handler may
block (a BSP push waits for its round, a block is held for a checkpoint cut) without holding
up any other stream.

Rules of the listener:
- it binds one address the executors reach (``spark.driver.host``), never all
  interfaces, on a free port;
- every frame must carry the HMAC-SHA256 of its body under the connection's key, derived from
  a per-run secret from :mod:`secrets` (``token``, handed to the tasks in the job closure) and
  the connection's challenge; a connection whose descriptor does not verify within
  ``HELLO_TIMEOUT_S``, or a frame that does not later, is refused and closed before the
  handler sees anything of it (counted in ``unauthenticated_refused``);
- a message longer than ``max_message_bytes`` is refused from its length prefix, before it is
  read into memory (its body is skipped through a fixed buffer), and the stream goes on
  (counted); so is a message that is not a well-typed ``Push``
  (:func:`sparkcnn.streamwire.decode` names the field) or that the engine's plan refuses
  (:class:`~sparkcnn.streamwire.WireError` raised by the handler before it changes anything);
- :meth:`close` closes the listener and every connection; the engine calls it in ``finally``
  when the run ends or fails.

Besides the refusals, ``counters`` sums over the streams that ended: ``messages`` handed to
the handler, ``handler_cpu_s`` (the thread CPU of those calls: check, the run's part, reply)
and ``stream_cpu_s`` (the thread CPU of the whole stream, its reads and writes included);
each stream adds them once, when it ends.

The secret is never logged and never written anywhere by this module.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import threading
import time

from sparkcnn import streamsocket
from sparkcnn.protocol import Done, Push
from sparkcnn.streamwire import WireError, decode, encode

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0  # a connection must send its verified descriptor within this, or it is refused


class Refused(RuntimeError):
    """A stream the service refused to open (a bad descriptor, counted): its connection closes."""


class PSService:
    """Socket front of a stream engine or a shard: ``handler.open(descriptor)`` (the stream's
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
        self._listener = socket.create_server((host, 0))  # this address only, never all interfaces
        self.port = int(self._listener.getsockname()[1])
        self._conns: dict[socket.socket, threading.Thread] = {}  # open connections and their threads
        self._closed = False
        self._serving = 0  # streams whose messages are still being served (counted when they end)
        threading.Thread(target=self._accept, name="sparkcnn-ps-accept", daemon=True).start()
        log.info("parameter server listening on %s:%s", host, self.port)

    @property
    def location(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counters[key] = self.counters.get(key, 0) + n

    def saw_peer(self, host: str) -> None:
        """Record the address a task reached the service from."""
        with self._lock:
            self.peer_hosts.add(str(host))

    def settle(self, timeout_s: float) -> bool:
        """Wait until no stream is being served, so that ``counters`` holds every message of the
        streams whose tasks ended (a stream is counted when its thread reads its end, which may come
        after the task that sent it returned); False if one still is after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                if self._serving == 0:
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.002)

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except OSError:  # closed
                return
            t = threading.Thread(target=self._connection, args=(sock, addr[0]), daemon=True,
                                 name=f"sparkcnn-ps-{addr[0]}:{addr[1]}")
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                self._conns[sock] = t
            t.start()

    def _connection(self, sock: socket.socket, peer: str) -> None:
        """One stream: the challenge and its descriptor, then its messages, until it ends."""
        try:
            conn, hello = streamsocket.accept(sock, self.token, self.max_message_bytes, HELLO_TIMEOUT_S)
            self.saw_peer(peer)
            self.serve_stream(hello, conn, conn)
        except (streamsocket.Unauthenticated, EOFError, socket.timeout) as e:
            if not self._closed:  # (a connection the closing service cut is not a refusal)
                self.count("unauthenticated_refused")
                log.warning("parameter server: connection from %s refused (%s)", peer, type(e).__name__)
        except (OSError, Refused):  # the task went away, the service closed, or a bad descriptor
            pass
        except Exception as e:  # the task sees its stream close; the driver keeps the cause
            log.error("parameter server: stream failed: %s", e, exc_info=True)
        finally:
            with self._lock:
                self._conns.pop(sock, None)
            _shut(sock)
            sock.close()

    def serve_stream(self, command: bytes, reader, writer) -> None:
        """One stream after its descriptor ``command``: ``reader.read()`` gives each message (or
        the length of one over the cap, an int) until ``EOFError``; ``writer.write`` a reply."""
        c0 = time.thread_time()
        spent = [0, 0.0]  # messages handed to the handler, their thread CPU
        with self._lock:
            self._serving += 1
        try:
            self._serve(command, reader, writer, spent)
        finally:
            with self._lock:
                self._serving -= 1
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
            raise Refused("sparkcnn parameter server: bad stream descriptor")
        self.count("streams")
        block = hello.get("block")
        accept = (*getattr(session, "accept", (Push,)), Done)
        if session.start is not None:
            writer.write(encode(session.start))
        while True:
            try:
                md = reader.read()
            except EOFError:
                return
            size = md if isinstance(md, int) else len(md)
            if isinstance(md, int) or size > self.max_message_bytes:  # refused before any use
                self.count("oversize_refused")
                log.warning("block %s: message of %d bytes over engine.max_message_bytes=%d refused",
                            block, size, self.max_message_bytes)
                reply = session.refused(f"message of {size} bytes over the cap")
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
                writer.write(encode(reply))

    def close(self) -> None:
        """Close the listener and every connection (their threads return), once."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = dict(self._conns)
        _shut(self._listener)  # wakes the accepting thread
        self._listener.close()
        for sock in conns:
            _shut(sock)  # wakes the thread reading it
        deadline = time.monotonic() + 5  # a handler blocked inside the run (a BSP wait) has its own timeout
        for t in conns.values():
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
        log.info("parameter server on %s:%s closed", self.host, self.port)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # not connected, or closed already
        pass
