"""The parameter server's CPU per push at one step per exchange: where the handler's time goes.

Prints one JSON object. The async stream at H = 1, sparse both ways (bench/throughput.py's
``async_h1_sparse``: uplink 0.001, downlink 0.01, no warm-up) runs for one epoch of the same
slice, ``--reps`` times per variant, the variants alternating in one process and one Spark
session so that they see the same machine:

- ``candidates``: the server selects each downlink among the entries pushes touched since the
  last one, as it does by default (``ps.downlink_candidates=true``);
- ``scan``: the same run with that short cut off (``ps.downlink_candidates=false``, compiled
  and numpy alike): every downlink scans all P entries of W - U.

Both send the same downlinks bitwise (tests/unit/test_ps.py). For each run, the driver's thread
CPU per push, as the run itself measures it where the work happens: the service's per-stream
sums (``push``: its handler's calls, from the check to the reply; ``serve_stream``: the handler
thread's whole stream, Flight reads and writes included) and the exchange records' ``timings``
(``send_downlink``: the downlink, ``downlink_cpu_s``; ``encode``: its encoding; ``downlink``:
the rest of it, the choice of D and U += D; ``select``: the scan's choice, 0 where the candidate
set settled it (the compiled candidate path makes its choice, rounds and applies it in one call
inside ``downlink``); ``apply``: the server's part outside the downlink, ``server_cpu_s -
downlink_cpu_s``: dedup and staleness, the apply (decode, guard, sum into W), the record), each
summed over the run and divided by the messages the handler took; the driver process's CPU per
push, images/s and the efficiency against the compute limit taken in the same workers right
before and after. The first run of the session (traces, compiled kernels' caches) is not counted.

    python bench/drivercpu.py [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import throughput  # noqa: E402
from bench._common import emit, ensure_data, log  # noqa: E402

CASE = "async_h1_sparse"
VARIANTS = {"candidates": ["ps.downlink_candidates=true"], "scan": ["ps.downlink_candidates=false"]}


def handler_cpu(records: list[dict], service: dict) -> tuple[int, dict[str, float]]:
    """(messages the handler took, each part's thread CPU seconds over the run) from the
    exchange records' timings and the service's sums (module docstring)."""

    def total(key: str) -> float:
        return sum(r.get(key, 0.0) for r in records)

    down, enc = total("downlink_cpu_s"), total("encode_cpu_s")
    return service["messages"], {
        "push": service["handler_cpu_s"], "serve_stream": service["stream_cpu_s"],
        "apply": total("server_cpu_s") - down, "send_downlink": down, "downlink": down - enc,
        "select": total("select_cpu_s"), "encode": enc}


def one_run(data: str, variant: str, limit_steps: int, run_id: str) -> dict:
    h, mode, extra = throughput.STREAM_CASES[CASE]
    records: list[dict] = []
    r = throughput._stream_once(data, h, mode, [*extra, *VARIANTS[variant]], limit_steps, run_id, records)
    pushes, totals = handler_cpu(records, r["service"])
    pushes = max(1, pushes)
    limit = sum(r["limit_before_after"]) / 2
    return {"images_per_s": r["images_per_s"], "limit_before_after": r["limit_before_after"],
            "efficiency_vs_limit": r["images_per_s"] / limit,
            "driver_cpu_ms_per_push": r["cpu_ms_per_round"]["driver"],
            "pushes": pushes,
            "handler_cpu_ms_per_push": {k: 1000 * v / pushes for k, v in sorted(totals.items())}}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3, help="runs per variant (alternating)")
    ap.add_argument("--limit-steps", type=int, default=200, help="steps per block of each adjacent limit")
    a = ap.parse_args(argv)
    data = ensure_data()
    short = throughput.short_slice(data)
    log("warm-up run (not counted)")
    h, mode, extra = throughput.STREAM_CASES[CASE]
    throughput._stream_once(short, h, mode, extra, 0, "bench-drivercpu-warm")
    runs: dict[str, list] = {"candidates": [], "scan": []}
    for i in range(a.reps):
        for variant in (("candidates", "scan") if i % 2 == 0 else ("scan", "candidates")):
            log("%s, run %d", variant, i + 1)
            runs[variant].append(one_run(short, variant, a.limit_steps, f"bench-drivercpu-{variant}-{i}"))

    def med(variant: str, key: str, part: str | None = None) -> float:
        """The median over the variant's runs (a part a run never entered counts 0)."""
        return statistics.median(r[key].get(part, 0.0) if part else r[key] for r in runs[variant])

    names = sorted({p for rs in runs.values() for r in rs for p in r["handler_cpu_ms_per_push"]})
    out = {"case": CASE, "settings": throughput.STREAM_CASES[CASE][2], "reps": a.reps,
           "runs": runs,
           "median": {v: {"efficiency_vs_limit": med(v, "efficiency_vs_limit"),
                          "driver_cpu_ms_per_push": med(v, "driver_cpu_ms_per_push"),
                          "handler_cpu_ms_per_push": {p: med(v, "handler_cpu_ms_per_push", p) for p in names}}
                      for v in runs},
           }
    out["candidates_vs_scan"] = {
        "driver_cpu_ms_per_push": med("candidates", "driver_cpu_ms_per_push") / med("scan", "driver_cpu_ms_per_push"),
        "downlink_cpu_ms_per_push": (med("candidates", "handler_cpu_ms_per_push", "downlink")
                                     / med("scan", "handler_cpu_ms_per_push", "downlink")),
        "efficiency_vs_limit": med("candidates", "efficiency_vs_limit") / med("scan", "efficiency_vs_limit")}
    emit(out)
    return out


if __name__ == "__main__":
    main()
