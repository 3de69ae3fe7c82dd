"""Throughput of sparkcnn (sync, pipelined sync, async) next to single-process Keras and the compute limit.

Prints one JSON object; every figure comes from this one run, measured one
after another on one local[2] session (Python workers and their traced TF
functions are reused from one measurement to the next).

- ``keras_images_per_s``: ``model.fit`` in this process (TF default threads),
  before any Spark work.
- ``compute_limit``: measured once per invocation, ``LIMIT_REPS`` times, in the
  first engine's warm Spark Python workers (each trains its block alone, both at
  once, single-thread, no communication), after its warm round and before anything is timed:
  ``images_per_s`` is the median of ``repetitions`` (images/s of both blocks,
  summed), and ``compute_limit_images_per_s`` the same median. Every
  ``efficiency_vs_limit`` of the run divides by this one figure, so the rows of
  one table share one denominator and its spread is known.
- ``by_steps_per_round[H]`` (H = 1, 10, 50): plain sync rounds driven one at a
  time (``engine.run_round``); images/s over the rounds after a warm round, and
  the ``test_accuracy`` of the weights they reached (read after the timed window),
  ``round_overhead_ms`` = median of (job time − slowest task), next to
  ``round_compute_ms`` (slowest task's training time).
- ``pipelined`` (H = 10, ``engine.pipeline=true``): ``SyncEngine.run()`` over
  one epoch of a slice of the training set sized to a fixed number of rounds;
  images/s between the completions of the 2nd and the next-to-last round
  (warm-up and drain left out). A pipelined job waits in Spark's queue while
  its predecessor runs, so its ``round_overhead_ms`` (job − task) holds that
  wait; ``exposed_overhead_ms`` = median(round wall − slowest compute) is what
  the pipeline fails to hide. ``sync_pipelined_idle_fraction``: mean of the
  rounds' ``idle_fraction`` in the same window. ``state_resets`` > 0 with no
  failure means a round's tasks ran before their predecessor's and waited out
  the state wait (``run_wall_s`` shows the cost; the window may leave it out).
- ``async`` (``engine.mode=async``): ``AsyncEngine.run()`` over the same
  slice, ``scheduler.target_job_seconds`` set to the measured compute time of
  10 steps so jobs carry ~10 steps (``mean_steps_per_job`` says what they
  carried), on ``ASYNC_BLOCKS`` = 4 blocks (two per slot: one job queued in
  Spark per slot); images/s between completions, leaving out each block's
  first two jobs (speed not yet known) and the last two (drain). ``async_vs_sync`` =
  async / plain sync at H = 10. ``async_by_steps["1"]`` and ``["50"]``: the same with
  jobs sized to 1 and 50 steps.

``cpu`` (under each measurement): CPU ms per round (async: per job) of this
process (``driver``; ``meter``: the meter's own reads of /proc), the JVM (``jvm``:
Spark's driver and executor in one process on local[2]) and Spark's Python
workers (``workers``), from /proc over
the same window; ``training_cpu_ms`` is what the limit's single-thread
processes spend on the same images. ``efficiency_vs_limit`` = ``compute_share``
(training CPU / all CPU) x ``cores_busy`` (all CPU / (wall x 2)), exactly: on
2 cores the CPU that Spark and the driver use per round is training lost.

``--quick`` (under a minute here): fewer steps, every Spark measurement on a slice
of the training set (shorter block loads), and Spark's start-up (JVM, workers'
TF import, block loads) overlapping this process's TF import and tracing
(Spark is idle while Keras is timed).

- ``stream`` (``engine.transport=stream``): ``StreamEngine.run()`` over one epoch of the
  slice, for ``async_h1_sparse``, ``async_h1_dense``, ``async_h10`` and ``sync_h10`` (sparse:
  uplink 0.001, downlink 0.01); images/s between pushes, ``exposed_comm_ms_per_step`` (what
  the tasks waited for the server's replies, per local step) and the same ``cpu`` accounting;
  and the rest of the grid, sparse: ``async_h50``,
  ``sync_h1``, ``sync_h50``. A case's ``efficiency_vs_limit`` and ``cpu`` use the run's
  one compute limit. The cases with targets run ``STREAM_REPS`` times; the repetition of
  median images/s is the result and ``repetitions`` holds all of them, each with its own
  ``test_accuracy`` (the machine's speed moves by ~10 % within a minute: one repetition
  can land on a dip).
  ``task_overhead_cpu_ms_per_step`` is measured inside the tasks: their CPU outside
  TensorFlow per local step (the task thread outside its TF calls, and its push thread),
  with its median over the repetitions; ``cpu``'s ``non_training_cpu_ms`` is instead all CPU
  less the limit's, so it also holds how much slower TF steps beside the driver. ``cpu`` is
  the median repetition's run; ``driver_cpu_ms_per_exchange_median`` is the driver's CPU per
  exchange over all repetitions (each repetition's figure in ``repetitions``).
  A case the transport does not run carries ``error``.
  Every stream case records its ``test_accuracy`` and ``jobs_reference_accuracy``: its own
  variant's reference, the jobs transport at the same mode, H and compression on the same
  slice (``jobs_test_accuracy``, keyed ``<mode>-h<H>-<dense|sparse>``). A case any of whose
  repetitions is more than 5 points below it, or that has no reference, did not train
  (``trained: false``): it gets no efficiency and its target fails.

``--set KEY=VALUE`` (repeatable) applies a config override to every sparkcnn
engine of the run, e.g. the sparse uplink: ``--set compression.method=threshold
--set compression.density=0.001 --set compression.warmup_epochs=0``.

    python bench/throughput.py [--quick] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import (  # noqa: E402
    CpuMeter,
    TimedSink,
    cpu_account,
    cpu_ms_per,
    cpu_per_record,
    emit,
    ensure_data,
    exit_status,
    keras_fit_images_per_s,
    log,
    median,
    slice_data,
    slot_count,
    spark_backend,
    steady_rate,
)

BLOCKS, BATCH = 2, 64
# async: two blocks per task slot, so with scheduler.queue_depth = 1 a job waits in Spark's
# queue and a freed slot starts it at once (same samples in all, each block half as long)
ASYNC_BLOCKS = 4
EXTRA: list[str] = []  # --set overrides, applied to every engine of the run


def _engine(data: str, run_id: str, overrides: list[str], sink=None):
    """Engine on the shared local[2] session, blocks loaded and models built in the workers."""
    from sparkcnn import config
    from sparkcnn.backends.session import get_or_create_spark
    from sparkcnn.train import build_engine

    cfg = config.load(None, [f"data.path={data}", f"data.num_blocks={BLOCKS}", f"train.batch_size={BATCH}",
                             *EXTRA, *overrides])
    pool = f"sparkcnn-{run_id}" if cfg.engine.mode == "async" else None
    backend = spark_backend(get_or_create_spark("local[2]", "sparkcnn-bench"), run_id, pool=pool)
    engine, _ = build_engine(cfg, backend, run_id, sink=sink)
    log("%s: blocks loaded and models built in %.1f s", run_id, engine.warmup_s)
    return engine


def _limit_task(spec, steps: int):
    """One block trained alone in its (warm, single-thread) Python worker: no communication."""
    def fn(block, ctx):
        import time as _time

        from sparkcnn.worker import blockstore
        from sparkcnn.worker.task import local_root
        from sparkcnn.worker.trainer import batch_indices, get_trainer

        x, y = blockstore.get_block(local_root(spec, ctx), spec.run_id, "train", spec.num_blocks, block)
        tr = get_trainer(spec, ctx)
        b = [batch_indices(len(y), spec.batch_size, 0, 0, block, i) for i in range(steps + 5)]
        tr.train(x, y, b[:5], 0.05)
        t, c = _time.perf_counter(), _time.process_time()
        tr.train(x, y, b[5:], 0.05)
        dt, dc = _time.perf_counter() - t, _time.process_time() - c  # CPU: every thread of the worker
        return {"images_per_s": steps * spec.batch_size / dt, "step_ms": 1000 * dt / steps,
                "step_cpu_ms": 1000 * dc / steps}
    return fn


def measure_sparkcnn(data: str, H: int, rounds: int, extra: list[str] = (), warm_rounds: int = 1,
                     limit_steps: int = 0, engine=None) -> dict:
    """Plain sync rounds, one ``run_round`` after another, after ``warm_rounds`` unmeasured ones.

    The first engine on a fresh session needs a warm round (it traces the TF
    functions in both workers); later ones reuse those workers and traces.
    ``limit_steps`` > 0: first measure the run's one compute limit in the engine's
    own warm workers (:func:`measure_limit_once`, after the warm rounds).
    ``engine``: one already built by ``_engine`` with these settings.
    """
    if engine is None:
        engine = _engine(data, f"bench-h{H}", [f"train.steps_per_round={H}", *extra])
    for t in range(warm_rounds):
        engine.run_round(t)
    limit = measure_limit_once(engine, limit_steps) if limit_steps else None
    recs = []
    meter = CpuMeter(rescan_s=float("inf"))
    cpu0 = meter.sample()
    t0 = time.perf_counter()
    for t in range(warm_rounds, warm_rounds + rounds):
        recs.append(engine.run_round(t))
    wall = time.perf_counter() - t0
    cpu1 = meter.sample()
    accuracy = _test_accuracy(engine)  # after the timed window: the weights these rounds reached
    engine.backend.close()  # unpersist the block placement RDDs
    samples = sum(r["samples"] for r in recs)
    return {
        "sparkcnn_images_per_s": samples / wall,
        "round_overhead_ms": 1000 * median(r["round_overhead_s"] for r in recs),
        "round_compute_ms": 1000 * sum(r["compute_s"] for r in recs) / len(recs),
        "round_wall_ms": 1000 * wall / len(recs),
        "idle_fraction": sum(r["idle_fraction"] for r in recs) / len(recs),
        # one block's training time for H steps: sizes the async jobs below
        "block_compute_ms": 1000 * median(s for r in recs for s in r["task_compute_s"].values()),
        "rounds": len(recs),
        "bytes_up_per_round": sum(r["bytes_up"] for r in recs) / len(recs),
        "bytes_down_per_round": sum(r["bytes_down"] for r in recs) / len(recs),
        "cpu_ms_per_round": cpu_ms_per(len(recs), cpu0, cpu1), "images_per_round": samples / len(recs),
        "test_accuracy": accuracy,
        **({"limit": limit} if limit else {}),
    }


def _test_accuracy(engine) -> float | None:
    """Test accuracy of the weights ``engine`` holds now (its own evaluation on the test blocks)."""
    try:
        return engine.server.evaluate(0).get("test_accuracy")
    except Exception as e:  # noqa: BLE001 - a speed figure without its accuracy says so, it is not dropped
        log("test accuracy not read: %s", e)
        return None


def measure_pipelined(data: str, H: int, extra: list[str] = ()) -> dict:
    """``SyncEngine.run()`` with two rounds in flight over one epoch of ``data``."""
    sink = TimedSink(CpuMeter())
    engine = _engine(data, f"bench-pipe-h{H}" + ("-x" if extra else ""),
                     [f"train.steps_per_round={H}", "train.epochs=1", "engine.pipeline=true", *extra], sink=sink)
    run = engine.run()
    run_s = run["wall_s"]
    sink.close()
    engine.backend.close()  # unpersist the block placement RDDs
    rows = sink.rounds()
    rate = steady_rate(rows, skip_first=2, skip_last=1)
    steady = [r for _, r in rows[rate["first"]:rate["last"] + 1]][1:]
    return {
        "steps_per_round": H, "images_per_s": rate["images_per_s"], "rounds": rate["records"],
        "window_s": rate["window_s"],
        "round_overhead_ms": 1000 * median(r["round_overhead_s"] for r in steady),
        "exposed_overhead_ms": 1000 * median(r["wall_s"] - r["compute_s"] for r in steady),
        "round_compute_ms": 1000 * sum(r["compute_s"] for r in steady) / len(steady),
        "round_wall_ms": 1000 * sum(r["wall_s"] for r in steady) / len(steady),
        "idle_fraction": sum(r["idle_fraction"] for r in steady) / len(steady),
        # a round that found its predecessor's block state missing: with no failures, its task
        # waited out state_wait_s (a whole run_wall_s far above the rounds' walls says so)
        "state_resets": engine.counters["state_resets"], "run_wall_s": run_s,
        "test_accuracy": run["test_accuracy"],
        **_window_cpu(sink, rows, rate),
    }


def _window_cpu(sink: TimedSink, rows: list, rate: dict) -> dict:
    """CPU by kind of process per record over the steady window, with its images and wall per record."""
    n = rate["records"]
    return {"cpu_ms_per_round": cpu_per_record(sink, rows[rate["first"]][1], rows[rate["last"]][1], n),
            "images_per_round": rate["samples"] / n, "wall_ms_per_round": 1000 * rate["window_s"] / n}


def measure_async(data: str, H: int, target_job_s: float, extra: list[str] = ()) -> dict:
    """``AsyncEngine.run()`` over one epoch of ``data``, jobs sized to ``target_job_s``;
    ``extra``: further config overrides for this engine (e.g. ``model.name``)."""
    sink = TimedSink(CpuMeter())
    engine = _engine(data, f"bench-async-h{H}", [f"train.steps_per_round={H}", "train.epochs=1",
                                                  "engine.mode=async", f"data.num_blocks={ASYNC_BLOCKS}",
                                                  f"scheduler.target_job_seconds={target_job_s:.4f}",
                                                  *extra], sink=sink)
    run = engine.run()
    run_s = run["wall_s"]
    sink.close()
    engine.backend.close()  # unpersist the block placement RDDs
    rows = sink.rounds()
    rate = steady_rate(rows, skip_first=2 * ASYNC_BLOCKS, skip_last=2)
    steady = [r for _, r in rows[rate["first"]:rate["last"] + 1]][1:]
    busy = sum(r["task_s"] for r in steady)
    return {
        "blocks": ASYNC_BLOCKS, "target_job_seconds": target_job_s,
        "images_per_s": rate["images_per_s"], "jobs": rate["records"],
        "window_s": rate["window_s"],
        "mean_steps_per_job": sum(r["steps"] for r in steady) / len(steady),
        "round_overhead_ms": 1000 * median(r["round_overhead_s"] for r in steady),
        "round_compute_ms": 1000 * sum(r["compute_s"] for r in steady) / len(steady),
        "job_wall_ms": 1000 * sum(r["wall_s"] for r in steady) / len(steady),
        "idle_fraction": max(0.0, 1 - busy / (rate["window_s"] * slot_count(engine))),
        "mean_staleness": sum(r["staleness"] for r in steady) / len(steady),
        "bytes_up_per_job": sum(r["bytes_up"] for r in steady) / len(steady),
        "bytes_down_per_job": sum(r["bytes_down"] for r in steady) / len(steady),
        "state_resets": engine.counters["state_resets"], "run_wall_s": run_s,
        "test_accuracy": run["test_accuracy"],
        **_window_cpu(sink, rows, rate),
    }


# the streaming transport's cases: uplink 0.001 and downlink 0.01 (no warm-up: steady state) where sparse
STREAM_SPARSE = ["compression.method=threshold", "compression.density=0.001", "compression.density_down=0.01",
                 "compression.warmup_epochs=0"]
STREAM_CASES = {"async_h1_sparse": (1, "async", STREAM_SPARSE),
                "async_h1_dense": (1, "async", []),
                "async_h10": (10, "async", STREAM_SPARSE), "sync_h10": (10, "sync", STREAM_SPARSE),
                # the rest of the transport x mode x H grid (H = 1, 10, 50), sparse
                "async_h50": (50, "async", STREAM_SPARSE), "sync_h1": (1, "sync", STREAM_SPARSE),
                "sync_h50": (50, "sync", STREAM_SPARSE)}


ACCURACY_GATE = 0.05  # a stream case this far below the jobs transport's accuracy on its slice did not train


def trained(case: dict, reference: float | None) -> bool:
    """Whether a stream case trained: the test accuracy of each of its repetitions (or of its one
    run) is at most ``ACCURACY_GATE`` below ``reference``, its own variant's accuracy on the jobs
    transport (same slice, mode, H and compression). No reference: not trained, never a silent
    pass; its speed counts only when it trained."""
    reps = case.get("repetitions")
    accs = [r.get("test_accuracy") for r in reps] if isinstance(reps, list) and reps else [case.get("test_accuracy")]
    return reference is not None and all(a is not None and a >= reference - ACCURACY_GATE for a in accs)


def reference_key(mode: str, h: int, sparse: bool) -> str:
    """A stream case's own variant on the jobs transport, as ``jobs_test_accuracy`` keys it."""
    return f"{mode}-h{h}-{'sparse' if sparse else 'dense'}"


