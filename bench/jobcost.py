"""Spark's own CPU per job on local[2]: what every round or async job costs before any training.

Prints one JSON object. Jobs of 2 tasks (one per block, as a sync round) and of
1 task (an async job) through ``SparkBackend``, each task returning
``result_bytes`` bytes (0, or a dense ``fmnist_cnn`` delta: 900 kB) that it makes
itself: a closure holding them would send them down through Py4J as the task's
command, a cost the jobs transport never pays (its model goes by broadcast).
After 30 warm-up jobs of each kind, for each kind over ``--jobs`` jobs:

- ``jvm_cpu_ms_per_job``: CPU time of the JVM (driver and executor in one
  process in local mode: scheduling, task launch, moving results), from
  /proc/<pid>/stat;
- ``driver_cpu_ms_per_job``: CPU time of this Python process (py4j calls,
  closure pickling, reading the results);
- ``wall_ms_per_job``.

On a 2-core machine the JVM's share comes straight out of the two training
workers' cores: ``share_of_h10_round`` relates the 2-task, 900 kB job's JVM +
driver CPU to the CPU of one round of 10 ``fmnist_cnn`` steps on 2 blocks
(``--step-ms``, default 45 ms per step and block, as measured by
bench/throughput.py's compute limit).

    python bench/jobcost.py [--jobs 60] [--step-ms 45]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import emit, log, proc_stat, spark_backend  # noqa: E402

DENSE_DELTA_BYTES = 225_034 * 4  # fmnist_cnn's parameters as float32


def cpu_s(pid: int | str = "self") -> float:
    """User + system CPU seconds of a live process."""
    return proc_stat(pid)[1]


def time_jobs(run_job, jobs: int, jvm_pid: int, executors=()) -> dict:
    """Seconds per job over ``jobs`` calls of ``run_job()``: wall, and the CPU of the driver's JVM,
    of this process and of the ``executors`` (pids of executor JVMs; none in local mode)."""
    executors = list(executors)
    jvm0, me0, e0, t0 = cpu_s(jvm_pid), cpu_s(), sum(cpu_s(p) for p in executors), time.perf_counter()
    for _ in range(jobs):
        run_job()
    wall = time.perf_counter() - t0
    return {"wall_s": wall / jobs, "jvm_cpu_s": (cpu_s(jvm_pid) - jvm0) / jobs, "driver_cpu_s": (cpu_s() - me0) / jobs,
            "executors_cpu_s": (sum(cpu_s(p) for p in executors) - e0) / jobs}


def measure(backend, blocks: list[int], result_bytes: int, jobs: int, jvm_pid: int, executors=()) -> dict:
    """``jobs`` jobs of one task per block, each returning ``result_bytes`` bytes made in the task.
    Their content does not matter: Spark's task-result path copies them and compresses nothing."""
    def fn(block, ctx):
        return bytes(result_bytes)

    t = time_jobs(lambda: backend.map_blocks(fn, blocks, "sparkcnn jobcost", universe=2), jobs, jvm_pid, executors)
    return {"tasks": len(blocks), "result_bytes_per_task": result_bytes,
            "jvm_cpu_ms_per_job": 1000 * t["jvm_cpu_s"], "driver_cpu_ms_per_job": 1000 * t["driver_cpu_s"],
            "executors_cpu_ms_per_job": 1000 * t["executors_cpu_s"],  # 0 in local mode: no executor JVM
            "wall_ms_per_job": 1000 * t["wall_s"]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=60)
    ap.add_argument("--step-ms", type=float, default=45.0, help="one fmnist_cnn step on one core (ms)")
    a = ap.parse_args(argv)
    from sparkcnn.backends.session import get_or_create_spark

    spark = get_or_create_spark("local[2]", "sparkcnn-jobcost")
    jvm_pid = int(spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid())
    backend = spark_backend(spark, "jobcost")
    out = {"bench": "jobcost", "master": "local[2]", "cpus": os.cpu_count(), "jobs": a.jobs, "kinds": {}}
    kinds = (("2 tasks, empty", [0, 1], 0), ("2 tasks, 900 kB each", [0, 1], DENSE_DELTA_BYTES),
             ("1 task, empty", [0], 0), ("1 task, 900 kB", [0], DENSE_DELTA_BYTES))
    log("warm-up: 30 jobs of each kind (Python workers, JIT)")
    for _, blocks, data in kinds:
        measure(backend, blocks, data, 30, jvm_pid)
    for name, blocks, data in kinds:
        log("%s: %d jobs", name, a.jobs)
        out["kinds"][name] = measure(backend, blocks, data, a.jobs, jvm_pid)
    round_job = out["kinds"]["2 tasks, 900 kB each"]
    h10_cpu_ms = 2 * 10 * a.step_ms
    out["h10_round_cpu_ms"] = h10_cpu_ms
    out["share_of_h10_round"] = (round_job["jvm_cpu_ms_per_job"] + round_job["driver_cpu_ms_per_job"]) / h10_cpu_ms
    backend.close()
    emit(out)
    return out


if __name__ == "__main__":
    main()
