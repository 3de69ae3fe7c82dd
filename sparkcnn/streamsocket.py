"""The stream's connections: one TCP connection per stream, framed messages, each authenticated
under the run's secret. Standard library only; the driver's service and the tasks both use it.

    connection   server -> task     b"SCS1" | nonce (16 random bytes)        the challenge
                 task -> server     frames: the stream's descriptor (JSON), then messages
                 server -> task     frames: replies
    frame        u32 length n | MAC (32 bytes) | body (n bytes)
    body         u64 number | message (a :mod:`sparkcnn.streamwire` buffer, or the descriptor)

Little-endian. Each side numbers its frames from 0. The MAC is HMAC-SHA256 of the body under the
key of its direction, ``HMAC-SHA256(secret, b"up" | nonce)`` from the task, ``b"down" | nonce``
back: a frame verifies only on the connection, in the direction and at the place it was made
for, by a holder of the run's secret. So a stranger's frame, a recorded frame replayed on a new
connection, a frame reordered or dropped on the way, or the server's own frame sent back, is
refused (:class:`Unauthenticated`). The secret never crosses the wire.

The length is read first and checked against the reader's cap before the body is: a frame over
the cap is never held in memory. :meth:`Conn.read` reads such a frame's body through a fixed
buffer, checking its MAC on the way, and returns its length (an ``int``) instead of the message,
so that the service can refuse it and the stream go on, as with any other refused message. A
frame under the body's own 8 bytes is malformed (:class:`Unauthenticated`: nothing authentic is
that short).

Why not Arrow Flight or ZeroMQ: ``bench/flightfloor.py`` measured each (docs/transports.md, "The
wire"): a socket read and written by the stream's own thread costs the fewest thread hand-overs
per message, and so the least server CPU when messages are rare.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct

MAGIC = b"SCS1"
NONCE = 16
MAC = 32
HELLO_CAP = 4096  # bytes: a stream's descriptor at most
_LEN, _SEQ = struct.Struct("<I"), struct.Struct("<Q")
_HEAD = _LEN.size + MAC
_CHUNK = 1 << 16  # bytes: the read buffer, and the piece an oversize frame is skipped by


class Unauthenticated(ConnectionError):
    """A frame whose MAC or number is not the next one's under the run's secret."""


def _keys(secret: str, nonce: bytes) -> tuple[bytes, bytes]:
    """(up, down): the two directions' keys of one connection."""
    s = secret.encode()
    return hmac.digest(s, b"up" + nonce, "sha256"), hmac.digest(s, b"down" + nonce, "sha256")


