"""The stream's wire keeps the service's promises: bound to the one address it is given, every
frame authenticated under the run's secret (a stranger, a forged or replayed frame refused and
counted, before the handler sees anything), a message over the cap refused from its length
prefix without being held in memory, and the listener and its connections closed at the end."""

import hashlib
import hmac
import socket
import struct
import threading
import time

import pytest

from sparkcnn import streamsocket
from sparkcnn.protocol import Done, Push, Reply, StreamPlan
from sparkcnn.streamwire import decode, encode
from sparkcnn.transport.service import PSService


def _reply(**kw):
    return Reply(**{**dict(lr=0.1, density=1.0, tau=0, retrain=False, send_state=False, refused="", dense=b"",
                          dense_version=0), **kw})


def _push(seq=0):
    return Push(seq=seq, first_step=0, steps=1, samples=32, base_version=0, have=0, attempt=0, lr=0.1,
                density=1.0, loss_sum=1.0, correct=3, nnz=1, compute_s=0.01, wait_s=0.0, view_bytes=0,
                state_reset=False, replica_resync=False, pid=1, executor="h:d", payload=b"payload")


class Recorder:
    """A handler recording the streams opened and the pushes that reached them."""

    def __init__(self):
        self.opened, self.pushes = [], []

    def open(self, hello):
        rec = self
        rec.opened.append(hello)

        class Session:
            start = _reply(plan=StreamPlan(seq0=0, first_step=0, steps=1, h=1, expect_state=-1, lookahead=False,
                                           overlap=True, attempt=0))

            def push(self, p):
                rec.pushes.append(p)
                return _reply(tau=len(rec.pushes))

            def refused(self, why):
                return _reply(retrain=True, refused=why)

        return Session()


@pytest.fixture
def svc():
    s = PSService("127.0.0.1", Recorder(), max_message_bytes=1000)
    yield s
    s.close()


def _open(svc, token=None, hello=b'{"block": 0}'):
    return streamsocket.connect(svc.host, svc.port, token or svc.token, hello, 10.0)


def _answer(conn) -> Reply:
    return decode(conn.read(), (Reply,))


def _until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_a_token_holder_s_pushes_are_answered_and_its_address_recorded(svc):
    conn = _open(svc)
    assert _answer(conn).plan is not None
    for seq in range(3):
        conn.write(encode(_push(seq)))
        assert _answer(conn).tau == seq + 1
    conn.write(encode(Done()))
    conn.close()
    assert [p.seq for p in svc.handler.pushes] == [0, 1, 2] and svc.handler.opened == [{"block": 0}]
    assert svc.peer_hosts == {"127.0.0.1"} and svc.counters["unauthenticated_refused"] == 0
    assert _until(lambda: svc.counters["messages"] == 3)  # counted when the stream ends


def test_the_listener_is_bound_to_its_address_only(svc):
    assert svc._listener.getsockname()[:2] == ("127.0.0.1", svc.port)
    with pytest.raises(ConnectionRefusedError):  # another address of this host: nobody listens there
        socket.create_connection(("127.0.0.2", svc.port), timeout=5).close()


def test_a_wrong_secret_is_refused_and_counted_before_the_handler_sees_anything(svc):
    conn = _open(svc, token="not-the-token")
    with pytest.raises((EOFError, ConnectionError)):
        conn.read()  # the server closed the connection: no plan for a stranger
    conn.close()
    assert _until(lambda: svc.counters["unauthenticated_refused"] == 1)
    assert svc.handler.opened == []
    # a stranger who connects and says nothing, or sends a frame claiming 4 GB, is refused the same
    raw = socket.create_connection((svc.host, svc.port), timeout=10)
    raw.recv(20)  # the challenge
    raw.sendall(struct.pack("<I", 2**32 - 1) + b"\0" * 32)
    assert raw.recv(10) == b""  # closed without reading 4 GB
    raw.close()
    assert _until(lambda: svc.counters["unauthenticated_refused"] == 2) and svc.handler.opened == []


def test_a_forged_or_replayed_frame_closes_the_stream_and_is_counted(svc):
    conn = _open(svc)
    _answer(conn)
    conn.write(encode(_push(0)))
    _answer(conn)
    body = struct.pack("<Q", conn.sent) + encode(_push(1))
    forged = struct.pack("<I", len(body)) + hmac.digest(b"guess", body, "sha256") + body
    conn.sock.sendall(forged)
    with pytest.raises((EOFError, ConnectionError)):
        conn.read()
    assert _until(lambda: svc.counters["unauthenticated_refused"] == 1)
    assert [p.seq for p in svc.handler.pushes] == [0]
    # a genuine frame sent again (its number is past) is refused as well
    conn = _open(svc)
    _answer(conn)
    conn.write(encode(_push(0)))
    _answer(conn)
    conn.sent -= 1  # the same number, the same key: the frame a recording would replay
    conn.write(encode(_push(0)))
    with pytest.raises((EOFError, ConnectionError)):
        conn.read()
    assert _until(lambda: svc.counters["unauthenticated_refused"] == 2)
    assert [p.seq for p in svc.handler.pushes] == [0, 0]  # one genuine push per stream, no more


def test_a_message_over_the_cap_is_refused_from_its_length_and_the_stream_goes_on(svc):
    conn = _open(svc)
    _answer(conn)
    conn.write(b"\0" * 300_000)  # 300 kB against a cap of 1000 bytes
    assert "300000 bytes over the cap" in _answer(conn).refused
    conn.write(encode(_push(0)))
    assert _answer(conn).tau == 1
    assert svc.counters["oversize_refused"] == 1 and [p.seq for p in svc.handler.pushes] == [0]
    conn.close()


def _tcp_pair():
    with socket.create_server(("127.0.0.1", 0)) as lsock:
        a = socket.create_connection(lsock.getsockname())
        b, _ = lsock.accept()
    return a, b


def test_an_oversize_frame_is_never_held_in_memory():
    a, b = _tcp_pair()
    key = hashlib.sha256(b"k").digest()
    writer, reader = streamsocket.Conn(a, key, b"", 0), streamsocket.Conn(b, b"", key, 1000)
    t = threading.Thread(target=writer.write, args=(b"x" * (1 << 22),))  # 4 MB
    t.start()
    assert reader.read() == 1 << 22
    t.join()
    assert len(reader._buf) == 1 << 16  # read through the fixed buffer, never whole
    writer.write(b"next")
    assert reader.read() == b"next"
    a.close()
    b.close()


def test_close_ends_the_listener_and_every_connection():
    svc = PSService("127.0.0.1", Recorder(), max_message_bytes=1000)
    conn = _open(svc)
    _answer(conn)
    svc.close()
    with pytest.raises((EOFError, ConnectionError)):
        conn.read()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", svc.port), timeout=5).close()
    assert not svc._conns
    svc.close()  # a second close does nothing
