"""Heterogeneous executors: one of two slowed 2x; sync (unbalanced) vs async (balanced) vs solo rates.

Prints one JSON object. A standalone cluster on 127.0.0.1 with two workers of
one core each; worker 1's executor runs every task ``SPARKCNN_CHAOS_SLOW=2``
times slower (the worker sleeps as long again as it trained). ``fmnist_cnn``
on 2 blocks of a slice of Fashion-MNIST (0.5 epoch, ``--quick`` 0.34): every
mode trains the same fixed number of samples, and the steady state leaves out
warm-up (Python worker start, TF import and tracing, block placement: ``engine.warmup_s``
plus the first rounds or jobs).

- ``unbalanced_images_per_s``: sync mode, the same ``steps_per_round`` (20)
  on each block (``scheduler.balance=false``); every round waits for the slow
  executor. Rounds after the first, driven with ``engine.run_round``.
- ``sync_balanced_images_per_s``: the same with ``scheduler.balance=true``
  (H sized per executor from measured speed so a round's tasks end together).
- ``balanced_images_per_s``: async mode; ``AsyncEngine.run()`` sizes each job
  to ``scheduler.target_job_seconds`` from the block's measured speed, so each
  executor runs at its own pace. Images/s between completions, leaving out
  each block's first two jobs and the last two (drain).
- ``solo_sum_images_per_s``: the sum over the executors of each one's
  training rate when it runs alone: async mode with one job in flight at a
  time (``engine.threads=1``, jobs sized as in the balanced run), each job's ``samples / compute_s`` grouped by
  the executor that ran it (its Python worker's parent JVM). ``compute_s`` is
  the training time of the task, the slowed executor's sleep included; prep,
  encoding and Spark's per-job cost are not in it, so this is the rate a
  perfectly balanced run with free communication would reach.
- The async runs are sized by records, not seconds: their epochs over the
  slice are chosen from the fastest executor's measured rate (in the
  unbalanced run) so that each leaves at least ``ASYNC_RECORDS`` (balanced) or
  ``SOLO_RECORDS`` (solo) job records at ``--target-job-s``; on a fast machine
  one pass gave too few jobs to measure a steady rate.
- Every run records its test accuracy; the async and solo runs train only when
  within ``ACCURACY_GATE`` of the unbalanced sync run's (``trained``), and a
  run that did not train gets no efficiency: its target fails.
- ``balance_efficiency`` = balanced / solo_sum (target >= 0.9) and
  ``unbalanced_efficiency`` = unbalanced / solo_sum. ``concurrent`` gives each
  executor's rate within the balanced run itself (both training at once on
  this machine's cores) and ``balance_efficiency_vs_concurrent``.

    python bench/balance.py [--quick] [--target-job-s 1.5]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import (  # noqa: E402
    TimedSink,
    emit,
    ensure_data,
    exit_status,
    log,
    parent_pid,
    slice_data,
    slot_count,
    spark_backend,
    steady_rate,
)

BLOCKS, BATCH, H = 2, 64, 20
SLOW = 2.0  # worker 1's slow-down factor
# job records each async run leaves: the balanced one skips 2 per block and 2 of drain, the solo one
# its first job per block; 7 records, 1 left after skipping, was too few to measure (a fast machine)
ASYNC_RECORDS, SOLO_RECORDS = 20, 12
ACCURACY_GATE = 0.05  # an async run this far below the unbalanced sync run's test accuracy did not train


def epochs_for(records: int, target_s: float, fastest_images_per_s: float, samples: int) -> int:
    """Passes over ``samples`` that leave at least ``records`` jobs of ``target_s`` seconds each,
    were every job sized for the fastest executor (the largest jobs, so the fewest)."""
    per_job = max(1.0, target_s * fastest_images_per_s)
    return max(1, math.ceil(records * per_job / samples))


class Bench:
    """One session on the cluster; engines built on it share the executors' Python workers."""

    def __init__(self, cluster, spark):
        self.cluster, self.spark = cluster, spark
        self._executor_of: dict[int, int] = {}

    def engine(self, data: str, run_id: str, overrides: list[str], sink=None, epochs: int = 1):
        from sparkcnn import config
        from sparkcnn.train import build_engine

        cfg = config.load(None, [f"data.path={data}", f"data.num_blocks={BLOCKS}", f"train.batch_size={BATCH}",
                                 f"train.steps_per_round={H}", f"train.epochs={epochs}", "data.test_blocks=1",
                                 *overrides])
        pool = f"sparkcnn-{run_id}" if cfg.engine.mode == "async" else None
        backend = spark_backend(self.spark, run_id, pool=pool)
        engine, _ = build_engine(cfg, backend, run_id, sink=sink)
        warm_s = engine.warmup_s
        log("%s: blocks loaded in %.1f s", run_id, warm_s)
        return engine

    def executor_of(self, pid: int) -> str:
        """``worker<i>`` whose executor JVM forked Python worker ``pid`` (up the parent chain)."""
        if pid not in self._executor_of:
            jvms = {j: i for i, js in self.cluster.executor_pids().items() for j in js}
            p, hops = pid, 0
            while p and p not in jvms and hops < 6:
                p, hops = parent_pid(p), hops + 1
            self._executor_of[pid] = jvms.get(p, -1)
        i = self._executor_of[pid]
        return f"worker{i}" if i >= 0 else f"pid{pid}"