class Conn:
    """One end of a stream's connection: :meth:`write` a message, :meth:`read` the next one."""

    def __init__(self, sock: socket.socket, send_key: bytes, recv_key: bytes, cap: int, skip: bool = True):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock, self.cap = sock, int(cap)
        self._send_key, self._recv_key = send_key, recv_key
        self._buf = bytearray(_CHUNK)
        self._have = 0  # bytes in the buffer, from the start of the next frame
        self.skip = skip  # a frame over the cap is skipped (False: refused, Unauthenticated)
        self.sent = self.got = 0  # frames written and read

    def write(self, message) -> None:
        """One frame; ``sendmsg`` gathers its parts without copying them into one."""
        body = _SEQ.pack(self.sent) + bytes(message)
        self.sent += 1
        parts = [_LEN.pack(len(body)), hmac.digest(self._send_key, body, "sha256"), body]
        done = self.sock.sendmsg(parts)
        if done < _HEAD + len(body):  # a socket with a timeout may take part of it
            self.sock.sendall(memoryview(b"".join(parts))[done:])

    def read(self):
        """The next message (bytes); the length of a message over the cap (an int), skipped;
        :class:`EOFError` at the peer's end between frames; :class:`Unauthenticated` for a frame
        that does not verify; ``OSError`` when the connection fails (a timeout included)."""
        self._fill(_HEAD)
        (n,) = _LEN.unpack_from(self._buf)
        if n < _SEQ.size:
            raise Unauthenticated(f"frame of {n} bytes")
        mac = bytes(self._buf[_LEN.size:_HEAD])
        if n - _SEQ.size > self.cap:
            if not self.skip:
                raise Unauthenticated(f"frame of {n} bytes over the cap")
            return self._skip(n, mac)
        end = _HEAD + n
        if end > len(self._buf):
            self._buf.extend(bytes(end - len(self._buf)))
        self._fill(end)
        body = bytes(memoryview(self._buf)[_HEAD:end])
        self._consume(end)
        self._verify(hmac.digest(self._recv_key, body, "sha256"), mac, body)
        return body[_SEQ.size:]

    def _skip(self, n: int, mac: bytes) -> int:
        """Read an oversize frame's body through the buffer, never whole; its MAC checked."""
        h, first, left = hmac.new(self._recv_key, digestmod=hashlib.sha256), b"", n
        self._consume(_HEAD)
        while left:
            self._fill(1)
            k = min(left, self._have)
            part = bytes(self._buf[:k])
            if len(first) < _SEQ.size:
                first += part[:_SEQ.size - len(first)]
            h.update(part)
            self._consume(k)
            left -= k
        self._verify(h.digest(), mac, first)
        return n - _SEQ.size

    def _verify(self, want: bytes, mac: bytes, body: bytes) -> None:
        if (not hmac.compare_digest(want, mac) or len(body) < _SEQ.size
                or _SEQ.unpack_from(body)[0] != self.got):
            raise Unauthenticated("a frame that does not verify under the run's secret")
        self.got += 1

    def _fill(self, k: int) -> None:
        """At least ``k`` bytes in the buffer (``k`` within it)."""
        while self._have < k:
            got = self.sock.recv_into(memoryview(self._buf)[self._have:])
            if not got:
                if self._have:
                    raise ConnectionError("the peer closed the connection inside a frame")
                raise EOFError("the peer closed the connection")
            self._have += got

    def _consume(self, k: int) -> None:
        rest = self._have - k
        if rest:
            self._buf[:rest] = self._buf[k:self._have]
        self._have = rest

    def admit(self, cap: int) -> None:
        """The peer proved the secret: its frames are capped at ``cap`` from now on, and one over
        it is skipped instead of ending the connection."""
        self.cap, self.skip = int(cap), True

    def close(self) -> None:
        """Shut the connection down (a thread blocked reading it returns) and close it."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def accept(sock: socket.socket, secret: str, cap: int, timeout_s: float) -> tuple[Conn, bytes]:
    """The server's end of a connection just accepted, and the stream's descriptor: sends the
    challenge and reads the first frame within ``timeout_s``, then waits without a limit.
    :class:`Unauthenticated`, ``EOFError`` or ``OSError`` when the peer does not prove the secret
    in time."""
    nonce = os.urandom(NONCE)
    sock.settimeout(timeout_s)
    sock.sendall(MAGIC + nonce)
    up, down = _keys(secret, nonce)
    conn = Conn(sock, down, up, HELLO_CAP, skip=False)  # nothing of a stranger read past this cap
    hello = conn.read()
    conn.admit(cap)
    sock.settimeout(None)
    return conn, hello


def connect(host: str, port: int, secret: str, hello: bytes, timeout_s: float, cap: int = 1 << 31) -> Conn:
    """The task's end: connects, reads the challenge and sends the descriptor ``hello``. Every
    later wait on it is bounded by ``timeout_s`` too (``OSError`` past it)."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        got = b""
        while len(got) < len(MAGIC) + NONCE:
            part = sock.recv(len(MAGIC) + NONCE - len(got))
            if not part:
                raise ConnectionError("the server closed the connection")
            got += part
        if got[:len(MAGIC)] != MAGIC:
            raise ConnectionError("not a sparkcnn parameter server")
        up, down = _keys(secret, got[len(MAGIC):])
        conn = Conn(sock, up, down, cap)
        conn.write(hello)
        return conn
    except BaseException:
        sock.close()
        raise
