"""GPUs placed by Spark on a standalone cluster with fake GPUs: the driver, and the assignment table.

    python tests/gpu_driver.py SPEC.json   # the driver of tests/cluster/test_cluster_gpus.py
    python tests/gpu_driver.py             # on its own: tiny data, a fake-GPU cluster, the table as JSON

One worker of 2 cores declares the GPU addresses ``0`` and ``1`` through a discovery script
(``StandaloneCluster(worker_gpus=...)``); ``tensorflow-cpu`` sees no GPU, so the addresses are
only ever Spark's bookkeeping and the tasks' ``CUDA_VISIBLE_DEVICES``. The applications of
:data:`APPS` run one after another in this process, each a SparkSession opened by sparkcnn's
``get_or_create_spark`` with the GPU settings as a caller's (``spark.python.worker.reuse`` left
to sparkcnn), each training a small sync run on the jobs transport (2 blocks, 2 rounds). Per
application ``out`` receives the settings the session got, the ``sparkcnn.backends.gpus`` log
lines, the run's exit status and error line, its phases' seconds, and the assignment table: one
row per round and block from the run's ``metrics.jsonl`` (executor id, Python worker pid, the
addresses of the task context, and the ``CUDA_VISIBLE_DEVICES`` its TensorFlow ran with).

Executors run Spark's Python daemon from ``tests.cluster_driver``, which imports TensorFlow
before forking workers (imported, not started: a worker still binds its own devices), so a
fresh worker per task costs a model build and tracing, not a TensorFlow import.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ADDRESSES = ["0", "1"]  # the one worker's fake GPUs
CORES = 2
BLOCKS, BATCH, H = 2, 32, 10  # tiny data: 600 rows per block, 19 steps per epoch: 2 rounds

GPU_EXEC, GPU_TASK = "spark.executor.resource.gpu.amount", "spark.task.resource.gpu.amount"
# name -> the application's Spark settings, as a caller gives them (the test says what each must do)
APPS = {
    # above 1: refused in one line before the session starts
    "refused": {GPU_EXEC: "2", GPU_TASK: "2", "spark.executor.cores": "2"},
    # one executor holding both addresses, one per task: no Python worker reuse (filled in)
    "several": {GPU_EXEC: "2", GPU_TASK: "1", "spark.executor.cores": "2"},
    # one executor holding one address that its 2 concurrent tasks share: workers reused
    "shared": {GPU_EXEC: "1", GPU_TASK: "0.5", "spark.executor.cores": "2"},
    # no GPU asked for: the CPU, with one log line
    "cpu": {"spark.executor.cores": "2"},
}
KEYS = ("spark.python.worker.reuse", GPU_EXEC, GPU_TASK)


# the training split as a DataFrame, without test data: no evaluation tasks (each a fresh Python
# worker where workers are not reused)
OVERRIDES = ["data.image_shape=[28, 28, 1]", f"data.num_blocks={BLOCKS}", "train.epochs=1",
             f"train.batch_size={BATCH}", f"train.steps_per_round={H}", "train.lr=0.05",
             "train.lr_warmup_epochs=0", "train.lr_schedule=constant"]


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def assignment(run_dir: str) -> list[dict]:
    """One row per (round, block) of a run's metrics: where the task ran and on which GPUs."""
    from sparkcnn.metrics import read_jsonl

    rows = []
    for rec in read_jsonl(os.path.join(run_dir, "metrics.jsonl")):
        if rec["kind"] != "round":
            continue
        for block in sorted(rec["task_pids"], key=int):
            rows.append({"round": rec["round"], "block": int(block),
                         # "host:<work dir>/<app>/<executor id>": the executor's id
                         "executor": rec["task_executors"][block].rsplit("/", 1)[-1],
                         "pid": rec["task_pids"][block], "task_gpus": rec["task_gpus"][block],
                         "cuda_visible_devices": rec["task_devices"][block]})
    return rows


