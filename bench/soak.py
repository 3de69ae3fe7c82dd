"""Soak: many small sync rounds on local[2]; memory of driver, Python workers and JVM over time.

Prints one JSON object. ``fmnist_cnn`` on Fashion-MNIST, 2 blocks, sync mode,
``steps_per_round=2``, sparse uplink and downlink (``density_down > 0``, so
the engine destroys and creates the broadcast of the workers' view every
round), 200 rounds (``--quick``: 60) after one warm round. After every round
the driver samples, from /proc, the resident memory (VmRSS) of

- this process (the driver's Python side),
- the Python workers that ran the round's tasks (their pids come back in the
  task results; local mode runs them on this machine),
- the JVM (driver and executor in one process in local mode).

``*_rss_growth_mb`` = median over the last 10 % of the rounds − median over
rounds 10–20 (after warm-up; ``baseline_rounds`` says which). Next to it: JVM
heap and block-manager memory after a forced JVM GC, the spill directory and
the driver's Python object count at round 20 and at the end, and rounds/s over
the first and the last window of rounds (sum of the rounds' own wall times, so
the sampling is not counted).

    python bench/soak.py [--quick] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import emit, ensure_data, log, median, rss_mb  # noqa: E402

OVERRIDES = ["data.num_blocks=2", "train.steps_per_round=2", "train.epochs=1", "train.batch_size=64",
             "compression.method=threshold", "compression.density=0.01", "compression.density_down=0.01"]
BASELINE = (10, 20)  # rounds (inclusive) whose median is the reference level


def _jvm_state(sc, run_id: str) -> dict:
    """JVM heap and block-manager memory after a full GC, the run's spill dir, driver objects."""
    from pyspark import SparkFiles

    jvm = sc._jvm
    jvm.java.lang.System.gc()
    rt = jvm.java.lang.Runtime.getRuntime()
    status = sc._jsc.sc().getExecutorMemoryStatus().toSeq()  # executor -> (max, remaining) bytes
    used = sum(status.apply(i)._2()._1() - status.apply(i)._2()._2() for i in range(status.size()))
    spill = os.path.join(SparkFiles.getRootDirectory(), "sparkcnn", run_id)
    files = [os.path.join(spill, f) for f in os.listdir(spill)] if os.path.isdir(spill) else []
    return {"jvm_heap_used_mb": (rt.totalMemory() - rt.freeMemory()) / 2**20,
            "block_manager_used_mb": used / 2**20,
            "persistent_rdds": sc._jsc.sc().getPersistentRDDs().size(),
            "spill_files": len(files), "spill_mb": sum(os.path.getsize(f) for f in files if os.path.isfile(f)) / 2**20,
            "driver_python_objects": len(gc.get_objects())}


