"""The floor of the stream's wire: server CPU per message and reply latency of each candidate.

Prints one JSON object. Each candidate's server, a child process of its own, does what the
parameter-server service does for a message and nothing else: it reads one message of ``--up``
bytes, checks it as production would, and answers one reply of ``--down`` bytes (defaults: a
median push and reply of the 0.2 M model at uplink density 0.001 and downlink 0.01,
``bench/psload.py``). No decoding, no engine. The candidates (``--wires``):

- ``flight``: the current wire, one Arrow Flight ``DoExchange`` stream per task, each message
  app metadata; the bearer token checked by a server middleware on every call (stream);
- ``zmq``: a ZeroMQ ``ROUTER`` (server) and one ``DEALER`` per stream (pyzmq, ``copy=False``
  frames); each message two frames, an HMAC-SHA256 and a body;
- ``socket-threads``: a plain TCP socket per stream, length-prefixed frames, one server thread
  per connection blocking in ``recv``;
- ``socket-selector``: the same frames, all connections served by one thread on a selector.

Authentication on the three last, both ways: a frame carries ``HMAC-SHA256(secret, body)``, the
body a sequence number (8 bytes) and the payload, and a side refuses a frame whose MAC or number
is not the next one's. The secret is per run, from :mod:`secrets`, handed over stdin. The
socket servers read the length prefix and refuse a frame over the cap before reading its body;
ZeroMQ's ``MAXMSGSIZE`` is set to the same cap.

A case is a wire, a number of streams and a rate per stream. Each stream sends its messages at
its rate (ticks from a random phase: workers are not in step), one in flight, for ``--seconds``
(at least ``--min-messages`` messages). The streams are threads of ``--client-procs`` client
processes (at most 16 streams each): they connect and warm up (20 messages each) before the
server's CPU is read, and close after it is read again. What a case reports, per repetition and
as the median of its repetitions:

- ``server_cpu_ms_per_message``: the server process's CPU (user + system, all its threads, from
  ``getrusage``) between the two readings, over the messages answered;
- ``reply_ms_p50`` and ``reply_ms_p99``: the time from a message's send to its reply's arrival,
  over every message of the repetition;
- ``client_cpu_ms_per_message``: the stream threads' CPU (``time.thread_time``) per message.

``--rates`` (default 1,16,100,1000 messages/s per stream, ``--streams`` streams) and the case of
``--fanout`` (default 64x16: 64 streams at 16 messages/s, 64 workers pushing once per 60 ms).
Repetitions go round the cases and wires in turn (a repetition of every case and wire, then the
next), so that a change in the machine meanwhile touches every wire alike. ``against_flight``
gives each wire's medians over Flight's, case by case; ``better_than_flight`` holds where a wire
used less server CPU per message and answered no slower at the median in every case, judged
only with at least ``bench/targets.py``'s ``MIN_REPS`` repetitions. ``machine`` says how much CPU
other processes used during the run (``/proc/stat`` less this bench's processes): whether the
machine was shared. ``--load K`` keeps K more processes busy on a numpy loop over 8 MB
meanwhile, as TensorFlow's steps keep the cores of a real run.

    python bench/flightfloor.py [--wires flight,zmq,socket-threads,socket-selector] [--reps 5]
                                [--rates 1,16,100,1000] [--streams 2] [--fanout 64x16]
                                [--seconds 3] [--min-messages 8] [--up 4428] [--down 9229] [--load 0]
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import random
import resource
import secrets
import selectors
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import emit  # noqa: E402
from bench.targets import MIN_REPS  # noqa: E402

WIRES = ("flight", "zmq", "socket-threads", "socket-selector")
HOST = "127.0.0.1"
CAP = 1 << 20  # bytes: the size cap every server enforces (the service's is W's size and more)
WARMUP = 20  # messages per stream before the readings: connections made, buffers allocated
PER_PROC = 16  # streams per client process at most
_SEQ = struct.Struct("<Q")
_LEN = struct.Struct("<I")
MAC = 32  # bytes of an HMAC-SHA256
# a busy process of --load: a numpy pass over 8 MB, again and again, until killed
LOAD = "import numpy as np\na = np.ones(2 << 20, np.float32)\nwhile True:\n    a *= 1.0000001\n"


class Refused(RuntimeError):
    """A frame whose MAC, number or length is wrong."""


def _mac(key: bytes, body) -> bytes:
    return hmac.digest(key, body, "sha256")


def _body(seq: int, payload: bytes) -> bytes:
    return _SEQ.pack(seq) + payload


def _check(key: bytes, mac, body, seq: int) -> None:
    """Refuse ``body`` unless ``mac`` is its MAC and it carries number ``seq``."""
    if not hmac.compare_digest(_mac(key, body), bytes(mac)) or _SEQ.unpack_from(body)[0] != seq:
        raise Refused("bad MAC or number")


# ---- the servers: each answers ``down`` bytes to every message; ``stats`` counts ------------------

def _counter(stats: dict) -> list:
    """A count of messages answered that one thread alone adds to (``+=`` on a shared one could
    lose counts between threads); the readings sum them."""
    c = [0]
    stats["counts"].append(c)
    return c


def serve_flight(key: bytes, down: int, stats: dict) -> int:
    import pyarrow as pa
    import pyarrow.flight as fl

    expected = b"Bearer " + key.hex().encode()
    reply = pa.py_buffer(b"r" * down)

    class Auth(fl.ServerMiddlewareFactory):
        def start_call(self, info, headers):
            got = headers.get("authorization") or []
            given = got[0].encode() if got and isinstance(got[0], str) else bytes(got[0]) if got else b""
            if not hmac.compare_digest(given, expected):
                stats["refused"] += 1
                raise fl.FlightUnauthenticatedError("wrong token")

    class Echo(fl.FlightServerBase):
        def do_exchange(self, context, descriptor, reader, writer):
            count = _counter(stats)
            while True:
                try:
                    md = reader.read_chunk().app_metadata
                except StopIteration:
                    return
                if md is None or md.size > CAP:
                    stats["refused"] += 1
                count[0] += 1
                writer.write_metadata(reply)

    server = Echo(f"grpc+tcp://{HOST}:0", middleware={"auth": Auth()})
    stats["_keep"] = server
    return server.port


def serve_zmq(key: bytes, down: int, stats: dict) -> int:
    import zmq

    ctx = zmq.Context(io_threads=1)
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.MAXMSGSIZE, CAP)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port(f"tcp://{HOST}")
    reply = b"r" * down

    def loop():
        seqs: dict[bytes, int] = {}
        count = _counter(stats)
        while True:
            frames = sock.recv_multipart(copy=False)
            if len(frames) != 3:
                stats["refused"] += 1
                continue
            peer, mac, body = frames
            ident = peer.bytes
            seq = seqs.get(ident, 0)
            try:
                _check(key, mac.buffer, body.buffer, seq)
            except Refused:
                stats["refused"] += 1
                continue
            seqs[ident] = seq + 1
            out = _body(seq, reply)
            count[0] += 1
            sock.send_multipart([peer, _mac(key, out), out], copy=False)

    threading.Thread(target=loop, daemon=True).start()
    return port


class Framed:
    """One TCP connection's frames: ``u32 length | MAC (32) | body``, the body ``u64 number |
    payload``; the length is checked against the cap before the body is read."""

    def __init__(self, sock: socket.socket, key: bytes):
        self.sock, self.key = sock, key
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray(1 << 16)
        self.view = memoryview(self.buf)
        self.have = 0  # bytes received, from the start of the frame being read
        self.sent = self.got = 0  # frames written and read

    def send(self, payload: bytes) -> None:
        body = _body(self.sent, payload)
        self.sent += 1
        self.sock.sendmsg([_LEN.pack(len(body)), _mac(self.key, body), body])

    def frame(self):
        """The next frame's payload if it is all in the buffer (None: not yet)."""
        if self.have < 4 + MAC:
            return None
        (n,) = _LEN.unpack_from(self.buf)
        if n > CAP or n < _SEQ.size:
            raise Refused(f"frame of {n} bytes")
        end = 4 + MAC + n
        if end > len(self.buf):  # a larger frame than the buffer: grow it (up to the cap)
            self.buf.extend(bytes(end - len(self.buf)))
            self.view = memoryview(self.buf)
        if self.have < end:
            return None
        body = bytes(self.view[4 + MAC:end])
        _check(self.key, self.view[4:4 + MAC], body, self.got)
        self.got += 1
        rest = self.have - end
        if rest:
            self.buf[:rest] = self.buf[end:self.have]
        self.have = rest
        return body[_SEQ.size:]

    def fill(self) -> bool:
        """One ``recv`` into the buffer; False at the peer's end."""
        n = self.sock.recv_into(self.view[self.have:])
        self.have += n
        return n > 0

    def read(self):
        """The next frame's payload, blocking; None at the peer's end."""
        while True:
            out = self.frame()
            if out is not None:
                return out
            if not self.fill():
                return None


