"""The load generator of ``bench/psload.py``: synthetic workers replaying real encoded deltas.

A recording first (``record_deltas``: the results a real in-process run of the model returned,
kept as length-prefixed records), then, in one child process per 16 workers, one thread per
worker (block) that opens its stream to the server, replays the recorded deltas one push in
flight, and reports each push's send time and reply latency, as one JSON line on stdout.

The job a process reads on stdin names the server's ``ticket``: its address and token, with
``ps.shards`` the shards' addresses (each delta is then sent as one piece per shard, split
beforehand), and with ``ps.servers`` each block's own server (``servers``: block -> address,
what the stream's ticket of that block's task would carry).
"""

from __future__ import annotations

import json
import os
import struct
import sys
import threading
import time

BATCH = 2  # samples per push: only the server's bookkeeping reads it; small so a block holds many steps


# -- recorded deltas -------------------------------------------------------------------------------
def record_deltas(data: str, density: float, count: int, out_dir: str) -> list[dict]:
    """``count`` pushes of a real in-process run (jobs transport, async, one step per exchange, the
    same model and compression): payload bytes, nnz, loss and correct counts of the results its
    jobs returned, which the run accepted as they came (the backend the run is handed keeps them)."""
    from sparkcnn import config
    from sparkcnn.backends.inprocess import LocalBackend
    from sparkcnn.protocol import ExchangeResult
    from sparkcnn.train import train

    cfg = config.load(None, [f"data.path={data}", f"run.out_dir={out_dir}", "run.name=psload-record",
                             "engine.master=inprocess", "engine.mode=async", "train.epochs=1",
                             "train.steps_per_round=1", "data.num_blocks=2", "compression.method=threshold",
                             f"compression.density={density}", "compression.density_down=0.01",
                             "compression.warmup_epochs=0", "scheduler.target_job_seconds=0.001"])
    got: list[dict] = []

    class Recording(LocalBackend):
        """The in-process backend, keeping the first ``count`` training results its jobs return."""

        def map_blocks(self, fn, blocks, description="", universe=None, split="train"):
            out = super().map_blocks(fn, blocks, description, universe, split)
            for r in out:
                if isinstance(r, ExchangeResult) and len(got) < count:
                    got.append({"payload": bytes(r.payload), "nnz": int(r.nnz), "loss_sum": float(r.loss_sum),
                                "correct": int(r.correct), "samples": int(r.samples)})
            return out

    train(cfg, backend=Recording("psload-record"))
    return got


def write_deltas(deltas: list[dict], path: str) -> None:
    """Length-prefixed records: u32 header length, JSON header, u64 payload length, payload."""
    with open(path, "wb") as fh:
        for d in deltas:
            h = json.dumps({k: v for k, v in d.items() if k != "payload"}).encode()
            fh.write(struct.pack("<I", len(h)) + h + struct.pack("<Q", len(d["payload"])) + d["payload"])


def read_deltas(path: str) -> list[dict]:
    out, buf, i = [], open(path, "rb").read(), 0
    while i < len(buf):
        (n,), i = struct.unpack_from("<I", buf, i), i + 4
        d, i = json.loads(buf[i:i + n]), i + n
        (m,), i = struct.unpack_from("<Q", buf, i), i + 8
        d["payload"], i = buf[i:i + m], i + m
        out.append(d)
    return out


# -- the load generator (a child process) ----------------------------------------------------------
def _split(deltas: list[dict], layout: list[int], k: int, value_dtype: str) -> None:
    """K > 1: each recorded delta's pieces (codec bytes per shard) and their squared norms."""
    from sparkcnn.compression import codec
    from sparkcnn.shards import shard_ranges, split_delta, sum_squares

    ranges = shard_ranges(layout, k)
    for d in deltas:
        whole = codec.decode(d["payload"], layout)
        pieces = [codec.encode(p, layout, value_dtype=value_dtype) for p in split_delta(whole, ranges)]
        d["pieces"] = pieces
        d["sumsq"] = tuple(sum_squares(codec.decode(p, layout)) for p in pieces)


