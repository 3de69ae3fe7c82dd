"""Where the parameter server's reply tails come from: one load, on a quiet machine and beside busy ones.

The 64-worker load of ``bench/psload.py`` (one server, ``--rate`` pushes/s offered by replayed
workers) once showed a reply p99 of 94 to 224 ms in 2 of 5 repetitions, with a median p99 of a
few ms. A pause that holds the server up delays every push in flight, about 64 at a time, so
one pause per repetition is enough to make its p99. This bench tells the possible causes
apart, in one invocation: repetitions of that case alternate between ``quiet`` (nothing else
started) and ``busy`` (``--busy`` processes spinning on the cores meanwhile, what other work on
a shared machine does), and each keeps psload's ``late_replies`` (over 10 ms), the server
process's own ``driver_pauses`` (cyclic collections, and late wake-ups of its sampler thread:
held up by its interpreter lock or kept off the cores) and the load average.

Reading it: tails in ``busy`` repetitions only, with the server's stalls and no long
collection, put the cause outside the server (the cores taken); a collection over 5 ms, or
tails in ``quiet`` repetitions, put it inside. Prints one JSON object: per condition, the
repetitions' figures and their medians. No target is judged here: psload judges the p99.

    python bench/tails.py [--workers 64] [--rate 1000] [--pushes 4000] [--reps 5] [--busy 3] [--out F]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import emit, ensure_data, log, median, slice_data  # noqa: E402
from bench._loadgen import record_deltas, write_deltas  # noqa: E402
from bench.psload import run_case  # noqa: E402

SPIN = "while True:\n    pass\n"  # a busy process: one core's worth of work, no memory traffic


def one(condition: str, busy: int, args, src: str, deltas: str, tmp: str) -> dict:
    n = busy if condition == "busy" else 0
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(n)]
    try:
        r = run_case(src, args.workers, args.pushes, args.rate, args.density, deltas, tmp)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    keep = ("pushes_per_s", "reply_ms", "late_replies", "driver_pauses", "load_1min",
            "server_cpu_ms_per_push")
    return {k: r[k] for k in keep}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--rate", type=float, default=1000.0, help="pushes/s offered by all workers")
    ap.add_argument("--pushes", type=int, default=4000, help="pushes per repetition")
    ap.add_argument("--density", type=float, default=0.001, help="uplink density of the recorded deltas")
    ap.add_argument("--reps", type=int, default=5, help="repetitions of each condition, taken in turn")
    ap.add_argument("--busy", type=int, default=3, help="spinning processes in the busy condition")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.workers < 1 or a.pushes < 10 * a.workers or a.rate <= 0 or a.reps < 1 or a.busy < 1:
        print("tails: need --workers >= 1, --pushes >= 10 x --workers, --rate > 0, --reps >= 1, --busy >= 1",
              file=sys.stderr)
        return 2
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    src = ensure_data()
    tmp = tempfile.mkdtemp(prefix="sparkcnn-tails-")
    deltas = os.path.join(tmp, "deltas.bin")
    write_deltas(record_deltas(slice_data(src, 2 * 400 * 32, 500), a.density, 400, tmp), deltas)
    reps: dict[str, list[dict]] = {"quiet": [], "busy": []}
    for rep in range(a.reps):
        for condition in ("quiet", "busy") if rep % 2 == 0 else ("busy", "quiet"):
            r = one(condition, a.busy, a, src, deltas, tmp)
            reps[condition].append(r)
            log("%s rep %d/%d: p99 %.1f ms, %d late, pauses %s, load %.1f", condition, rep + 1, a.reps,
                r["reply_ms"]["p99"], r["late_replies"], r["driver_pauses"], r["load_1min"])
    out = {}
    for condition, rs in reps.items():
        stalls = [r["driver_pauses"].get("stall", {}).get("max_ms", 0.0) for r in rs]
        collections = [max((v["max_ms"] for k, v in r["driver_pauses"].items() if k.startswith("gc")),
                           default=0.0) for r in rs]
        out[condition] = {"p99_ms": [r["reply_ms"]["p99"] for r in rs],
                          "p99_ms_median": median([r["reply_ms"]["p99"] for r in rs]),
                          "late_replies_median": median([r["late_replies"] for r in rs]),
                          "longest_stall_ms": max(stalls), "longest_collection_ms": max(collections),
                          "repetitions": rs}
    emit({"bench": "tails", "workers": a.workers, "rate": a.rate, "pushes": a.pushes, "busy": a.busy,
          "conditions": out}, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
