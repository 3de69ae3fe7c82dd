"""Driver process for the cluster-tier training tests (one SparkContext per process).

    python tests/cluster_driver.py SPEC.json

``SPEC.json``::

    {"master": "local[2,4]",            # or null with "cluster": StandaloneCluster.to_json()
     "cluster": null,
     "conf": {"spark.python.daemon.module": "tests.cluster_driver"},  # optional Spark settings
     "runs": [{"run_dir": ".../runs/clean", "overrides": ["data.path=...", ...]}, ...],
     "out": ".../driver.json"}

Every run trains in order in one Spark session, so JVM, executor and TensorFlow start-up
are paid once. Per run, ``out`` receives the exit status ``sparkcnn train`` would give (0 ok,
2 bad input, 3 diverged, 1 anything else), the error line, and the number of failed task
attempts Spark saw in the run's jobs (job group ``sparkcnn-<run_id>``). ``out`` is rewritten
after each run, so a test can read the finished runs while later ones still train. The
process exits 0 when every run did.

Started by Spark as its Python daemon (``spark.python.daemon.module=tests.cluster_driver``,
with the repository root on ``PYTHONPATH``), this module imports TensorFlow and sparkcnn's
worker before the daemon forks any worker: a worker that replaces one a failed task attempt
ended (PySpark exits a worker after a task error) or that chaos killed then starts in about a
second instead of paying a TensorFlow import (10-30 s on a busy 2-core machine).
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def failed_attempts(sc, run_id: str) -> int:
    """Failed task attempts in every stage of the run's jobs, from Spark's status tracker."""
    st = sc.statusTracker()
    stages = set()
    for job in st.getJobIdsForGroup(f"sparkcnn-{run_id}"):
        info = st.getJobInfo(job)
        stages.update(info.stageIds if info else ())
    infos = [st.getStageInfo(s) for s in stages]
    return sum(i.numFailedTasks for i in infos if i is not None)


def write_json(path: str, obj) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=2)
    os.replace(tmp, path)


def main(spec_path: str) -> int:
    from sparkcnn import config
    from sparkcnn.errors import SparkCNNError
    from sparkcnn.train import train

    with open(spec_path, encoding="utf-8") as fh:
        spec = json.load(fh)
    # PySpark takes the executors' interpreter from this variable only (spark.pyspark.python
    # is honoured by spark-submit, not by a context created from plain Python)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    if spec.get("cluster"):
        from sparkcnn.testing.standalone import FAST_START_JAVA_OPTS, StandaloneCluster, session

        cluster = StandaloneCluster.attach(spec["cluster"])
        # executors register within seconds on a quiet machine, minutes on a loaded 2-core one
        spark = session(cluster, "sparkcnn-cluster-tests", timeout=240,
                        conf={"spark.executor.extraJavaOptions": FAST_START_JAVA_OPTS,
                              "spark.scheduler.mode": "FAIR", **spec.get("conf", {})})
    else:
        from sparkcnn.backends.session import get_or_create_spark

        spark = get_or_create_spark(spec["master"], app_name="sparkcnn-cluster-tests", conf=spec.get("conf"))
    sc = spark.sparkContext
    results = []
    for run in spec["runs"]:
        run_id = os.path.basename(os.path.normpath(run["run_dir"]))
        res = {"run_dir": run["run_dir"], "exit": 0, "error": None}
        try:
            train(config.load(None, run["overrides"]), run_dir=run["run_dir"])
        except SparkCNNError as e:
            res.update(exit=e.exit_code, error=str(e).splitlines()[0] if str(e) else type(e).__name__)
        except Exception as e:  # noqa: BLE001 - reported per run; the next run still trains
            traceback.print_exc()
            res.update(exit=1, error=f"{type(e).__name__}: {str(e)[:2000]}")
        res["failed_attempts"] = failed_attempts(sc, run_id)
        results.append(res)
        write_json(spec["out"], results)
    spark.stop()
    return 0 if all(r["exit"] == 0 for r in results) else 1


def preloaded_daemon() -> None:
    """PySpark's daemon, after importing what every sparkcnn worker imports."""
    # the daemon reports its port on stdout: keep anything an import prints off it
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        import keras  # noqa: F401
        import tensorflow  # noqa: F401

        import sparkcnn.models  # noqa: F401
        import sparkcnn.worker.jobs  # noqa: F401
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
    from pyspark import daemon

    daemon.manager()


if __name__ == "__main__":
    if sys.argv[1:2] and sys.argv[1].endswith(".json"):
        sys.exit(main(sys.argv[1]))
    preloaded_daemon()  # run by Spark as spark.python.daemon.module (argv: [worker module])
