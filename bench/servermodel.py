"""Predicted per-step speed-up with K parameter-server processes that split the workers.

Reads a ``bench/psload.py --servers 1 2`` result (the CPU per push of one server, and of K = 2
server processes and the driver beside them, at two or more N) and a ``bench/throughput.py``
result (one worker's step alone, ``solo_step_ms``, and a worker's CPU per step outside training
from its ``async_h1_sparse`` stream case), or ``--step-ms`` and ``--worker-ms``; prints one JSON
object.

With ``ps.servers`` = K, block b's pushes go to server b mod K, and every server applies to the
one copy of the weights in the driver host's shared memory: a push costs one server its whole
work, so the servers split the pushes, not the entries. With a core per worker and per server
process, the driver host having ``--cores`` cores (one of them the driver's: its process, which
writes every record, and Spark's JVM), one step per exchange, N workers::

    server       s(K) = c_1 + (s_2 - c_1) . (K - 1)     CPU per push summed over the K servers
                                                       (c_1: one server; s_2: two, measured;
                                                       linear beyond: the shared store's lock and
                                                       the cores' caches are what K adds)
    driver       d    = its CPU per push at K = 2      (the records of every server, whatever K)
    capacity     X(K) = min(K / s(K), 1 / d)           pushes/s, K <= cores - 1
    link         L    = B / (bytes up + down per push) the driver's NIC carries every push
    workers      N / (t + o_w)                         a push per step of t (o_w: the worker's CPU
                                                       per step outside training)
    speed-up     S(N, K) = t . min(N / (t + o_w), X(K), L)   against one worker alone

The costs are taken at the largest N psload measured (``fitted_at_workers``). The model is
checked on what this machine holds out: fitted again at the smallest N, it predicts the
capacity psload measured at the largest N for K = 1 and K = 2 (``validation``; within 25 %). The
target: S(64, best K) >= 0.8 . 64 on a driver host of at most 8 cores.

    python bench/servermodel.py --psload R/psload.json (--throughput R/throughput.json | --step-ms 12
                                [--worker-ms 2]) [--cores 8] [--gbit 10] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import add_model_args, emit, take_model_step  # noqa: E402

NS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TARGET_FRACTION, TARGET_AT, TARGET_CORES = 0.8, 64, 8
WITHIN = 0.25  # the model's largest error on the held-out capacities


def costs(cases: list[dict], n: int) -> dict:
    """(c_1, s_2, d) in ms per push from psload's K = 1 and K = 2 cases at N = ``n``."""
    one = next(c for c in cases if c["workers"] == n and c["servers"] == 1)
    two = next(c for c in cases if c["workers"] == n and c["servers"] == 2)
    return {"c_1_ms": one["server_cpu_ms_per_push"], "s_2_ms": sum(two["server_process_cpu_ms_per_push"]),
            "d_ms": two["driver_cpu_ms_per_push"], "at_workers": n}


def capacity(f: dict, k: int) -> float:
    """X(K), pushes/s: the servers' share and the driver's (K = 1: one process does it all)."""
    if k == 1:
        return 1000.0 / f["c_1_ms"]
    s = f["c_1_ms"] + (f["s_2_ms"] - f["c_1_ms"]) * (k - 1)
    return min(1000.0 * k / s, 1000.0 / f["d_ms"])


def predict(f: dict, ks: range, step_s: float, worker_s: float, link: float) -> dict:
    return {str(k): {"capacity_pushes_per_s": capacity(f, k), "speed_up": {
        str(n): step_s * min(n / (step_s + worker_s), capacity(f, k), link) for n in NS}} for k in ks}


def validation(cases: list[dict]) -> dict:
    """Fitted at the smallest N, the capacities predicted at the largest against psload's."""
    ns = sorted({c["workers"] for c in cases})
    fit_n, held = ns[0], ns[-1]
    f = costs(cases, fit_n)
    out = {}
    for k in (1, 2):
        got = next(c for c in cases if c["workers"] == held and c["servers"] == k)["capacity_pushes_per_s"]
        want = capacity(f, k)
        out[str(k)] = {"predicted": want, "measured": got, "error": abs(want - got) / got}
    worst = max(v["error"] for v in out.values())
    return {"fitted_at_workers": fit_n, "held_out_workers": held, "by_servers": out, "largest_error": worst,
            "within": WITHIN, "passed": worst <= WITHIN}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap, "a bench/psload.py result with --servers 1 2 at two N")
    ap.add_argument("--cores", type=int, default=TARGET_CORES, help="the driver host's cores")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    try:
        with open(a.psload, encoding="utf-8") as fh:
            pl = json.load(fh)
        cases = [c for c in pl["cases"] if c.get("shards", 1) == 1 and c.get("servers") in (1, 2)]
        ns = sorted(n for n in {c["workers"] for c in cases}
                    if {c["servers"] for c in cases if c["workers"] == n} == {1, 2})
        if len(ns) < 2:
            raise KeyError("K = 1 and K = 2 cases at two N or more")
        cases = [c for c in cases if c["workers"] in ns]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"servermodel: {a.psload}: not a psload result with servers 1 and 2 ({e})", file=sys.stderr)
        return 2
    if not take_model_step(a, "servermodel"):
        return 2
    if a.step_ms <= 0 or a.worker_ms < 0 or a.gbit <= 0 or a.cores < 2:
        print("servermodel: --step-ms and --gbit must be > 0, --worker-ms >= 0, --cores >= 2",
              file=sys.stderr)
        return 2
    f = costs(cases, ns[-1])
    one = next(c for c in cases if c["workers"] == ns[-1] and c["servers"] == 1)
    bytes_per_push = one["bytes_per_push"]["up"] + one["bytes_per_push"]["down"]
    link = a.gbit * 1e9 / 8 / bytes_per_push
    pred = predict(f, range(1, a.cores), a.step_ms / 1000, a.worker_ms / 1000, link)
    best = {str(n): max(pred, key=lambda k: pred[k]["speed_up"][str(n)]) for n in NS}
    at = pred[best[str(TARGET_AT)]]["speed_up"][str(TARGET_AT)]
    reps = min(c.get("repetitions", 1) for c in cases)
    emit({"bench": "servermodel", "psload": os.path.relpath(a.psload),
          "psload_commit": (pl.get("provenance") or {}).get("commit"), "step_ms": a.step_ms,
          "worker_ms": a.worker_ms, "cores": a.cores, "gbit": a.gbit, "bytes_per_push": bytes_per_push,
          "link_pushes_per_s": link, "fit": f, "by_servers": pred, "best_servers": best,
          "validation": validation(cases), "repetitions": reps,
          "target": {"fraction_of_n": TARGET_FRACTION, "at_workers": TARGET_AT, "cores_at_most": TARGET_CORES,
                     "speed_up": at,
                     "met": a.cores <= TARGET_CORES and at >= TARGET_FRACTION * TARGET_AT}}, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