# the stream cases with targets, each measured STREAM_REPS times between limits (the median counts)
TARGET_CASES = {"async_h1_sparse": 0.85, "async_h10": 0.93, "sync_h10": 0.9}
STREAM_REPS = 5  # a target is met as the median of at least 5 repetitions, never one good run
LIMIT_REPS = 5  # the run's one compute limit: the median of this many, measured once per invocation


def _limit_in_workers(engine, steps: int) -> list[dict]:
    """The compute limit in ``engine``'s own warm Python workers, now: both blocks trained alone at
    once, ``steps`` steps each, no communication (one ``_limit_task`` row per block)."""
    return engine.backend.map_blocks(_limit_task(engine.spec, steps), [0, 1], "bench compute limit",
                                     universe=BLOCKS)


def measure_limit_once(engine, steps: int, reps: int = LIMIT_REPS) -> dict:
    """The run's one compute limit, in ``engine``'s warm workers: ``reps`` measurements of both
    blocks trained alone at once (images/s summed), their median the limit."""
    log("compute limit: both blocks trained alone in their Spark Python workers, %d steps each, %d times",
        steps, reps)
    rows = [_limit_in_workers(engine, steps) for _ in range(reps)]
    each = [sum(r["images_per_s"] for r in row) for row in rows]
    return {"images_per_s": statistics.median(each), "repetitions": each,
            "step_ms": [statistics.median(r[b]["step_ms"] for r in rows) for b in range(BLOCKS)],
            "method": "both blocks trained alone at once in the warm Spark Python workers, single-thread, "
                      "no communication; once per invocation, before anything is timed"}