def serve_socket_threads(key: bytes, down: int, stats: dict) -> int:
    lsock = socket.create_server((HOST, 0))
    reply = b"r" * down

    def conn(s):
        f, count = Framed(s, key), _counter(stats)
        try:
            while f.read() is not None:
                count[0] += 1
                f.send(reply)
        except (Refused, OSError):
            stats["refused"] += 1
        s.close()

    def accept():
        while True:
            s, _ = lsock.accept()
            threading.Thread(target=conn, args=(s,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return lsock.getsockname()[1]


def serve_socket_selector(key: bytes, down: int, stats: dict) -> int:
    lsock = socket.create_server((HOST, 0))
    reply = b"r" * down
    sel = selectors.DefaultSelector()
    sel.register(lsock, selectors.EVENT_READ, None)

    def loop():
        count = _counter(stats)
        while True:
            for k, _ in sel.select():
                if k.data is None:
                    s, _ = lsock.accept()
                    sel.register(s, selectors.EVENT_READ, Framed(s, key))
                    continue
                f = k.data
                try:
                    alive = f.fill()  # readable: this recv does not block
                    while alive:
                        msg = f.frame()
                        if msg is None:
                            break
                        count[0] += 1
                        f.send(reply)  # blocking send: a reply fits the socket's buffer
                except (Refused, OSError):
                    stats["refused"] += 1
                    alive = False
                if not alive:
                    sel.unregister(f.sock)
                    f.sock.close()

    threading.Thread(target=loop, daemon=True).start()
    return lsock.getsockname()[1]


SERVERS = {"flight": serve_flight, "zmq": serve_zmq, "socket-threads": serve_socket_threads,
           "socket-selector": serve_socket_selector}


def server_main(wire: str, down: int) -> None:
    """A server child: the secret on stdin's first line, its port on stdout; then each line of
    stdin asks for ``cpu_seconds messages refused`` so far."""
    key = bytes.fromhex(sys.stdin.readline().strip())
    stats = {"counts": [], "refused": 0}
    print(SERVERS[wire](key, down, stats), flush=True)
    for _ in sys.stdin:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        answered = sum(c[0] for c in list(stats["counts"]))
        print(ru.ru_utime + ru.ru_stime, answered, stats["refused"], flush=True)


# ---- the clients: one stream each, a thread of a client process ---------------------------------

class FlightStream:
    def __init__(self, port: int, key: bytes):
        import pyarrow as pa
        import pyarrow.flight as fl

        self.client = fl.connect(f"grpc+tcp://{HOST}:{port}")
        opts = fl.FlightCallOptions(headers=[(b"authorization", b"Bearer " + key.hex().encode())])
        self.writer, self.reader = self.client.do_exchange(fl.FlightDescriptor.for_command(b"floor"), opts)
        self.pa = pa

    def exchange(self, payload: bytes) -> None:
        self.writer.write_metadata(self.pa.py_buffer(payload))
        self.reader.read_chunk()

    def close(self) -> None:
        self.writer.done_writing()
        self.writer.close()
        self.client.close()


class ZmqStream:
    def __init__(self, port: int, key: bytes, ctx):
        import zmq

        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, CAP)
        self.sock.connect(f"tcp://{HOST}:{port}")
        self.key, self.sent, self.got = key, 0, 0

    def exchange(self, payload: bytes) -> None:
        body = _body(self.sent, payload)
        self.sent += 1
        self.sock.send_multipart([_mac(self.key, body), body], copy=False)
        mac, reply = self.sock.recv_multipart(copy=False)
        _check(self.key, mac.buffer, reply.buffer, self.got)
        self.got += 1

    def close(self) -> None:
        self.sock.close()


class SocketStream:
    def __init__(self, port: int, key: bytes):
        self.f = Framed(socket.create_connection((HOST, port)), key)

    def exchange(self, payload: bytes) -> None:
        self.f.send(payload)
        if self.f.read() is None:
            raise ConnectionError("server closed the stream")

    def close(self) -> None:
        self.f.sock.close()


def client_main() -> None:
    """A client child: its JSON config on stdin's first line (wire, port, secret, streams, rate,
    messages, up, seed); "ready" once connected and warmed up; on a line "go" the streams run;
    then their results as one JSON line; on the next line (or EOF) they close."""
    cfg = json.loads(sys.stdin.readline())
    key, port, wire = bytes.fromhex(cfg["secret"]), cfg["port"], cfg["wire"]
    ctx = None
    if wire == "zmq":
        import zmq

        ctx = zmq.Context(io_threads=1)
    streams = [FlightStream(port, key) if wire == "flight" else ZmqStream(port, key, ctx) if wire == "zmq"
               else SocketStream(port, key) for _ in range(cfg["streams"])]
    payload = b"u" * cfg["up"]
    for s in streams:
        for _ in range(WARMUP):
            s.exchange(payload)
    print("ready", flush=True)
    sys.stdin.readline()
    rng = random.Random(cfg["seed"])
    rate, n = cfg["rate"], cfg["messages"]
    t0 = time.perf_counter() + 0.05
    out = [None] * len(streams)

    def run(i: int, s, phase: float) -> None:
        lat, cpu, tick = [], 0.0, t0 + phase
        for _ in range(n):
            if rate > 0:
                time.sleep(max(0.0, tick - time.perf_counter()))
                tick += 1.0 / rate
            c, t = time.thread_time(), time.perf_counter()
            s.exchange(payload)
            lat.append(time.perf_counter() - t)
            cpu += time.thread_time() - c
        out[i] = (lat, cpu)

    threads = [threading.Thread(target=run, args=(i, s, rng.random() / rate if rate > 0 else 0.0))
               for i, s in enumerate(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    print(json.dumps({"latency_s": [x for lat, _ in out for x in lat], "cpu_s": sum(c for _, c in out),
                      "wall_s": wall}), flush=True)
    sys.stdin.readline()
    for s in streams:
        s.close()
    if ctx is not None:
        ctx.term()


# ---- the orchestration -------------------------------------------------------------------------

def _child(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def _say(p: subprocess.Popen, line: str) -> str:
    p.stdin.write(line + "\n")
    p.stdin.flush()
    return p.stdout.readline()


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def one(wire: str, streams: int, rate: float, messages: int, up: int, down: int, seed: int) -> dict:
    """One repetition of a case: a fresh server, ``streams`` streams of ``messages`` each."""
    key = secrets.token_bytes(32)
    server = _child("--child", "server", wire, str(down))
    clients: list[subprocess.Popen] = []
    try:
        port = int(_say(server, key.hex()))
        procs = -(-streams // PER_PROC)
        for i in range(procs):
            c = _child("--child", "client")
            clients.append(c)
            share = streams // procs + (i < streams % procs)
            c.stdin.write(json.dumps({"wire": wire, "port": port, "secret": key.hex(), "streams": share,
                                      "rate": rate, "messages": messages, "up": up,
                                      "seed": seed * 1000 + i}) + "\n")
            c.stdin.flush()
        for c in clients:
            if c.stdout.readline().strip() != "ready":
                raise RuntimeError(f"{wire}: a client did not start")
        before = _say(server, "").split()
        for c in clients:
            c.stdin.write("go\n")
            c.stdin.flush()
        results = [json.loads(c.stdout.readline()) for c in clients]
        after = _say(server, "").split()
        for c in clients:
            c.stdin.write("end\n")
            c.stdin.flush()
            c.wait(timeout=30)
    finally:
        for p in [*clients, server]:
            if p.poll() is None:
                p.kill()
            p.wait()
    lat = [x for r in results for x in r["latency_s"]]
    sent = len(lat)
    answered = int(after[1]) - int(before[1])
    return {"messages": sent, "answered": answered, "refused": int(after[2]) - int(before[2]),
            "server_cpu_ms_per_message": 1000 * (float(after[0]) - float(before[0])) / max(1, answered),
            "reply_ms_p50": 1000 * _quantile(lat, 0.5), "reply_ms_p99": 1000 * _quantile(lat, 0.99),
            "client_cpu_ms_per_message": 1000 * sum(r["cpu_s"] for r in results) / sent,
            "messages_per_s": sent / max(r["wall_s"] for r in results)}


FIGURES = ("server_cpu_ms_per_message", "reply_ms_p50", "reply_ms_p99", "client_cpu_ms_per_message",
           "messages_per_s")


def _busy_s() -> float:
    """CPU seconds the machine's cores have been busy (every process), from /proc/stat."""
    with open("/proc/stat", encoding="ascii") as fh:
        f = [int(x) for x in fh.readline().split()[1:]]
    idle = f[3] + (f[4] if len(f) > 4 else 0)
    return (sum(f[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_s() -> float:
    """CPU seconds of this process and its children that ended."""
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def _fail(what: str) -> None:
    print(f"bench/flightfloor.py: {what}", file=sys.stderr)
    raise SystemExit(2)


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wires", default=",".join(WIRES), help=f"comma-separated, of {', '.join(WIRES)}")
    ap.add_argument("--rates", default="1,16,100,1000",
                    help="messages/s per stream, comma-separated (0: back to back)")
    ap.add_argument("--streams", type=int, default=2, help="streams of the --rates cases")
    ap.add_argument("--fanout", default="64x16", help="STREAMSxRATE: one more case ('' for none)")
    ap.add_argument("--seconds", type=float, default=3.0, help="how long a stream sends")
    ap.add_argument("--min-messages", type=int, default=8, help="messages per stream at least")
    ap.add_argument("--up", type=int, default=4428, help="bytes per message sent")
    ap.add_argument("--down", type=int, default=9229, help="bytes per reply")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--load", type=int, default=0, help="busy processes beside the exchange")
    a = ap.parse_args(argv)
    wires = a.wires.split(",")
    if any(w not in WIRES for w in wires) or len(set(wires)) != len(wires):
        _fail(f"--wires {a.wires} must name each of {', '.join(WIRES)} at most once")
    try:
        rates = [float(r) for r in a.rates.split(",")]
        fanout = [tuple(float(x) for x in a.fanout.lower().split("x"))] if a.fanout else []
    except ValueError:
        rates, fanout = [-1.0], []
    if min(rates) < 0:
        _fail(f"--rates {a.rates} must be numbers >= 0")
    if a.fanout and (len(fanout) != 1 or len(fanout[0]) != 2 or fanout[0][0] < 1 or fanout[0][1] <= 0
                     or fanout[0][0] != int(fanout[0][0])):
        _fail(f"--fanout {a.fanout} must be STREAMSxRATE, streams >= 1 and rate > 0")
    for bad, what in ((min(a.streams, a.up, a.down, a.reps, a.min_messages) < 1,
                       "--streams, --up, --down, --reps and --min-messages must be >= 1"),
                      (max(a.up, a.down) + _SEQ.size > CAP, f"--up and --down must fit {CAP} bytes"),
                      (a.seconds <= 0, f"--seconds {a.seconds:g} must be > 0"),
                      (a.load < 0, f"--load {a.load} must be >= 0")):
        if bad:
            _fail(what)
    cases = [(a.streams, r) for r in rates] + [(int(s), r) for s, r in fanout]
    return a, wires, cases


def _compare(by: dict, wires: list[str], cases: list, judged: bool) -> tuple[dict, dict]:
    against, better = {}, {}
    if "flight" not in wires:
        return against, better
    for w in wires:
        if w == "flight":
            continue
        rows = []
        for s, r in cases:
            mine, base = by[(w, s, r)], by[("flight", s, r)]
            rows.append({"streams": s, "rate_per_stream": r,
                         **{k: mine[k] / base[k] if base[k] else None for k in FIGURES[:3]}})
        against[w] = rows
        ok = all(x["server_cpu_ms_per_message"] < 1 and x["reply_ms_p50"] <= 1 for x in rows)
        better[w] = ok if judged else None
    return against, better


def main(argv=None) -> dict:
    a, wires, cases = _args(argv)
    load = [subprocess.Popen([sys.executable, "-c", LOAD]) for _ in range(a.load)]
    busy0, own0, t0 = _busy_s(), _own_s(), time.perf_counter()
    reps: dict = {(w, s, r): [] for s, r in cases for w in wires}
    try:
        for i in range(a.reps):
            for s, r in cases:
                n = max(a.min_messages, int(round(r * a.seconds))) if r > 0 else max(a.min_messages, 300)
                for w in wires:
                    reps[(w, s, r)].append(one(w, s, r, n, a.up, a.down, seed=i))
    finally:
        for p in load:
            p.kill()
            p.wait()
    wall, others = time.perf_counter() - t0, (_busy_s() - busy0) - (_own_s() - own0)
    by = {k: {f: statistics.median(x[f] for x in v) for f in FIGURES} for k, v in reps.items()}
    out_cases = [{"wire": w, "streams": s, "rate_per_stream": r, "repetitions": reps[(w, s, r)],
                  **by[(w, s, r)], "reply_ms_p99_each": [x["reply_ms_p99"] for x in reps[(w, s, r)]]}
                 for s, r in cases for w in wires]
    judged = a.reps >= MIN_REPS
    against, better = _compare(by, wires, cases, judged)
    out = {"bench": "flightfloor", "wires": wires, "streams": a.streams, "fanout": a.fanout,
           "up_bytes": a.up, "down_bytes": a.down, "cap_bytes": CAP, "load_processes": a.load,
           "seconds_per_case": a.seconds, "min_messages_per_stream": a.min_messages, "reps": a.reps,
           "authentication": {"flight": "bearer token, checked by middleware at each call (stream)",
                              **{w: "HMAC-SHA256 of each frame under the run's secret, both ways, "
                                    "with the frame's number" for w in wires if w != "flight"}},
           "cases": out_cases, "against_flight": against, "judged": judged,
           "better_than_flight": better,
           "machine": {"wall_s": wall, "other_processes_cpu_s": others,
                       "other_processes_cores": others / wall if wall > 0 else None,
                       "shared": others / wall > 0.1 if wall > 0 else None,
                       "loadavg_at_end": list(os.getloadavg())}}
    emit(out)
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        if sys.argv[2] == "server":
            server_main(sys.argv[3], int(sys.argv[4]))
        else:
            client_main()
    else:
        main()