def rates_by_executor(bench: Bench, records: list[dict]) -> dict:
    """Per executor: images / compute seconds over its jobs, jobs, mean steps per job."""
    out: dict[str, dict] = {}
    for r in records:
        e = out.setdefault(bench.executor_of(int(r["pid"])), {"samples": 0, "compute_s": 0.0, "jobs": 0, "steps": 0})
        e["samples"] += r["samples"]
        e["compute_s"] += r["compute_s"]
        e["jobs"] += 1
        e["steps"] += r["steps"]
    return {k: {"images_per_s": v["samples"] / v["compute_s"] if v["compute_s"] else 0.0, "jobs": v["jobs"],
                "mean_steps_per_job": v["steps"] / v["jobs"], "samples": v["samples"]}
            for k, v in sorted(out.items())}


def measure_sync(bench: Bench, data: str, balance: bool) -> dict:
    """Sync rounds after a warm one; ``balance``: ``scheduler.balance`` sizes H per executor."""
    engine = bench.engine(data, f"bench-balance-sync{'-balanced' if balance else ''}",
                          [f"scheduler.balance={str(balance).lower()}"])
    engine.run_round(0)  # warm: traces the TF functions (first engine), measures executor speeds
    recs = []
    t0 = time.perf_counter()
    for t in range(1, engine.rounds_per_epoch):
        recs.append(engine.run_round(t))
    wall = time.perf_counter() - t0
    acc = engine.server.evaluate(0)["test_accuracy"]
    engine.backend.close()  # unpersist the block placement RDDs
    out = {"images_per_s": sum(r["samples"] for r in recs) / wall, "rounds": len(recs), "test_accuracy": acc,
           "round_wall_ms": 1000 * wall / len(recs),
           "round_overhead_ms": 1000 * sum(r["round_overhead_s"] for r in recs) / len(recs),
           "idle_fraction": sum(r["idle_fraction"] for r in recs) / len(recs)}
    if not balance:  # every task ran H steps: per-executor rates from the round records
        out["by_executor"] = rates_by_executor(bench, [
            {"pid": r["task_pids"][k], "samples": H * BATCH, "steps": H, "compute_s": r["task_compute_s"][k]}
            for r in recs for k in r["task_pids"]])
    return out


def run_async(bench: Bench, data: str, run_id: str, target_s: float, epochs: int, threads: int = 0,
              blocks: int = BLOCKS):
    """``AsyncEngine.run()`` over ``epochs`` passes of ``data``; the engine, its timed job records
    and its test accuracy."""
    sink = TimedSink()
    engine = bench.engine(data, run_id, ["engine.mode=async", f"scheduler.target_job_seconds={target_s}",
                                         f"engine.threads={threads}", f"data.num_blocks={blocks}"], sink=sink,
                          epochs=epochs)
    run = engine.run()
    engine.backend.close()  # unpersist the block placement RDDs
    return engine, sink.rounds(), run["test_accuracy"]


