"""The measurements behind bench/costmodel.py: one setup (local[2], or a 2-worker standalone
cluster on loopback), a small grid of exchanges and the micro-measurements of its constants.

Grid: jobs (sync) and stream (async) x H in {1, 10} x dense / sparse (uplink 0.001, downlink
0.01, no warm-up), each ``SyncEngine``/``StreamEngine.run()`` over one epoch of a slice of
Fashion-MNIST on 2 blocks; images/s between completions (warm-up and drain left out, as in
bench/throughput.py), bytes per exchange and the CPU per exchange of every process on the
setup (this driver, its JVM, the executors' JVMs and Python workers).

Inputs of the model, measured on the setup itself: the loopback bandwidth (a socket copy);
its fixed costs (:func:`fixed_costs`): one step's time and CPU, both blocks training at once in the
setup's warm Spark Python workers with no exchange (bench/throughput.py's compute limit),
and the wall of an empty Spark job of 1 and of 2 tasks with the CPU of this driver and the
JVMs for it (bench/jobcost.py's way: 30 warm-up jobs first, Python workers left out), taken
back to back in the same session before and after the grid (the step: their mean, the load
drifts; a job: after the grid, warm as the grid's measured windows are).
Micro-measurements behind the fitted constants: the driver's apply by payloads and
entries, threshold selection per parameter.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from contextlib import ExitStack

import numpy as np

from bench._common import CpuMeter, TimedSink, ensure_data, log, proc_stat, slice_data, spark_backend, steady_rate

BLOCKS, BATCH = 2, 64
SPARSE = ["compression.method=threshold", "compression.density=0.001", "compression.density_down=0.01",
          "compression.warmup_epochs=0"]
WARM_JOBS = 30  # warm-up jobs of each kind before a Spark job's cost is taken, as bench/jobcost.py
CASES = {f"{tr}_{mode}_h{h}_{kind}": (tr, mode, h, kind) for tr, mode in (("jobs", "sync"), ("stream", "async"))
         for h in (1, 10) for kind in ("dense", "sparse")}


class TreeCpuMeter(CpuMeter):
    """:class:`CpuMeter` that also counts the descendants of ``roots()`` (the executor JVMs of a
    standalone cluster, launched by its workers, not by this process): JVMs as ``jvm``, their
    Python workers as ``workers``."""

    def __init__(self, roots=lambda: (), rescan_s: float = 5.0):
        super().__init__(rescan_s)
        self.roots = roots

    def _scan(self) -> None:
        super()._scan()
        roots = set(self.roots())
        if not roots:
            return
        parent, names = {}, {}
        for entry in os.listdir("/proc"):
            if entry.isdigit() and (st := proc_stat(int(entry))) is not None:
                parent[int(entry)], _, names[int(entry)] = st
        for pid in parent:
            p, hops = pid, 0
            while p not in roots and p in parent and hops < 8:
                p, hops = parent[p], hops + 1
            if p in roots:
                self._pids[pid] = "jvm" if names[pid] == "java" else "workers"


def loopback_bandwidth(megabytes: int) -> float:
    """Bytes/s of one TCP connection on 127.0.0.1: ``megabytes`` MiB sent in 1 MiB writes."""
    srv = socket.create_server(("127.0.0.1", 0))
    got = [0]

    def drain():
        conn, _ = srv.accept()
        buf = bytearray(1 << 20)
        with conn:
            while (n := conn.recv_into(buf)):
                got[0] += n

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    chunk = os.urandom(1 << 20)
    with socket.create_connection(srv.getsockname()) as c:
        t0 = time.perf_counter()
        for _ in range(megabytes):
            c.sendall(chunk)
        c.shutdown(socket.SHUT_WR)
        t.join()
        dt = time.perf_counter() - t0
    srv.close()
    return got[0] / dt


def job_costs(setup: "Setup", backend, jobs: int) -> dict:
    """Wall and CPU seconds of one Spark job of 1 and of 2 empty tasks, as bench/jobcost.py
    measures them: after :data:`WARM_JOBS` warm-up jobs of each kind (a cold job costs several
    times a warm one's CPU), the CPU of this driver and of the JVMs only (the driver's; on a
    cluster the executors' too), not of idle Python workers: {"wall_s": {"1": …, "2": …}, "cpu_s": …}.
    And what each byte of a task's result adds to both, from jobs of 2 tasks that return a dense
    delta's bytes each (``byte_wall_s``, ``byte_cpu_s``: seconds per byte): Spark's result path
    (the executor's JVM, its RPC to the driver's, the driver's unpickling) is the setup's, as the
    link is. And what a new broadcast of the model in each job's closure adds (``bcast_wall_s``,
    ``bcast_cpu_s``: seconds per job, :func:`broadcast_jobs`)."""
    from bench.jobcost import DENSE_DELTA_BYTES, measure as measure_jobs

    jvm = int(setup.spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid())
    kinds = {"1": ([0], 0), "2": ([0, 1], 0), "2 with results": ([0, 1], DENSE_DELTA_BYTES)}
    for blocks, data in kinds.values():
        measure_jobs(backend, blocks, data, WARM_JOBS, jvm)
    wall, cpu = {}, {}
    for kind, (blocks, data) in kinds.items():
        executors = list(setup.roots())  # executor JVMs (none in local mode: one JVM)
        r = measure_jobs(backend, blocks, data, jobs, jvm, executors)
        wall[kind] = r["wall_ms_per_job"] / 1000
        cpu[kind] = (r["jvm_cpu_ms_per_job"] + r["driver_cpu_ms_per_job"]
                     + r["executors_cpu_ms_per_job"]) / 1000
    moved = 2 * DENSE_DELTA_BYTES
    b = broadcast_jobs(backend, jobs, jvm, setup.roots)
    return {"wall_s": {k: wall[k] for k in ("1", "2")}, "cpu_s": {k: cpu[k] for k in ("1", "2")},
            "byte_wall_s": max(0.0, (wall["2 with results"] - wall["2"]) / moved),
            "byte_cpu_s": max(0.0, (cpu["2 with results"] - cpu["2"]) / moved),
            "bcast_wall_s": max(0.0, b["wall_s"] - wall["2"]), "bcast_cpu_s": max(0.0, b["cpu_s"] - cpu["2"])}


def broadcast_jobs(backend, jobs: int, jvm: int, roots) -> dict:
    """Wall and CPU seconds of a job of 2 empty tasks whose closure holds a new broadcast of a
    dense model's bytes, the older ones destroyed two jobs later, as the jobs transport sends
    every version (the tasks of a sparse downlink never read its value, yet each executor's JVM
    fetches a broadcast its task's closure names): after :data:`WARM_JOBS` warm-up jobs."""
    from bench.jobcost import DENSE_DELTA_BYTES, time_jobs

    data, held = os.urandom(DENSE_DELTA_BYTES), []

    def one() -> None:
        bc = backend.broadcast(data)
        held.append(bc)
        backend.map_blocks(lambda block, ctx: (bc, b"")[1], [0, 1], "sparkcnn costmodel broadcast", universe=2)
        while len(held) > 2:
            backend.unpersist(held.pop(0))

    for _ in range(WARM_JOBS):
        one()
    t = time_jobs(one, jobs, jvm, roots())
    for bc in held:
        backend.unpersist(bc)
    return {"wall_s": t["wall_s"], "cpu_s": t["jvm_cpu_s"] + t["driver_cpu_s"] + t["executors_cpu_s"]}


def fixed_costs(setup, data: str, tag: str, quick: bool, rows_per_block: int, *, jobs: bool = True) -> dict:
    """The setup's fixed costs, back to back in one probe engine's executors: one step of
    each block trained alone in the setup's warm Spark Python workers, both at once, no
    exchange (bench/throughput.py's compute limit: ``t_step``, s), and with ``jobs``
    :func:`job_costs`. ``data`` must hold full batches for every step the limit takes
    (``rows_per_block``)."""
    from bench.throughput import _limit_task

    steps = 30 if quick else 60
    if (steps + 5) * BATCH > rows_per_block:  # past its rows a block's batches are empty, and fast
        raise ValueError(f"fixed_costs: {rows_per_block} rows per block, {steps + 5} batches of {BATCH} needed")
    probe = setup.engine(data, f"cost-{setup.name}-probe-{tag}", [])
    layout = tuple(int(s) for s in probe.spec.layout)
    limit = probe.backend.map_blocks(_limit_task(probe.spec, steps), list(range(BLOCKS)),
                                     "sparkcnn costmodel step time", universe=BLOCKS)
    costs = job_costs(setup, probe.backend, 10 if quick else 30) if jobs else {}
    probe.backend.close()
    step_ms = float(np.mean([r["step_ms"] for r in limit]))
    step_cpu_ms = float(np.mean([r["step_cpu_ms"] for r in limit]))
    log("%s (%s): step %.1f ms (%.1f ms CPU)", setup.name, tag, step_ms, step_cpu_ms)
    if costs:
        log("%s (%s): empty job of 2 tasks %.1f ms wall, %.1f ms CPU, %.1f ns CPU per result byte, "
            "a broadcast per job %.1f ms CPU", setup.name, tag, 1000 * costs["wall_s"]["2"],
            1000 * costs["cpu_s"]["2"], 1e9 * costs["byte_cpu_s"], 1000 * costs["bcast_cpu_s"])
    return {"layout": layout, "t_step": step_ms / 1000, "t_cpu": step_cpu_ms / 1000, **costs}


def apply_rows(layout: tuple, repeat: int) -> list[dict]:
    """The driver's ``apply_deltas`` seconds for n payloads of each kind (0.001, 0.01, dense)."""
    from bench.scale import best_of, random_delta
    from sparkcnn.compression import SparseDelta, decode, encode
    from sparkcnn.server.apply import apply_deltas
    from sparkcnn.ps import ParameterServer

    rng = np.random.default_rng(0)
    size = sum(layout)
    ps = ParameterServer(np.ones(size, np.float32), layout, density_down=None)
    dense = SparseDelta(size, np.arange(size), (rng.standard_normal(size) * 1e-3).astype(np.float32))
    kinds = {"0.001": [encode(random_delta(layout, 0.001, rng), layout) for _ in range(4)],
             "0.01": [encode(random_delta(layout, 0.01, rng), layout) for _ in range(4)],
             "dense": [encode(dense, layout, value_dtype="float32")] * 4}
    rows = []
    for kind, payloads in kinds.items():
        entries = decode(payloads[0], layout).nnz
        for n in (1, 2, 4):
            wall, _ = best_of(lambda: apply_deltas(ps, payloads[:n], [64] * n, [1e-3] * n), repeat)
            rows.append({"kind": kind, "payloads": n, "entries": n * entries, "s": wall})
    return rows


def select_s_per_param(params: int, repeat: int) -> float:
    """Threshold selection at density 0.001 of a ``params`` vector, seconds per parameter."""
    from bench.scale import best_of
    from sparkcnn.compression import Sparsifier

    flat = np.random.default_rng(1).standard_normal(params).astype(np.float32)
    wall, _ = best_of(lambda: Sparsifier("threshold", dense_below=16384).indices(flat, (params,), 0.001), repeat)
    return wall / params


def codec_k(layout: tuple) -> float:
    """Bytes per sparse entry of the codec at density 0.001 over the tensors sent sparse."""
    from bench.scale import random_delta
    from sparkcnn.compression import encode

    big = (sum(s for s in layout if s >= 16384),)  # one tensor: every entry a sparse candidate
    d = random_delta(big, 0.001, np.random.default_rng(2))
    return len(encode(d, big)) / max(1, d.nnz)


class Setup:
    """A Spark session on ``local[2]`` or on a standalone cluster of 2 one-core workers."""

    def __init__(self, name: str, stack: ExitStack):
        self.name, self.roots = name, (lambda: ())
        if name == "local":
            from sparkcnn.backends.session import get_or_create_spark

            self.spark = get_or_create_spark("local[2]", "sparkcnn-costmodel")
            stack.callback(self.spark.stop)
        else:
            from sparkcnn.testing.standalone import StandaloneCluster, session

            cluster = stack.enter_context(StandaloneCluster(workers=2, cores_per_worker=1).start(timeout=180))
            self.spark = session(cluster, "sparkcnn-costmodel", timeout=180)
            stack.callback(self.spark.stop)
            self.roots = lambda: [p for ps in cluster.executor_pids().values() for p in ps]

    def engine(self, data: str, run_id: str, overrides: list[str], sink=None):
        from sparkcnn import config
        from sparkcnn.train import build_engine

        cfg = config.load(None, [f"data.path={data}", f"data.num_blocks={BLOCKS}", f"train.batch_size={BATCH}",
                                 "train.epochs=1", "data.test_blocks=1", *overrides])
        engine, _ = build_engine(cfg, spark_backend(self.spark, run_id), run_id, sink=sink)
        log("%s: blocks loaded and models built in %.1f s", run_id, engine.warmup_s)
        return engine


def run_case(setup: Setup, data: str, name: str) -> dict:
    """One grid point: ``engine.run()`` over one epoch of ``data``, steady window only."""
    tr, mode, h, kind = CASES[name]
    sink = TimedSink(TreeCpuMeter(setup.roots))
    engine = setup.engine(data, f"cost-{setup.name}-{name}".replace("_", "-"),
                          [f"train.steps_per_round={h}", f"engine.mode={mode}", f"engine.transport={tr}",
                           *(SPARSE if kind == "sparse" else [])], sink=sink)
    run = engine.run()
    sink.close()
    engine.backend.close()
    rows = sink.rounds()
    first, last = (2, 1) if tr == "jobs" else (2 * BLOCKS, 2)
    rate = steady_rate(rows, skip_first=first, skip_last=last)
    steady = [r for _, r in rows[rate["first"]:rate["last"] + 1]][1:]
    exchanges = sum(r.get("blocks", 1) for r in steady)
    c0, c1 = sink.cpu_of(rows[rate["first"]][1]), sink.cpu_of(rows[rate["last"]][1])
    return {"transport": tr, "mode": mode, "steps": h, "dense": kind == "dense",
            "images_per_s": rate["images_per_s"], "exchanges": exchanges, "window_s": rate["window_s"],
            # a sync round's compute_s is its slowest task's: the tasks' own times, per step
            "compute_ms_per_step": 1000 * sum(sum(r["task_compute_s"].values()) if "task_compute_s" in r
                                              else r["compute_s"] for r in steady)
            / max(1, sum(h * r["blocks"] if "task_compute_s" in r else r["steps"] for r in steady)),
            "bytes_up_per_exchange": sum(r["bytes_up"] for r in steady) / exchanges,
            "bytes_down_per_exchange": sum(r["bytes_down"] for r in steady) / exchanges,
            "cpu_ms_per_exchange": {k: 1000 * (c1[k] - c0[k]) / exchanges for k in c0},
            "run_wall_s": run["wall_s"]}


def measure(setup_name: str, quick: bool) -> dict:
    """Every measurement of one setup, as the JSON record bench/costmodel.py fits."""
    t0 = time.perf_counter()
    steps, steps_h1_jobs = (60, 20) if quick else (240, 60)  # per block and epoch
    data = ensure_data()
    main = slice_data(data, steps * BATCH * BLOCKS, 1000)
    short = slice_data(data, steps_h1_jobs * BATCH * BLOCKS, 1000)
    bandwidth = loopback_bandwidth(128 if quick else 384)  # MiB
    log("%s: loopback %.2f GB/s", setup_name, bandwidth / 1e9)
    with ExitStack() as stack:
        setup = Setup(setup_name, stack)
        log("%s: session up in %.1f s", setup_name, time.perf_counter() - t0)
        rows = steps * BATCH  # per block of ``main``: full batches for the step-time probe
        # the step before and after the grid; a Spark job's costs after it only (see inputs)
        before = fixed_costs(setup, main, "before", quick, rows, jobs=False)
        # one unmeasured case first: the first sparse exchange in each Python worker traces its TF
        # functions, which cost a short grid point's window a third of its images/s
        run_case(setup, short, "jobs_sync_h1_sparse")
        cases = {}
        for name, (tr, _, h, _) in CASES.items():
            log("%s: %s", setup_name, name)
            cases[name] = run_case(setup, short if (tr, h) == ("jobs", 1) else main, name)
        after = fixed_costs(setup, main, "after", quick, rows)
    layout = before.pop("layout")
    after.pop("layout")
    return {"setup": setup_name, "quick": quick,
            "inputs": {"n": BLOCKS, "cores": os.cpu_count(), "bandwidth": bandwidth, "params": sum(layout),
                       "small_params": sum(s for s in layout if s < 16384), "batch": BATCH,
                       # measured on this setup: the step, the mean of before and after the grid;
                       # a Spark job's cost after it, warm as the grid's measured windows are (before
                       # the grid, right after the session starts, an empty job took 3x its wall)
                       "t_step": (before["t_step"] + after["t_step"]) / 2,
                       "t_cpu": (before["t_cpu"] + after["t_cpu"]) / 2,
                       "job_wall_s": after["wall_s"], "job_cpu_s": after["cpu_s"],
                       "job_byte_wall_s": after["byte_wall_s"], "job_byte_cpu_s": after["byte_cpu_s"],
                       "job_bcast_wall_s": after["bcast_wall_s"], "job_bcast_cpu_s": after["bcast_cpu_s"],
                       "bytes_per_nonzero": codec_k(layout)},
            "micro": {"fixed_before": before, "fixed_after": after,
                      "apply": apply_rows(layout, 2 if quick else 5),
                      "select_s_per_param": select_s_per_param(sum(layout), 3 if quick else 5)},
            "cases": cases, "wall_s": time.perf_counter() - t0}
