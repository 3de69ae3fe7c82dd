"""The floor of the stream's transport: server CPU per message of a bare Arrow Flight exchange.

Prints one JSON object. A Flight server in a child process answers every metadata message of
a ``DoExchange`` stream with one metadata message, as the parameter-server service does, but
does nothing else: no decoding, no engine, no reply to build. ``--streams`` client threads in
this process each keep one message in flight, sending ``--up`` bytes and reading ``--down``
bytes back (defaults: a median push and reply of the 0.2 M model at uplink density 0.001 and
downlink 0.01, ``bench/psload.py``). The server's CPU (user + system, all its threads, from
``getrusage``) over ``--messages`` messages after a warm-up, per message, is what any per-push
work of the real service adds to; ``--reps`` repetitions, their median reported. The clients'
own CPU per message (``time.thread_time`` of their threads: a task's push thread does the same
calls) is reported beside it.

``--rates``: messages per second per stream, each a case of its own (0, the default: as fast as
the exchange goes). A paced stream sends its message at each tick of its rate and runs for
``--seconds``. The stream at ten steps per exchange pushes about 10-20 times a second per
block, at one step 75-150: paced cases show what one message costs the server when the cores
sit idle between messages, against back to back. ``--load K`` keeps K more processes busy
on a numpy loop over 8 MB meanwhile, as TensorFlow's steps keep the cores of a real run.

    python bench/flightfloor.py [--messages 4000] [--streams 2] [--up 4428] [--down 9229] [--reps 5]
                                [--rates 0,200,20] [--seconds 10] [--load 0]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import emit  # noqa: E402

SERVER = r"""
import resource, sys
import pyarrow as pa
import pyarrow.flight as fl

reply = pa.py_buffer(b"r" * int(sys.argv[1]))

class Echo(fl.FlightServerBase):
    def do_exchange(self, context, descriptor, reader, writer):
        while True:
            try:
                reader.read_chunk()
            except StopIteration:
                return
            writer.write_metadata(reply)

server = Echo("grpc://127.0.0.1:0")
print(server.port, flush=True)
for line in sys.stdin:  # each line: report this process's CPU seconds so far
    ru = resource.getrusage(resource.RUSAGE_SELF)
    print(ru.ru_utime + ru.ru_stime, flush=True)
"""


# a busy process of --load: a numpy pass over 8 MB, again and again, until killed
LOAD = "import numpy as np\na = np.ones(2 << 20, np.float32)\nwhile True:\n    a *= 1.0000001\n"


def _client(port: int, n: int, up: int, rate: float = 0.0, cpu: list | None = None) -> None:
    """``n`` messages of ``up`` bytes on one stream, each answered before the next; paced at
    ``rate`` per second when it is above 0. The thread's CPU in the exchange goes to ``cpu``."""
    import pyarrow as pa
    import pyarrow.flight as fl

    client = fl.connect(f"grpc://127.0.0.1:{port}")
    writer, reader = client.do_exchange(fl.FlightDescriptor.for_command(b"floor"))
    msg = pa.py_buffer(b"u" * up)
    spent, tick = 0.0, time.perf_counter()
    for _ in range(n):
        if rate > 0:
            tick += 1.0 / rate
            time.sleep(max(0.0, tick - time.perf_counter()))
        t = time.thread_time()
        writer.write_metadata(msg)
        reader.read_chunk()
        spent += time.thread_time() - t
    writer.done_writing()
    writer.close()
    client.close()
    if cpu is not None:
        cpu.append(spent)


def one(messages: int, streams: int, up: int, down: int, rate: float = 0.0) -> dict:
    """One repetition: ``messages`` in all over ``streams`` streams (each paced at ``rate``)."""
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(down)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())

        def cpu() -> float:
            proc.stdin.write("\n")
            proc.stdin.flush()
            return float(proc.stdout.readline())

        _client(port, 300, up)  # warm-up: connections, allocations
        client_cpu: list[float] = []
        c0, t0 = cpu(), time.perf_counter()
        threads = [threading.Thread(target=_client, args=(port, messages // streams, up, rate, client_cpu))
                   for _ in range(streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall, c1 = time.perf_counter() - t0, cpu()
        sent = streams * (messages // streams)
        return {"server_cpu_ms_per_message": 1000 * (c1 - c0) / sent, "messages_per_s": sent / wall,
                "client_cpu_ms_per_message": 1000 * sum(client_cpu) / sent, "messages": sent}
    finally:
        proc.kill()
        proc.wait()


def case(a, rate: float) -> dict:
    """``--reps`` repetitions at ``rate`` per stream (0: back to back), their medians."""
    messages = a.messages if rate <= 0 else max(a.streams, int(round(rate * a.seconds)) * a.streams)
    reps = [one(messages, a.streams, a.up, a.down, rate) for _ in range(a.reps)]
    return {"rate_per_stream": rate, "repetitions": reps,
            **{k: statistics.median(r[k] for r in reps)
               for k in ("server_cpu_ms_per_message", "client_cpu_ms_per_message", "messages_per_s")}}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=4000)
    ap.add_argument("--streams", type=int, default=2)
    ap.add_argument("--up", type=int, default=4428, help="bytes per message sent")
    ap.add_argument("--down", type=int, default=9229, help="bytes per reply")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rates", default="0", help="messages/s per stream, comma-separated (0: back to back)")
    ap.add_argument("--seconds", type=float, default=10.0, help="how long a paced case runs")
    ap.add_argument("--load", type=int, default=0, help="busy processes beside the exchange")
    a = ap.parse_args(argv)
    if min(a.messages, a.streams, a.up, a.down, a.reps) < 1:
        print("bench/flightfloor.py: --messages, --streams, --up, --down and --reps must be >= 1", file=sys.stderr)
        raise SystemExit(2)
    try:
        rates = [float(r) for r in a.rates.split(",")]
    except ValueError:
        rates = [-1.0]
    for bad, what in ((min(rates) < 0, f"--rates {a.rates} must be numbers >= 0"),
                      (a.seconds <= 0, f"--seconds {a.seconds:g} must be > 0"),
                      (a.load < 0, f"--load {a.load} must be >= 0")):
        if bad:
            print(f"bench/flightfloor.py: {what}", file=sys.stderr)
            raise SystemExit(2)
    load = [subprocess.Popen([sys.executable, "-c", LOAD]) for _ in range(a.load)]
    try:
        cases = [case(a, r) for r in rates]
    finally:
        for p in load:
            p.kill()
            p.wait()
    first = cases[0]
    out = {"bench": "flightfloor", "streams": a.streams, "up_bytes": a.up, "down_bytes": a.down,
           "load_processes": a.load, "seconds_per_paced_case": a.seconds, "cases": cases,
           # the first case's figures at the top, as before --rates
           "repetitions": first["repetitions"], "server_cpu_ms_per_message": first["server_cpu_ms_per_message"],
           "messages_per_s": first["messages_per_s"]}
    emit(out)
    return out


if __name__ == "__main__":
    main()