def measure_stream(data: str, H: int, mode: str, extra: list[str], reps: int = 1) -> dict:
    """``StreamEngine.run()`` over one epoch of ``data``: images/s between pushes, leaving out each
    block's first two pushes and the last two (start-up and drain); the exposed communication is
    what the tasks waited for replies, per local step.

    ``reps`` > 1: the run is made ``reps`` times; the result is the repetition of median
    images/s, with every repetition's figures, its test accuracy included, in ``repetitions``."""
    runs = []
    for i in range(reps):
        r = _stream_once(data, H, mode, extra, 0, f"bench-stream-{mode}-h{H}" + (f"-r{i}" if i else ""))
        if "error" in r:
            return r
        runs.append(r)
    if reps == 1:
        return runs[0]
    out = dict(sorted(runs, key=lambda r: r["images_per_s"])[len(runs) // 2])
    out["repetitions"] = [{**{k: r[k] for k in ("images_per_s", "test_accuracy", "task_overhead_cpu_ms_per_step")},
                           "driver_cpu_ms_per_exchange": r["cpu_ms_per_round"]["driver"]} for r in runs]
    out["task_overhead_cpu_ms_per_step_median"] = statistics.median(r["task_overhead_cpu_ms_per_step"] for r in runs)
    # the driver's CPU per exchange judged as its median over the repetitions too, not the one run above
    out["driver_cpu_ms_per_exchange_median"] = statistics.median(r["cpu_ms_per_round"]["driver"] for r in runs)
    return out


def _adjacent_limit(engine, steps: int) -> float:
    """:func:`_limit_in_workers` as one figure: images/s of both blocks, summed."""
    return sum(r["images_per_s"] for r in _limit_in_workers(engine, steps))


def _stream_once(data: str, H: int, mode: str, extra: list[str], limit_steps: int, run_id: str,
                 records: list | None = None) -> dict:
    """One stream run; ``limit_steps`` > 0 (bench/drivercpu.py) also measures the limit in the same
    workers right before and after it (``limit_before_after``). This bench divides by its run's one
    limit instead and passes 0. ``records``: also gets every exchange record of the run."""
    sink = TimedSink(CpuMeter())
    try:
        engine = _engine(data, run_id, [f"train.steps_per_round={H}", "train.epochs=1", f"engine.mode={mode}",
                                        "engine.transport=stream", *extra], sink=sink)
    except Exception as e:  # noqa: BLE001 - a case the transport does not run yet is reported, not hidden
        return {"error": str(e).splitlines()[0]}
    limit_before = _adjacent_limit(engine, limit_steps) if limit_steps else None
    run = engine.run()
    sink.close()
    limit_after = _adjacent_limit(engine, limit_steps) if limit_steps else None
    engine.backend.close()
    rows = sink.rounds()
    if records is not None:
        records.extend(r for _, r in rows)
    rate = steady_rate(rows, skip_first=2 * BLOCKS, skip_last=2)
    steady = [r for _, r in rows[rate["first"]:rate["last"] + 1]][1:]
    steps = sum(r["steps"] for r in steady)
    return {
        "steps_per_exchange": H, "mode": mode, "images_per_s": rate["images_per_s"], "exchanges": rate["records"],
        "window_s": rate["window_s"],
        "exposed_comm_ms_per_step": 1000 * sum(r["exposed_comm_s"] for r in steady) / max(1, steps),
        "compute_ms_per_step": 1000 * sum(r["compute_s"] for r in steady) / max(1, steps),
        # measured in the tasks: their CPU outside TensorFlow (their own thread outside the TF calls
        # and their push thread), per local step, across blocks
        "task_overhead_cpu_ms_per_step": 1000 * sum(r["task_overhead_cpu_s"] for r in steady) / max(1, steps),
        "apply_ms_per_exchange": 1000 * sum(r["apply_s"] for r in steady) / max(1, len(steady)),
        "mean_staleness": sum(r["staleness"] for r in steady) / max(1, len(steady)),
        "bytes_up_per_exchange": sum(r["bytes_up"] for r in steady) / max(1, len(steady)),
        "bytes_down_per_exchange": sum(r["bytes_down"] for r in steady) / max(1, len(steady)),
        "run_wall_s": run["wall_s"], "test_accuracy": run["test_accuracy"], "service": run.get("stream"),
        **({"limit_before_after": [limit_before, limit_after]} if limit_steps else {}),
        **_window_cpu(sink, rows, rate),
    }


def short_slice(data: str, quick: bool = False) -> str:
    """The slice of ``data`` whose epoch the pipelined, async and stream cases run: a fixed number
    of rounds of H = 10 steps per block, 2 warm + measured (40, quick 5) + 1 drain."""
    rounds = (5 if quick else 40) + 3
    return slice_data(data, rounds * 10 * BATCH * BLOCKS, 1000)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps, about a minute")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for every sparkcnn engine (e.g. compression.method=threshold)")
    a = ap.parse_args(argv)
    EXTRA[:] = a.set
    t_start = time.perf_counter()
    data = ensure_data()
    steps = 40 if a.quick else 400
    H = 10
    short = short_slice(data, a.quick)
    sync_data = short if a.quick else data  # quick: shorter block loads
    log("keras model.fit, %d steps", steps)
    # in this process: it imports TF for the engines anyway (a child would pay a TF start-up)
    first = None
    if a.quick:  # Spark's start-up and its workers' TF import overlap this process's TF import
        starter = ThreadPoolExecutor(1, thread_name_prefix="spark-start")
        started = starter.submit(_engine, sync_data, "bench-h10", ["train.steps_per_round=10"])
        keras_ips = keras_fit_images_per_s(data, steps, before_timing=started.result)  # Spark idle while timed
        first = started.result()
        starter.shutdown()
    else:
        keras_ips = keras_fit_images_per_s(data, steps)
    out = {"quick": a.quick, "model": "fmnist_cnn", "blocks": BLOCKS, "batch_size": BATCH,
           "master": "local[2]", "overrides": a.set,
           "keras_images_per_s": keras_ips, "by_steps_per_round": {}}
    for i, h in enumerate((10, 50, 1)):  # H = 10 first: it warms the workers, then the run's limit is measured
        n = {10: 5, 50: 2, 1: 10}[h] if a.quick else min(2 * steps // h, 100)
        log("sync H=%d: %d rounds", h, n)
        out["by_steps_per_round"][str(h)] = measure_sparkcnn(sync_data, h, n, warm_rounds=1 if i == 0 else 0,
                                                             limit_steps=steps if i == 0 else 0,
                                                             engine=first if i == 0 else None)
    limit = out["compute_limit"] = out["by_steps_per_round"]["10"].pop("limit")
    limit_ips = out["compute_limit_images_per_s"] = limit["images_per_s"]
    out["solo_step_ms"] = limit["step_ms"]

    sync10 = out["by_steps_per_round"][str(H)]
    log("pipelined sync H=%d: one epoch of %s", H, os.path.basename(short))
    p = out["pipelined"] = measure_pipelined(short, H)
    out["sync_pipelined_idle_fraction"] = p["idle_fraction"]

    target = sync10["block_compute_ms"] / 1000  # compute time of H steps on one block, as measured above
    log("async: one epoch of %s, target_job_seconds %.2f", os.path.basename(short), target)
    s = out["async"] = measure_async(short, H, target)
    out["async_vs_sync"] = s["images_per_s"] / sync10["sparkcnn_images_per_s"]
    out["async_by_steps"] = {}  # the jobs transport's async at H ~ 1 and ~ 50 (jobs sized alike)
    for h in (1,) if a.quick else (1, 50):  # --quick's slice holds too few jobs of 50 steps
        log("async H~%d: one epoch of %s", h, os.path.basename(short))
        out["async_by_steps"][str(h)] = measure_async(short, h, target * h / H)

    out["stream"] = {}
    for name, (h, mode, extra) in STREAM_CASES.items():
        if a.quick and h == 50:  # --quick's slice holds too few exchanges of 50 steps
            continue
        log("stream %s: one epoch of %s", name, os.path.basename(short))
        out["stream"][name] = measure_stream(short, h, mode, extra,
                                             reps=1 if a.quick or name not in TARGET_CASES else STREAM_REPS)

    # each stream case's own variant on the jobs transport (same slice, mode, H and compression):
    # a case more than ACCURACY_GATE below it, or without it, did not train and gets no efficiency
    refs = {reference_key("async", H, False): s["test_accuracy"], reference_key("sync", H, False): p["test_accuracy"]}
    if "1" in out["async_by_steps"]:
        refs[reference_key("async", 1, False)] = out["async_by_steps"]["1"]["test_accuracy"]
    for name, m in out["stream"].items():
        _, mode, extra = STREAM_CASES[name]
        h = m.get("steps_per_exchange") or STREAM_CASES[name][0]
        key = reference_key(mode, h, bool(extra))
        if "error" in m or key in refs:
            continue
        log("jobs reference %s: one epoch of %s", key, os.path.basename(short))
        refs[key] = (measure_async(short, h, target * h / H, extra=extra) if mode == "async"
                     else measure_pipelined(short, h, extra=extra))["test_accuracy"]
    out["jobs_test_accuracy"] = refs
    for name, m in out["stream"].items():
        if "error" in m:
            continue
        h, mode, extra = STREAM_CASES[name]
        m["jobs_reference_accuracy"] = ref = refs.get(reference_key(mode, h, bool(extra)))
        m["trained"] = trained(m, ref)
    for m, key in [*((m, "sparkcnn_images_per_s") for m in out["by_steps_per_round"].values()),
                   (p, "images_per_s"), (s, "images_per_s"),
                   *((m, "images_per_s") for m in out["async_by_steps"].values()),
                   *((m, "images_per_s") for m in out["stream"].values() if "error" not in m and m["trained"])]:
        m["ratio_vs_keras"] = m[key] / keras_ips
        m["efficiency_vs_limit"] = m[key] / limit_ips  # every case against the run's one limit
        wall_ms = m.pop("wall_ms_per_round", None) or m["round_wall_ms"]
        m["cpu"] = cpu_account(m.pop("cpu_ms_per_round"), m.pop("images_per_round"), wall_ms, limit_ips, BLOCKS)

    targets = {"ratio_vs_keras@50": (">=", 0.9, out["by_steps_per_round"]["50"]["ratio_vs_keras"]),
               "efficiency_vs_limit@50": (">=", 0.85, out["by_steps_per_round"]["50"]["efficiency_vs_limit"]),
               "pipelined.efficiency_vs_limit@10": (">=", 0.9, p["efficiency_vs_limit"]),
               "async.efficiency_vs_limit@10": (">=", 0.9, s["efficiency_vs_limit"]),
               "sync_pipelined_idle_fraction": ("<=", 0.05, p["idle_fraction"]),
               "async_vs_sync": (">=", 0.95, out["async_vs_sync"]),
               **{f"stream.{k}.efficiency_vs_limit": (">=", v, out["stream"][k].get("efficiency_vs_limit", 0.0))
                  for k, v in TARGET_CASES.items()}}
    out["targets"] = {k: f"{op} {v}" for k, (op, v, _) in targets.items()}
    out["targets_met"] = {k: (x >= v if op == ">=" else x <= v) for k, (op, v, x) in targets.items()}
    out["bench_wall_s"] = time.perf_counter() - t_start
    emit(out)
    return out


if __name__ == "__main__":
    sys.exit(exit_status("throughput", main()))
