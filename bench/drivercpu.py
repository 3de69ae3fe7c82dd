"""The parameter server's CPU per push at one step per exchange: where the handler's time goes.

Prints one JSON object. The async stream at H = 1, sparse both ways (bench/throughput.py's
``async_h1_sparse``: uplink 0.001, downlink 0.01, no warm-up) runs for one epoch of the same
slice, ``--reps`` times per variant, the variants alternating in one process and one Spark
session so that they see the same machine:

- ``candidates``: the server selects each downlink among the entries pushes touched since the
  last one (``SparseDownlink._compiled_candidates``, or ``_from_candidates`` without the
  compiled kernels), as it does by default;
- ``scan``: the same run with that short cut off (compiled and numpy alike): every downlink
  scans all P entries of W - U.

Both send the same downlinks bitwise (tests/unit/test_ps.py). For each run, the thread CPU of
the driver's handler per push (``time.thread_time`` around its parts: ``push`` holds
``apply`` and ``send_downlink``, ``send_downlink`` holds ``downlink`` and ``encode``,
``downlink`` holds ``select``, the scan's choice (the compiled candidate path makes its
choice, rounds and applies it in one call inside ``downlink``); ``serve_stream`` is the
handler thread's whole stream, Flight reads and writes included), the driver process's
CPU per push, images/s and the
efficiency against the compute limit taken in the same workers right before and after.
The first run of the session (traces, compiled kernels' caches) is not counted.

    python bench/drivercpu.py [--reps 3]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections import defaultdict
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import throughput  # noqa: E402
from bench._common import emit, ensure_data, log  # noqa: E402

CASE = "async_h1_sparse"


def parts() -> list:
    """(owner, attribute, name): the handler's parts, each timed on the thread that runs it."""
    from sparkcnn.ps import ParameterServer
    from sparkcnn.server import downlink as downlink_mod
    from sparkcnn.server.downlink import Downlink
    from sparkcnn.server.exchange import Exchange
    from sparkcnn.transport import service as psservice
    from sparkcnn.transport.pushes import PushHandler

    from sparkcnn.ps_downlink import SparseDownlink

    return [(PushHandler, "push", "push"), (Exchange, "apply", "apply"),
            (Downlink, "send", "send_downlink"), (ParameterServer, "downlink", "downlink"),
            (SparseDownlink, "_select", "select"), (downlink_mod.codec, "encode", "encode"),
            (psservice.PSService, "serve_stream", "serve_stream")]


def timed(totals: dict, calls: dict) -> list:
    """Patches that add each part's thread CPU seconds to ``totals[name]`` and count its calls."""
    patches = []
    for owner, attr, name in parts():
        fn = getattr(owner, attr)

        def wrapper(*a, _fn=fn, _name=name, **k):
            t = time.thread_time()
            try:
                return _fn(*a, **k)
            finally:
                totals[_name] += time.thread_time() - t
                calls[_name] += 1

        patches.append(mock.patch.object(owner, attr, functools.wraps(fn)(wrapper)))
    return patches


def one_run(data: str, variant: str, limit_steps: int, run_id: str) -> dict:
    from sparkcnn.ps_downlink import SparseDownlink

    h, mode, extra = throughput.STREAM_CASES[CASE]
    totals: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    patches = timed(totals, calls)
    if variant == "scan":
        for short_cut in ("_from_candidates", "_compiled_candidates"):
            patches.append(mock.patch.object(SparseDownlink, short_cut, lambda self, density: None))
    for p in patches:
        p.start()
    try:
        r = throughput._stream_once(data, h, mode, extra, limit_steps, run_id)
    finally:
        for p in reversed(patches):
            p.stop()
    pushes = max(1, calls["push"])  # every push of the run, as the totals
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