def _growth(series: list[float | None], tail: int) -> float | None:
    """Median of the last ``tail`` values minus the median over BASELINE rounds (1-based)."""
    base = median(series[BASELINE[0] - 1:BASELINE[1]])
    last = median(series[-tail:])
    return None if base is None or last is None else last - base


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="60 rounds instead of 200")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override after the defaults above (e.g. compression.density_down=0: "
                         "the dense downlink, W broadcast every round)")
    a = ap.parse_args(argv)
    overrides = [*OVERRIDES, *a.set]
    rounds = 60 if a.quick else 200
    window = min(50, rounds // 3)  # rounds in the first and last rate windows
    tail = max(1, rounds // 10)
    t_start = time.perf_counter()

    from sparkcnn import config
    from sparkcnn.backends.spark import SparkBackend
    from sparkcnn.backends.session import get_or_create_spark
    from sparkcnn.train import build_engine

    data = ensure_data()
    cfg = config.load(None, [f"data.path={data}", *overrides])
    spark = get_or_create_spark("local[2]", "sparkcnn-bench-soak")
    sc = spark.sparkContext
    jvm_pid = int(sc._jvm.java.lang.ProcessHandle.current().pid())
    run_id = f"bench-soak-{os.getpid()}"
    backend = SparkBackend(spark, run_id)
    engine, _ = build_engine(cfg, backend, run_id)
    if engine.total_rounds < rounds + 1:
        raise SystemExit(f"bench/soak.py: {rounds + 1} rounds exceed the run's {engine.total_rounds}")
    engine.run_round(0)  # traces the TF functions; not part of the series
    log("soak: %d rounds of %d steps, sparse up and down", rounds, cfg.train.steps_per_round)

    pids: set[int] = set()
    series = {"driver": [], "workers": [], "jvm": []}
    per_pid: dict[int, list[float | None]] = {}
    walls, overheads, worker_pids_per_round = [], [], []
    at_baseline = None
    for t in range(1, rounds + 1):
        rec = engine.run_round(t)
        walls.append(rec["wall_s"])
        overheads.append(rec["round_overhead_s"])
        round_pids = {int(p) for p in rec["task_pids"].values()}
        worker_pids_per_round.append(sorted(round_pids))
        pids |= round_pids
        rss = {p: rss_mb(p) for p in sorted(pids)}
        for p, v in rss.items():
            per_pid.setdefault(p, [None] * (t - 1)).append(v)
        series["driver"].append(rss_mb())
        series["workers"].append(sum(v for v in rss.values() if v is not None))
        series["jvm"].append(rss_mb(jvm_pid))
        if t == BASELINE[1]:
            at_baseline = _jvm_state(sc, run_id)
        if t % 20 == 0:
            log("round %d: driver %.0f MB, workers %.0f MB, jvm %.0f MB, %.2f s/round", t,
                series["driver"][-1], series["workers"][-1], series["jvm"][-1] or 0, rec["wall_s"])
    at_end = _jvm_state(sc, run_id)
    engine.backend.close()  # unpersist the block placement RDDs

    first, last = walls[:window], walls[-window:]
    out = {
        "quick": a.quick, "rounds": rounds, "steps_per_round": cfg.train.steps_per_round,
        "master": "local[2]", "overrides": overrides,
        "baseline_rounds": list(BASELINE), "tail_rounds": tail,
        "driver_rss_growth_mb": _growth(series["driver"], tail),
        "executor_rss_growth_mb": _growth(series["workers"], tail),
        "executor_rss_growth_mb_per_pid": {str(p): _growth(v, tail) for p, v in per_pid.items()},
        "jvm_rss_growth_mb": _growth(series["jvm"], tail),
        "driver_rss_mb": {"baseline": median(series["driver"][BASELINE[0] - 1:BASELINE[1]]),
                          "end": series["driver"][-1]},
        "executor_rss_mb": {"baseline": median(series["workers"][BASELINE[0] - 1:BASELINE[1]]),
                            "end": series["workers"][-1]},
        "jvm_rss_mb": {"baseline": median(series["jvm"][BASELINE[0] - 1:BASELINE[1]]), "end": series["jvm"][-1]},
        "worker_pids": sorted(pids),
        # more pids than a round uses: a Python worker was replaced (the sum then jumps)
        "worker_pids_changed": len(pids) > max(len(p) for p in worker_pids_per_round),
        "after_gc": {"baseline": at_baseline, "end": at_end},
        "jvm_heap_growth_mb": at_end["jvm_heap_used_mb"] - at_baseline["jvm_heap_used_mb"],
        "block_manager_growth_mb": at_end["block_manager_used_mb"] - at_baseline["block_manager_used_mb"],
        "rate_window_rounds": window,
        "rounds_per_s_first": len(first) / sum(first),
        "rounds_per_s_last": len(last) / sum(last),
        "round_overhead_ms": {"first": 1000 * median(overheads[:window]), "last": 1000 * median(overheads[-window:])},
        "counters": dict(engine.counters),
        "rss_mb_every_10_rounds": {k: [round(v, 1) if v is not None else None for v in s[9::10]]
                                   for k, s in series.items()},
    }
    out["rounds_per_s_last_over_first"] = out["rounds_per_s_last"] / out["rounds_per_s_first"]
    targets = {"driver_rss_growth_mb": ("<", 50, out["driver_rss_growth_mb"]),
               "executor_rss_growth_mb": ("<", 50, out["executor_rss_growth_mb"]),
               "rounds_per_s_last_over_first": (">=", 0.9, out["rounds_per_s_last_over_first"])}
    out["targets"] = {k: f"{op} {v}" for k, (op, v, _) in targets.items()}
    out["targets_met"] = {k: x is not None and (x < v if op == "<" else x >= v) for k, (op, v, x) in targets.items()}
    out["bench_wall_s"] = time.perf_counter() - t_start
    emit(out)
    spark.stop()
    return out


if __name__ == "__main__":
    main()