def run_app(name: str, cluster, data: str, root: str) -> dict:
    """Open application ``name`` of :data:`APPS` on ``cluster``, train, stop; what it saw."""
    from pyspark import SparkContext

    from sparkcnn import config
    from sparkcnn.backends.session import get_or_create_spark
    from sparkcnn.testing.standalone import FAST_START_JAVA_OPTS, wait_for_executors
    from sparkcnn.errors import SparkCNNError
    from sparkcnn.train import train

    lines = _Lines()
    logging.getLogger("sparkcnn.backends.gpus").addHandler(lines)
    t0 = time.monotonic()
    conf = {"spark.driver.host": cluster.host, "spark.driver.bindAddress": cluster.host,
            "spark.ui.enabled": "false", "spark.executor.extraJavaOptions": FAST_START_JAVA_OPTS,
            "spark.python.daemon.module": "tests.cluster_driver", "spark.executorEnv.PYTHONPATH": REPO,
            "spark.executorEnv.TF_CPP_MIN_LOG_LEVEL": "2", **APPS[name]}
    run_dir = os.path.join(root, name)
    out = {"app": name, "conf": None, "exit": 0, "error": None, "jobs": 0, "phases_s": {}}

    def phase(what: str) -> None:  # seconds since the previous phase ended
        out["phases_s"][what] = round(time.monotonic() - t0 - sum(out["phases_s"].values()), 1)

    try:
        spark = get_or_create_spark(cluster.master_url, app_name=f"fake-gpus-{name}", conf=conf)
    except SparkCNNError as e:  # refused before a session (and its executors) started
        spark = None
        out.update(exit=e.exit_code, error=str(e), session=SparkContext._active_spark_context is not None)
    phase("session")
    try:
        if spark is not None:
            sc = spark.sparkContext
            out["conf"] = {k: sc.getConf().get(k, None) for k in KEYS}
            wait_for_executors(spark, cluster, 1, timeout=180)
            phase("executor")
            try:
                train(config.load(None, OVERRIDES), run_dir=run_dir, spark=spark,
                      data=spark.read.parquet(os.path.join(data, "train")))
            except SparkCNNError as e:
                out.update(exit=e.exit_code, error=str(e))
            out["jobs"] = int(sc._jsc.sc().dagScheduler().nextJobId())
            phase("train")
    finally:
        if spark is not None:
            spark.stop()
            phase("stop")
        logging.getLogger("sparkcnn.backends.gpus").removeHandler(lines)
    out.update(log=lines.lines, run_dir_exists=os.path.isdir(run_dir), seconds=round(time.monotonic() - t0, 1),
               table=assignment(run_dir) if out["exit"] == 0 else [])
    return out


def drive(cluster, data: str, root: str, out_path: str | None = None) -> list[dict]:
    """Every application of :data:`APPS` in turn; ``out_path`` is rewritten after each."""
    from pyspark import SparkContext

    os.environ["SPARK_LOCAL_IP"] = cluster.host  # the driver JVM binds loopback only
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    # the JVM up first: settings given at its launch would stay in its system properties and
    # reach every later application of this process (the "cpu" one would inherit GPUs)
    SparkContext._ensure_initialized()
    results = []
    for name in APPS:
        results.append(run_app(name, cluster, data, root))
        if out_path:
            with open(out_path + ".tmp", "w", encoding="utf-8") as fh:
                json.dump(results, fh, indent=1)
            os.replace(out_path + ".tmp", out_path)
    return results


def cluster_kwargs() -> dict:
    return {"workers": 1, "cores_per_worker": CORES, "worker_gpus": {0: ADDRESSES}}


def main() -> int:
    """On its own: tiny data and the cluster in a temporary directory; prints the tables as JSON."""
    from sparkcnn.data.prepare import prepare
    from sparkcnn.data.synthetic import make_fake_fashion
    from sparkcnn.testing.standalone import StandaloneCluster

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    tmp = tempfile.mkdtemp(prefix="sparkcnn-fake-gpus-")
    try:
        data = os.path.join(tmp, "prepared")
        prepare("idx", make_fake_fashion(os.path.join(tmp, "raw"), 1200, 400, seed=3), data)
        with StandaloneCluster(**cluster_kwargs()).start(timeout=120) as cluster:
            results = drive(cluster, data, os.path.join(tmp, "runs"))
        keys = ("app", "conf", "exit", "error", "log", "seconds", "phases_s", "table")
        print(json.dumps([{k: r[k] for k in keys} for r in results], indent=1))
        return 0 if all(r["exit"] == (2 if r["app"] == "refused" else 0) for r in results) else 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.path.insert(0, REPO)  # this repository's sparkcnn, as the executors get (spark.executorEnv.PYTHONPATH)
    if sys.argv[1:2] and sys.argv[1].endswith(".json"):
        from sparkcnn.testing.standalone import StandaloneCluster

        logging.basicConfig(level=logging.INFO, stream=sys.stderr)
        with open(sys.argv[1], encoding="utf-8") as fh:
            spec = json.load(fh)
        drive(StandaloneCluster.attach(spec["cluster"]), spec["data"], spec["root"], spec["out"])
        sys.exit(0)
    sys.exit(main())
