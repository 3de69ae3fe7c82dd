"""Load on the parameter server: N synthetic workers replay real encoded deltas over the real wire.

Prints one JSON object. The server is the real one: ``StreamEngine`` (async, one step per
exchange, GS-ASGD + MS: uplink ``--density``, downlink 0.01, no warm-up) behind its
service, in this process, with nothing else running in it. The workers are synthetic: one
load generator (``bench/_loadgen.py``, beside the server on the same cores: one process per 16 workers, whose threads
would otherwise queue behind each other for one interpreter lock) opens one authenticated stream per block and replays, block by block, deltas that a real run of the
same model and settings encoded (recorded first, in this process, through the exchange core).
Each worker keeps one push in flight, follows its replica's version through the replies'
downlinks (so the server sends what it sends real workers), echoes the offered lr and
density, and trains a dropped push "again" by sending the next recorded delta for the same
steps. With ``--rate R`` the workers together offer R pushes/s (each at R/N, a push no
earlier than its slot); ``--rate 0`` sends as fast as replies come.

For each N (``--workers``) and K (``--shards``: ``ps.shards``; with K > 1 each worker sends
its recorded delta as one piece per shard, split beforehand, and merges nothing: it follows
the version the replies name), over the middle of the run (the first and last 10 % of
pushes left out, in the order their workers read the replies): ``pushes_per_s`` sustained,
``reply_ms`` p50/p99 (push sent to reply read, at the worker), ``server_cpu_ms_per_push`` (the
CPU of this process, the engine's handler and the connections' threads, plus that of the shard
processes, each sampled every 10 ms and read at the window's ends, over the window / pushes
in it; apart:
``coordinator_cpu_ms_per_push`` and ``shard_cpu_ms_per_push``, one per shard; the load
generator's CPU is its own, ``client_cpu_ms_per_push``),
``bytes_per_push`` each way (the whole messages, downlinks and start replies included),
``dropped`` (too stale: trained again) and ``refused`` (should be 0). Each case runs ``--reps``
times (default 5); its figures are the medians of the repetitions' (``each`` keeps theirs), and
the target is judged on those medians.

    python bench/psload.py [--workers 2 4 8 16 32 64] [--rate 1050] [--pushes 4000] [--reps 5] [--quick]
                           [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import ROOT, emit, ensure_data, exit_status, log, median, slice_data  # noqa: E402
from bench._loadgen import BATCH, client_main, record_deltas, write_deltas  # noqa: E402
SETTINGS = ["engine.transport=stream", "engine.mode=async", "train.steps_per_round=1",
            "compression.method=threshold", "compression.density_down=0.01", "compression.warmup_epochs=0",
            "compression.momentum=correction"]
TARGET_PUSHES_PER_S, TARGET_P99_MS = 1000.0, 50.0
PER_PROCESS = 16  # workers per load-generator process: 64 threads under one GIL queue behind each other
OFFERED = 1050.0  # pushes/s offered by default: a little over the target, so that meeting it shows


# -- the server side -------------------------------------------------------------------------------
class _Cpu:
    """This process's CPU (the engine's handler and the connections' threads) and, with shards, each shard
    process's, sampled every 10 ms on a thread; read at a time by interpolation."""

    def __init__(self, engine):
        self.rows: list[tuple[float, float]] = []                # (time, this process's CPU seconds)
        self.shard_rows: list[tuple[float, list[float]]] = []   # (time, each shard's CPU seconds)
        self.engine, self.stop = engine, threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()

    def sample(self) -> None:
        tick = os.sysconf("SC_CLK_TCK")
        while not self.stop.wait(0.01):
            self.rows.append((time.perf_counter(), time.process_time()))
            shards = self.engine.server.shards
            if shards is None:
                continue
            cpu = []
            for p in shards.procs:
                try:
                    with open(f"/proc/{p.proc.pid}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    cpu.append((int(fields[11]) + int(fields[12])) / tick)
                except (OSError, IndexError, ValueError):
                    cpu = []
                    break
            if cpu:
                self.shard_rows.append((time.perf_counter(), cpu))

    def close(self) -> None:
        self.stop.set()
        self.thread.join()

    @staticmethod
    def _at(rows: list, t: float) -> list[float]:
        """The sampled values at ``t`` (linear between the samples around it)."""
        if not rows:
            return []
        after = next((i for i, (ti, _) in enumerate(rows) if ti >= t), len(rows) - 1)
        (t0, a), (t1, b) = rows[max(0, after - 1)], rows[after]
        f = 0.0 if t1 <= t0 else min(1.0, max(0.0, (t - t0) / (t1 - t0)))
        return [x + f * (y - x) for x, y in zip(a, b)]

    def own(self, t: float) -> float:
        """This process's CPU seconds at ``t``."""
        return self._at([(ti, [c]) for ti, c in self.rows], t)[0]

    def shard_cpu(self, t: float) -> list[float]:
        """Each shard's CPU seconds at ``t``."""
        return self._at(self.shard_rows, t)


def _load_backend(deltas_path: str, rate: float):
    from sparkcnn.backends.inprocess import LocalBackend
    from sparkcnn.protocol import StreamTotals

    class LoadBackend(LocalBackend):
        """In-process placement and evaluation; the stream's stage is the load generator."""

        engine = None
        client: dict | None = None

        def run_stage(self, fn, universe, description=""):
            svc = self.engine.service
            env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
            procs = max(1, -(-universe // PER_PROCESS))
            t_start = time.perf_counter() + 2.0  # after every process has opened its streams
            shards = self.engine.server.shards
            ticket = {"host": svc.host, "port": svc.port, "token": svc.token,
                      "shards": list(shards.locations) if shards is not None else []}
            jobs = [{"ticket": ticket, "workers": universe, "layout": list(self.engine.spec.layout),
                     "value_dtype": self.engine.spec.value_dtype,
                     "blocks": list(range(i, universe, procs)), "rate": rate, "deltas": deltas_path,
                     "t_start": t_start} for i in range(procs)]
            ps = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--client"], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in jobs]
            for p, job in zip(ps, jobs):  # every process has its job before any is waited for
                p.stdin.write(json.dumps(job))
                p.stdin.close()
            self.client = {"cpu_s": 0.0, "workers": {}, "processes": procs}
            for p in ps:
                stdout, stderr = p.stdout.read(), p.stderr.read()
                p.wait(timeout=1800)
                if p.returncode != 0:
                    raise RuntimeError(f"psload client failed: {stderr.strip().splitlines()[-1:]}")
                got = json.loads(stdout.strip().splitlines()[-1])
                self.client["cpu_s"] += got["cpu_s"]
                self.client["workers"].update(got["workers"])
            return [StreamTotals(block=int(b), exchanges=w["sent"], samples=w["sent"] * BATCH, last_seq=-1,
                                 exposed_comm_s=0.0, task_s=0.0) for b, w in self.client["workers"].items()]

    return LoadBackend


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_case(data_src: str, workers: int, pushes: int, rate: float, density: float, deltas_path: str,
             out_dir: str, shards: int = 1) -> dict:
    from sparkcnn import config
    from sparkcnn.train import build_engine

    rows = -(-pushes // workers) * workers * BATCH  # every block the same number of steps
    data = slice_data(data_src, rows, 500)
    cfg = config.load(None, [f"data.path={data}", f"run.out_dir={out_dir}", f"run.name=psload-{workers}",
                             f"data.num_blocks={workers}", f"train.batch_size={BATCH}", "train.epochs=1",
                             f"compression.density={density}", "checkpoint.every_rounds=0", f"ps.shards={shards}",
                             *SETTINGS])
    backend = _load_backend(deltas_path, rate)(f"psload-{workers}")
    engine, _ = build_engine(cfg, backend, f"psload-{workers}")
    backend.engine = engine
    cpu = _Cpu(engine)
    try:
        summary = engine.run()
    finally:
        cpu.close()
    client = backend.client
    # every push's answer, as its worker read it (perf_counter: one clock for all processes here)
    answered = sorted(t + ms for w in client["workers"].values() for t, ms in w["lat"])
    n = len(answered)
    lo, hi = n // 10, n - n // 10 - 1
    t_lo, t_hi = answered[lo], answered[hi]
    c_lo, c_hi = cpu.own(t_lo), cpu.own(t_hi)
    window = (t_lo, t_hi)
    lat = [ms for w in client["workers"].values() for t, ms in w["lat"] if window[0] <= t <= window[1]]
    sent = sum(w["sent"] for w in client["workers"].values())
    shard_ms = [1000 * (b - a) / (hi - lo) for a, b in zip(cpu.shard_cpu(t_lo), cpu.shard_cpu(t_hi))]
    if shards > 1 and len(shard_ms) != shards:
        raise RuntimeError("psload: the shard processes' CPU could not be read")
    coordinator_ms = 1000 * (c_hi - c_lo) / (hi - lo)
    return {"workers": workers, "shards": shards, "offered_pushes_per_s": rate or None, "pushes": n,
            "pushes_per_s": (hi - lo) / (t_hi - t_lo),
            "reply_ms": {"p50": 1000 * _pct(lat, 0.5), "p99": 1000 * _pct(lat, 0.99)},
            "server_cpu_ms_per_push": coordinator_ms + sum(shard_ms),
            "coordinator_cpu_ms_per_push": coordinator_ms, "shard_cpu_ms_per_push": shard_ms,
            "client_cpu_ms_per_push": 1000 * client["cpu_s"] / max(1, sent), "client_processes": client["processes"],
            "bytes_per_push": {way: sum(w[way] for w in client["workers"].values()) / max(1, sent)
                               for way in ("up", "down")},
            "dropped": sum(w["dropped"] for w in client["workers"].values()),
            "stale_dropped": summary.get("stale_dropped"),
            "refused": sum(w["refused"] for w in client["workers"].values()),
            "service": summary.get("stream"), "exchanges_applied": summary.get("rounds"),
            "layout": list(engine.spec.layout)}


def _median_case(reps: list[dict]) -> dict:
    """One case over its repetitions: each figure the median of the repetitions', each
    repetition's own figures kept (``repetitions``); counts of drops and refusals summed."""
    if len(reps) == 1:
        return {**reps[0], "repetitions": 1}
    out = dict(reps[-1])
    for key in ("pushes_per_s", "server_cpu_ms_per_push", "client_cpu_ms_per_push", "coordinator_cpu_ms_per_push"):
        out[key] = median([r[key] for r in reps])
    out["shard_cpu_ms_per_push"] = [median(x) for x in zip(*(r["shard_cpu_ms_per_push"] for r in reps))]
    out["reply_ms"] = {q: median([r["reply_ms"][q] for r in reps]) for q in ("p50", "p99")}
    out["bytes_per_push"] = {w: median([r["bytes_per_push"][w] for r in reps]) for w in ("up", "down")}
    for key in ("dropped", "refused", "pushes"):
        out[key] = sum(r[key] for r in reps)
    out["repetitions"] = len(reps)
    out["each"] = [{"pushes_per_s": r["pushes_per_s"], "reply_ms": r["reply_ms"],
                    "server_cpu_ms_per_push": r["server_cpu_ms_per_push"]} for r in reps]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    ap.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4], help="ps.shards of each case (--quick: 1 2)")
    ap.add_argument("--rate", type=float, default=OFFERED, help="pushes/s offered by all workers (0: "
                    "as fast as replies come)")
    ap.add_argument("--pushes", type=int, default=4000, help="pushes per case")
    ap.add_argument("--density", type=float, default=0.001, help="uplink density of the recorded deltas")
    ap.add_argument("--record", type=int, default=400, help="deltas to record")
    ap.add_argument("--reps", type=int, default=5, help="repetitions of each case (its figures are their medians)")
    ap.add_argument("--quick", action="store_true", help="N = 2, 8, 64, 1,500 pushes and 1 repetition per case")
    ap.add_argument("--out", default=None)
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        client_main()
        return 0
    if args.quick:
        args.workers, args.pushes, args.record, args.reps, args.shards = [2, 8, 64], 1500, 200, 1, [1, 2]
    if min(args.workers) < 1 or args.pushes < 10 * max(args.workers) or args.rate < 0 or args.reps < 1:
        print(f"psload: need --workers >= 1, --pushes >= 10 x the most workers ({10 * max(args.workers)}), "
              f"--rate >= 0 and --reps >= 1", file=sys.stderr)
        return 2
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    src = ensure_data()
    tmp = tempfile.mkdtemp(prefix="sparkcnn-psload-")
    log("recording %d deltas at density %s", args.record, args.density)
    deltas = record_deltas(slice_data(src, 2 * args.record * 32, 500), args.density, args.record, tmp)
    path = os.path.join(tmp, "deltas.bin")
    write_deltas(deltas, path)
    cases = []
    for k in args.shards:
        for n in args.workers:
            log("N = %d, K = %d, offered %s pushes/s", n, k, args.rate or "unlimited")
            c = _median_case([run_case(src, n, args.pushes, args.rate, args.density, path, tmp, k)
                              for _ in range(args.reps)])
            log("  median of %d: %.0f pushes/s, p99 %.1f ms, server CPU %.3f ms/push, dropped %d", args.reps,
                c["pushes_per_s"], c["reply_ms"]["p99"], c["server_cpu_ms_per_push"], c["dropped"])
            cases.append(c)
    layout = [c.pop("layout") for c in cases][-1]
    one = [c for c in cases if c["workers"] == max(args.workers) and c["shards"] == 1] or cases
    # K shards against one, at each N: this machine's 2 cores leave no core free for a shard,
    # so the question here is whether K = 2 loses anything
    by = {(c["shards"], c["workers"]): c for c in cases}
    against_one = {f"K={k} N={n}": {"pushes_per_s": by[k, n]["pushes_per_s"] / by[1, n]["pushes_per_s"],
                                    "p99_ms": by[k, n]["reply_ms"]["p99"] / max(1e-9, by[1, n]["reply_ms"]["p99"])}
                   for k, n in by if k > 1 and (1, n) in by}
    met = bool(one) and all(c["pushes_per_s"] >= TARGET_PUSHES_PER_S and c["reply_ms"]["p99"] < TARGET_P99_MS
                            and c["refused"] == 0 for c in one)
    emit({"bench": "psload", "model": "fmnist_cnn", "settings": SETTINGS, "density": args.density,
          "recorded_deltas": len(deltas), "layout": layout,
          "median_payload_bytes": median([len(d["payload"]) for d in deltas]),
          "cases": cases, "shards_against_one": against_one,
          "target": {"pushes_per_s": TARGET_PUSHES_PER_S, "p99_ms": TARGET_P99_MS, "at_workers": max(args.workers),
                     "met": met}}, args.out)
    return exit_status("psload")


if __name__ == "__main__":
    sys.exit(main())
