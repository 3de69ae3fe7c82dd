"""Predicted per-step speed-up with K parameter-server shards, from measured per-push costs.

Reads a ``bench/psload.py`` result with K = 1 and K > 1 cases (its per-push CPU of the
coordinator and of each shard) and a ``bench/throughput.py`` result (one worker's step, alone:
``solo_step_ms``; a worker's CPU per step outside training, from its ``async_h1_sparse``
stream case, 0 where it measured less than the training alone), or ``--step-ms`` and
``--worker-ms``; prints one JSON object.

With a core per worker and per server process (a cluster; this machine has 2 cores, so the
costs are measured here and the gain is predicted), one step per exchange, N workers::

    K = 1        c_1 = the server's CPU per push (everything in one process)
    K > 1        coordinator  c(K) = c_0 + c_w . K          (its fixed work per push, and one
                                                            log write per shard)
                 shard j      s(K, j) = s_0 + s_r . f_j     (f_j: its share of the entries;
                                                            the largest tensor bounds f_j)
    capacity     X(K)  = 1 / max(c(K), max_j s(K, j))       pushes/s, each process on its own core
    link         L     = B / (bytes up + bytes down per push)   the driver's NIC carries them all
    workers      N / (t + o_w)                              a push per step of t seconds (o_w: the
                                                            worker's CPU per step outside training)
    speed-up     S(N, K) = t . min(N / (t + o_w), X(K), L)  against one worker alone (1 / t)

c_0, c_w (least squares over the K > 1 cases) and s_0, s_r (over every shard of every K > 1
case) are fitted on the cases at one N (``--at``, default: the largest N every K was measured
at). The prediction picks, at each N, the K of the best S; the target is S >= 0.8 N up to
N = 64 at 10 Gbit/s.

    python bench/shardmodel.py --psload R/psload.json (--throughput R/throughput.json | --step-ms 21
                               [--worker-ms 1]) [--gbit 10] [--at N] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import add_model_args, emit, take_model_step  # noqa: E402
from sparkcnn.shards import shard_ranges  # noqa: E402

KS = (1, 2, 4, 8)
NS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TARGET_FRACTION, TARGET_UP_TO = 0.8, 64


def fit(cases: list[dict], layout: list[int]) -> dict:
    """c_1, (c_0, c_w) and (s_0, s_r) from psload cases at one N."""
    one = [c for c in cases if c["shards"] == 1]
    many = [c for c in cases if c["shards"] > 1]
    if not one or not many:
        raise SystemExit("shardmodel: the psload result needs a K = 1 case and K > 1 cases at the same N")
    P = sum(layout)
    ks = np.array([c["shards"] for c in many], float)
    coord = np.array([c["coordinator_cpu_ms_per_push"] for c in many], float)
    if len(set(ks)) > 1:
        c_w, c_0 = np.polyfit(ks, coord, 1)
    else:  # one K: no slope to fit; the coordinator's cost is taken as flat in K
        c_w, c_0 = 0.0, float(coord.mean())
    fr, sh = [], []
    for c in many:
        for (lo, hi), ms in zip(shard_ranges(layout, c["shards"]), c["shard_cpu_ms_per_push"]):
            fr.append((hi - lo) / P)
            sh.append(ms)
    s_r, s_0 = np.polyfit(np.array(fr), np.array(sh), 1)
    return {"c_1_ms": float(one[0]["server_cpu_ms_per_push"]), "c_0_ms": float(c_0), "c_w_ms": float(c_w),
            "s_0_ms": float(s_0), "s_r_ms": float(s_r), "fitted_on": [
                {"shards": c["shards"], "coordinator_ms": c["coordinator_cpu_ms_per_push"],
                 "shard_ms": c["shard_cpu_ms_per_push"]} for c in many]}


def predict(f: dict, layout: list[int], step_s: float, worker_s: float, link_pushes_per_s: float) -> dict:
    P = sum(layout)
    out = {}
    for k in KS:
        if k == 1:
            per_push_ms = f["c_1_ms"]
            parts = {"server_ms": per_push_ms}
        else:
            coord = f["c_0_ms"] + f["c_w_ms"] * k
            biggest = max(hi - lo for lo, hi in shard_ranges(layout, k)) / P
            shard = f["s_0_ms"] + f["s_r_ms"] * biggest
            per_push_ms = max(coord, shard)
            parts = {"coordinator_ms": coord, "largest_shard_ms": shard, "largest_share": biggest}
        capacity = 1000.0 / max(1e-9, per_push_ms)
        out[str(k)] = {**parts, "capacity_pushes_per_s": capacity, "speed_up": {
            str(n): step_s * min(n / (step_s + worker_s), capacity, link_pushes_per_s) for n in NS}}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap, "a bench/psload.py result with K = 1 and K > 1 cases")
    ap.add_argument("--at", type=int, default=0, help="fit on the cases at this N (default: the largest N "
                    "measured at every K)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    try:
        with open(a.psload, encoding="utf-8") as fh:
            pl = json.load(fh)
        # the key-range shards' cases (ps.servers' cases, where psload measured them, are another layout)
        cases = [c for c in pl["cases"] if "workers" in c and c.get("servers", 1) == 1]
        layout = pl["layout"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"shardmodel: {a.psload}: not a psload result with a layout ({e})", file=sys.stderr)
        return 2
    if not take_model_step(a, "shardmodel"):
        return 2
    if a.step_ms <= 0 or a.worker_ms < 0 or a.gbit <= 0:
        print("shardmodel: --step-ms and --gbit must be > 0, --worker-ms >= 0", file=sys.stderr)
        return 2
    ks = {c["shards"] for c in cases}
    at = a.at or max((n for n in {c["workers"] for c in cases}
                      if {c["shards"] for c in cases if c["workers"] == n} == ks), default=0)
    here = [c for c in cases if c["workers"] == at]
    f = fit(here, layout)
    one = next(c for c in here if c["shards"] == 1)
    bytes_per_push = one["bytes_per_push"]["up"] + one["bytes_per_push"]["down"]
    link = a.gbit * 1e9 / 8 / bytes_per_push
    pred = predict(f, layout, a.step_ms / 1000, a.worker_ms / 1000, link)
    best = {str(n): max(KS, key=lambda k: pred[str(k)]["speed_up"][str(n)]) for n in NS}
    met = all(pred[str(best[str(n)])]["speed_up"][str(n)] >= TARGET_FRACTION * n for n in NS if n <= TARGET_UP_TO)
    emit({"bench": "shardmodel", "psload": os.path.relpath(a.psload), "fitted_at_workers": at,
          "psload_commit": (pl.get("provenance") or {}).get("commit"), "step_ms": a.step_ms,
          "worker_ms": a.worker_ms, "gbit": a.gbit, "bytes_per_push": bytes_per_push,
          "link_pushes_per_s": link, "fit": f, "by_shards": pred, "best_shards": best,
          "target": {"fraction_of_n": TARGET_FRACTION, "up_to": TARGET_UP_TO, "met": met}}, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