def summarize_async(bench: Bench, engine, rows: list, accuracy: float) -> dict:
    rate = steady_rate(rows, skip_first=2 * engine.num_blocks, skip_last=2)
    steady = [r for _, r in rows[rate["first"]:rate["last"] + 1]][1:]
    return {"images_per_s": rate["images_per_s"], "jobs": rate["records"], "window_s": rate["window_s"],
            "records": len(rows), "epochs": engine.cfg.train.epochs, "test_accuracy": accuracy,
            "job_wall_ms": 1000 * sum(r["wall_s"] for r in steady) / len(steady),
            "round_overhead_ms": 1000 * sum(r["round_overhead_s"] for r in steady) / len(steady),
            "mean_staleness": sum(r["staleness"] for r in steady) / len(steady),
            "state_resets": engine.counters["state_resets"],
            "idle_fraction": max(0.0, 1 - sum(r["task_s"] for r in steady) / (rate["window_s"] * slot_count(engine))),
            "by_executor": rates_by_executor(bench, steady)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="0.34 epoch instead of 0.5")
    ap.add_argument("--target-job-s", type=float, default=1.5, help="async scheduler.target_job_seconds")
    ap.add_argument("--async-blocks", type=int, default=BLOCKS,
                    help="blocks of the balanced async run (more than the slots: scheduler.queue_depth "
                         "keeps a job queued)")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    from sparkcnn.testing.standalone import StandaloneCluster, session

    data = ensure_data()
    rounds = 8 if a.quick else 12  # sync rounds of H steps per block: the fixed sample count
    shared = slice_data(data, rounds * H * BATCH * BLOCKS, 640)
    solo_samples = (12 if a.quick else 24) * H * BATCH
    solo_data = slice_data(data, solo_samples, 640)
    out = {"quick": a.quick, "model": "fmnist_cnn", "blocks": BLOCKS,
           "executors": "2 x 1 core, standalone on 127.0.0.1", "slowed": {"worker1": SLOW},
           "samples": rounds * H * BATCH * BLOCKS, "steps_per_round": H, "target_job_seconds": a.target_job_s,
           "async_blocks": a.async_blocks}
    cluster = StandaloneCluster(workers=2, cores_per_worker=1, per_worker_env={1: {"SPARKCNN_CHAOS_SLOW": str(SLOW)}})
    # generous start-up timeouts: JVMs start slowly on a busy 2-core machine
    with cluster.start(timeout=180):
        spark = session(cluster, "sparkcnn-bench-balance", conf={"spark.scheduler.mode": "FAIR"}, timeout=180)
        log("cluster up in %.1f s", time.perf_counter() - t_start)
        bench = Bench(cluster, spark)
        try:
            log("unbalanced: sync, %d steps per block per round", H)
            unb = measure_sync(bench, shared, balance=False)
            log("sync balanced: scheduler.balance=true")
            sync_bal = measure_sync(bench, shared, balance=True)
            fastest = max(e["images_per_s"] for e in unb["by_executor"].values())
            epochs = epochs_for(ASYNC_RECORDS, a.target_job_s, fastest, out["samples"])
            log("balanced: async, target_job_seconds %.2f, %d epoch(s) for >= %d jobs at %.0f images/s",
                a.target_job_s, epochs, ASYNC_RECORDS, fastest)
            bal = summarize_async(bench, *run_async(bench, shared, "bench-balance-async", a.target_job_s, epochs,
                                                    blocks=a.async_blocks))
            solo_epochs = epochs_for(SOLO_RECORDS, a.target_job_s, fastest, solo_samples)
            log("solo: async, one job at a time, %d epoch(s)", solo_epochs)
            _, solo_rows, solo_acc = run_async(bench, solo_data, "bench-balance-solo", a.target_job_s, solo_epochs,
                                               threads=1)
        finally:
            spark.stop()
    solo = rates_by_executor(bench, [r for _, r in solo_rows[BLOCKS:]])  # leave out the default-sized first jobs
    solo_sum = sum(e["images_per_s"] for e in solo.values())
    concurrent_sum = sum(e["images_per_s"] for e in bal["by_executor"].values())
    reference = unb["test_accuracy"]
    trained = {"balanced": bal["test_accuracy"] >= reference - ACCURACY_GATE,
               "solo": solo_acc >= reference - ACCURACY_GATE}
    efficiency = bal["images_per_s"] / solo_sum if all(trained.values()) else None
    out.update({
        "fastest_images_per_s": fastest, "async_records_min": ASYNC_RECORDS, "solo_records_min": SOLO_RECORDS,
        "solo_epochs": solo_epochs, "solo_records": len(solo_rows), "solo_test_accuracy": solo_acc,
        "accuracy_gate": f"async and solo runs within {ACCURACY_GATE} of the unbalanced sync run's test accuracy",
        "trained": trained,
        "unbalanced_images_per_s": unb["images_per_s"],
        "balanced_images_per_s": bal["images_per_s"],
        "solo_sum_images_per_s": solo_sum,
        "balance_efficiency": efficiency,
        "unbalanced_efficiency": unb["images_per_s"] / solo_sum,
        "balanced_vs_unbalanced": bal["images_per_s"] / unb["images_per_s"],
        "sync_balanced_images_per_s": sync_bal["images_per_s"],
        "sync_balanced_efficiency": sync_bal["images_per_s"] / solo_sum,
        "solo_method": ("async run with engine.threads=1 (one single-block job in flight at a time, so the "
                        "executor running it has the cluster to itself; jobs sized as in the balanced run); per "
                        "executor sum(samples) / "
                        "sum(compute_s) over its jobs, executor found from the task's Python worker pid "
                        "(its parent JVM); compute_s = the task's training time including the slowed "
                        "executor's sleep, excluding prep, encoding and Spark job overhead"),
        "solo": solo,
        "solo_speed_ratio": (solo.get("worker0", {}).get("images_per_s", 0)
                             / max(1e-9, solo.get("worker1", {}).get("images_per_s", 0))),
        "concurrent": bal["by_executor"],
        "balance_efficiency_vs_concurrent": bal["images_per_s"] / concurrent_sum if concurrent_sum else None,
        "unbalanced": unb, "balanced": bal, "sync_balanced": sync_bal,
    })
    out["targets"] = {"balance_efficiency": ">= 0.9"}
    out["targets_met"] = {"balance_efficiency": efficiency is not None and efficiency >= 0.9}
    out["bench_wall_s"] = time.perf_counter() - t_start
    emit(out)
    return out


if __name__ == "__main__":
    sys.exit(exit_status("balance", main()))