def _worker(ticket: dict, block: int, n: int, deltas: list[dict], interval: float, t_start: float,
            out: dict) -> None:
    from sparkcnn import streamsocket
    from sparkcnn.protocol import Done, Piece, Push, Reply, ShardReply
    from sparkcnn.streamwire import decode, encode

    def stream(host, port, hello):
        return streamsocket.connect(host, port, ticket["token"], json.dumps(hello).encode(), 60)

    host, port = ticket.get("servers", {}).get(str(block), (ticket["host"], ticket["port"]))
    conn = stream(host, port, {"block": block})  # ps.servers: the block's own server
    got = {"down": 0, "up": 0}

    def read(c=None, kind=Reply):
        md = (c or conn).read()
        got["down"] += len(md)
        return decode(md, (kind,))

    def send(c, msg):
        buf = encode(msg)
        got["up"] += len(buf)
        c.write(buf)

    reply = read()
    plan = reply.plan
    have = reply.dense_version
    shards = [stream(h, p, {"stream": plan.stream}) for h, p in ticket.get("shards", ())]
    for c in shards:  # the first view's pieces
        send(c, Piece(plan.stream, -1, -1, b""))
    for c in shards:
        read(c, ShardReply)
    seq, step, left = plan.seq0, plan.first_step, plan.steps
    sent = dropped = refused = 0
    lat: list[tuple[float, float]] = []  # (send time, reply seconds)
    k = block * 7919  # each block starts elsewhere in the recording
    while left > 0:
        slot = t_start + (sent + block / n) * interval  # the workers' slots interleaved
        now = time.perf_counter()
        if slot > now:
            time.sleep(slot - now)
        d = deltas[k % len(deltas)]
        k += 1
        push = Push(seq=seq, first_step=step, steps=1, samples=BATCH, base_version=have, have=have, attempt=0,
                    lr=reply.lr, density=reply.density, loss_sum=d["loss_sum"] * BATCH / d["samples"],
                    correct=min(BATCH, d["correct"]), nnz=d["nnz"], compute_s=0.02, wait_s=0.0, view_bytes=0,
                    state_reset=False, replica_resync=False, pid=os.getpid(), executor="psload:0",
                    payload=b"" if shards else d["payload"], state=(), sumsq=d["sumsq"] if shards else ())
        t0 = time.perf_counter()
        for c, piece in zip(shards, d.get("pieces", ())):  # the pieces first, as a task sends them
            send(c, Piece(plan.stream, sent, have, piece))
        send(conn, push)
        reply = read()
        for c in shards:
            read(c, ShardReply)
        lat.append((t0, time.perf_counter() - t0))
        sent += 1
        if shards:  # the shards' parts bring a replica to the version the reply names
            have = reply.dense_version
        elif reply.dense:
            have = reply.dense_version
        elif reply.downlinks:
            have = reply.downlinks[-1].version
        if reply.refused:
            refused += 1
        if reply.retrain:
            dropped += 1
            continue
        seq, step, left = seq + 1, step + 1, left - 1
    for c in [conn, *shards]:
        c.write(encode(Done()))
        c.close()
    out[block] = {"lat": lat, "sent": sent, "dropped": dropped, "refused": refused, **got}


def client_main() -> None:
    """One load-generator process: reads its job (ticket, blocks, rate, deltas file) as JSON on stdin,
    prints one JSON line of per-push send times and reply latencies."""
    job = json.loads(sys.stdin.read())
    deltas = read_deltas(job["deltas"])
    if job["ticket"].get("shards"):
        _split(deltas, job["layout"], len(job["ticket"]["shards"]), job["value_dtype"])
    n = len(job["blocks"])
    n_all = job["workers"]
    interval = n_all / job["rate"] if job["rate"] > 0 else 0.0
    out: dict = {}
    c0 = time.process_time()
    t_start = job["t_start"]  # the same instant in every load-generator process (a monotonic clock)
    threads = [threading.Thread(target=_worker,
                                args=(job["ticket"], b, n_all, deltas, interval, t_start, out))
               for b in job["blocks"]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if len(out) != n:
        raise SystemExit(f"psload: {n - len(out)} workers failed")
    print(json.dumps({"cpu_s": time.process_time() - c0, "workers": {str(b): v for b, v in out.items()}}))
