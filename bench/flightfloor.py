"""The floor of the stream's transport: server CPU per message of a bare Arrow Flight exchange.

Prints one JSON object. A Flight server in a child process answers every metadata message of
a ``DoExchange`` stream with one metadata message, as the parameter-server service does, but
does nothing else: no decoding, no engine, no reply to build. ``--streams`` client threads in
this process each keep one message in flight, sending ``--up`` bytes and reading ``--down``
bytes back (defaults: a median push and reply of the 0.2 M model at uplink density 0.001 and
downlink 0.01, ``bench/psload.py``). The server's CPU (user + system, all its threads, from
``getrusage``) over ``--messages`` messages after a warm-up, per message, is what any per-push
work of the real service adds to; ``--reps`` repetitions, their median reported.

    python bench/flightfloor.py [--messages 4000] [--streams 2] [--up 4428] [--down 9229] [--reps 5]
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


def _client(port: int, n: int, up: int) -> None:
    import pyarrow as pa
    import pyarrow.flight as fl

    client = fl.connect(f"grpc://127.0.0.1:{port}")
    writer, reader = client.do_exchange(fl.FlightDescriptor.for_command(b"floor"))
    msg = pa.py_buffer(b"u" * up)
    for _ in range(n):
        writer.write_metadata(msg)
        reader.read_chunk()
    writer.done_writing()
    writer.close()
    client.close()


def one(messages: int, streams: int, up: int, down: int) -> dict:
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(down)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())

        def cpu() -> float:
            proc.stdin.write("\n")
            proc.stdin.flush()
            return float(proc.stdout.readline())

        _client(port, 300, up)  # warm-up: connections, allocations
        c0, t0 = cpu(), time.perf_counter()
        threads = [threading.Thread(target=_client, args=(port, messages // streams, up)) for _ in range(streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall, c1 = time.perf_counter() - t0, cpu()
        sent = streams * (messages // streams)
        return {"server_cpu_ms_per_message": 1000 * (c1 - c0) / sent, "messages_per_s": sent / wall,
                "messages": sent}
    finally:
        proc.kill()
        proc.wait()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=4000)
    ap.add_argument("--streams", type=int, default=2)
    ap.add_argument("--up", type=int, default=4428, help="bytes per message sent")
    ap.add_argument("--down", type=int, default=9229, help="bytes per reply")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args(argv)
    if min(a.messages, a.streams, a.up, a.down, a.reps) < 1:
        print("bench/flightfloor.py: --messages, --streams, --up, --down and --reps must be >= 1", file=sys.stderr)
        raise SystemExit(2)
    reps = [one(a.messages, a.streams, a.up, a.down) for _ in range(a.reps)]
    out = {"bench": "flightfloor", "streams": a.streams, "up_bytes": a.up, "down_bytes": a.down,
           "repetitions": reps,
           "server_cpu_ms_per_message": statistics.median(r["server_cpu_ms_per_message"] for r in reps),
           "messages_per_s": statistics.median(r["messages_per_s"] for r in reps)}
    emit(out)
    return out


if __name__ == "__main__":
    main()
