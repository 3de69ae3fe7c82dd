"""Sessions respect the launcher; the Spark backend's jobs hand tasks their context."""

import json
import logging
import os
import subprocess
import sys

import pytest

import pyspark
from sparkcnn.backends import backend as backends
from sparkcnn.backends import session as B
from sparkcnn.backends.cluster import ClusterView
from sparkcnn.backends.inprocess import LocalBackend
from sparkcnn.backends.spark import SparkBackend
from sparkcnn.protocol import TaskContextInfo

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(REPO, "tests", "session_job.py")
SPARK_HOME = os.path.dirname(pyspark.__file__)


def _sessions(command: list[str], **env_extra) -> list[dict]:
    """Run ``command`` in a fresh process (its own driver JVM) and parse its SESSION lines."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PYSPARK_GATEWAY_") and k not in ("PYSPARK_SUBMIT_ARGS", "SPARKCNN_MASTER")}
    env.update(SPARK_HOME=SPARK_HOME, PYSPARK_PYTHON=sys.executable,
               PYTHONPATH=os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p), **env_extra)
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [json.loads(line[len("SESSION "):]) for line in proc.stdout.splitlines() if line.startswith("SESSION ")]


def test_submit_arguments_name_settings():
    args = ["--master", "local[1]", "--conf", "spark.scheduler.mode=FIFO", "--conf=spark.x=1", "--verbose",
            "--name", "app", "--driver-java-options", "-Xss8m", "job.py", "--master", "local[9]"]
    assert B._submit_settings(args) == {"spark.master": "local[1]", "spark.scheduler.mode": "FIFO",
                                        "spark.x": "1", "spark.app.name": "app",
                                        "spark.driver.extraJavaOptions": "-Xss8m"}
    assert B._submit_settings(["pyspark-shell"]) == {}


def test_local_backend_hands_tasks_their_context():
    backend = LocalBackend("t-ctx")
    assert isinstance(backend, backends.Backend) and issubclass(SparkBackend, backends.Backend)
    assert isinstance(backend.cluster, ClusterView)
    out = backend.map_blocks(lambda b, ctx: (b, ctx), [2, 0, 1], "t", tree_depth=2)
    assert [b for b, _ in out] == [2, 0, 1]
    ctx = out[0][1]
    assert (ctx.attempt, ctx.cores, ctx.gpus) == (0, 1, None) and ctx.local_dir  # None: no scheduler assigned GPUs
    assert backend.cluster.block_homes(2) == {0: "local", 1: "local"}
    assert backend.cluster.session_info() == {"master": "inprocess", "app_id": None}


@pytest.mark.spark
def test_spark_backend_jobs_hand_tasks_their_context(spark):
    backend = SparkBackend(spark, "t-ctx")
    try:
        def fn(b, ctx):
            return b, ctx

        gathered = backend.map_blocks(fn, range(3), "t gather", universe=3, tree_depth=2)
        assert sorted(b for b, _ in gathered) == [0, 1, 2]
        for _, ctx in gathered:
            assert isinstance(ctx, TaskContextInfo)
            assert (ctx.attempt, ctx.cores, ctx.gpus) == (0, 1, ()) and ctx.local_dir
        assert backend.map_blocks(fn, [1], "t subset", universe=3)[0][0] == 1
        assert sorted(b for b, _ in backend.map_blocks(fn, [4, 5], "t plain", tree_depth=2)) == [4, 5]
        assert set(backend.cluster.block_homes(3)) == {0, 1, 2}
        assert backend.cluster.session_info() == {"master": "local[2]", "app_id": spark.sparkContext.applicationId}
    finally:
        backend.close()


@pytest.mark.spark
def test_an_active_session_is_used_as_it_is(spark, caplog):
    with caplog.at_level(logging.WARNING, logger="sparkcnn.backends.backend"):
        assert B.get_or_create_spark("local[3]", conf={"spark.scheduler.mode": "FIFO"}) is spark
    assert spark.sparkContext.master == "local[2]"
    assert spark.sparkContext.getConf().get("spark.scheduler.mode") == "FAIR"
    assert any("engine.master=local[3] ignored" in r.getMessage() for r in caplog.records)


@pytest.mark.spark
def test_spark_submit_settings_are_kept():
    """spark-submit starts the driver JVM before our code runs; what it was given stays."""
    [got] = _sessions([os.path.join(SPARK_HOME, "bin", "spark-submit"), "--master", "local[1]",
                       "--conf", "spark.scheduler.mode=FIFO", "--conf", "spark.sparkcnn.probe=yes",
                       "--name", "userapp", JOB])
    assert got == {"spark.master": "local[1]", "spark.app.name": "userapp", "spark.scheduler.mode": "FIFO",
                   "spark.python.worker.reuse": "true",  # unset: filled in
                   "spark.sparkcnn.probe": "yes"}


@pytest.mark.spark
def test_engine_master_applies_only_when_set():
    # plain Python: no master given -> the default; then engine.master set -> it
    default, chosen = _sessions([sys.executable, JOB, "-", "local[1]"])
    assert (default["spark.master"], chosen["spark.master"]) == ("local[2]", "local[1]")
    assert (default["spark.app.name"], default["spark.scheduler.mode"]) == ("sparkcnn", "FAIR")
    # the launcher's master (PYSPARK_SUBMIT_ARGS) stays unless engine.master is set
    launcher, chosen = _sessions([sys.executable, JOB, "-", "local[3]"],
                                 PYSPARK_SUBMIT_ARGS="--master local[1] pyspark-shell")
    assert (launcher["spark.master"], chosen["spark.master"]) == ("local[1]", "local[3]")


@pytest.mark.spark
def test_local_driver_jvm_gets_c1_unless_the_user_chose(spark, monkeypatch):
    """The driver JVM's options: ours only where nobody (env, PYSPARK_SUBMIT_ARGS, conf) chose."""
    opts = spark.sparkContext.getConf().get("spark.driver.extraJavaOptions", "")
    if "SPARKCNN_DRIVER_JAVA_OPTS" not in os.environ and "driver-java-options" not in os.environ.get(
            "PYSPARK_SUBMIT_ARGS", ""):
        assert B.LOCAL_DRIVER_JAVA_OPTS in opts

    seen = {}

    class Builder:
        def __getattr__(self, name):
            return lambda *a, **k: self

        def config(self, key, value):
            seen[key] = value
            return self

        def getOrCreate(self):
            raise RuntimeError("stop here")

    class Session:
        builder = Builder()

        @staticmethod
        def getActiveSession():
            return None

    monkeypatch.setattr("pyspark.sql.SparkSession", Session)
    for env, conf, expected in (({}, None, B.LOCAL_DRIVER_JAVA_OPTS),
                                ({"SPARKCNN_DRIVER_JAVA_OPTS": "-Xss4m"}, None, "-Xss4m"),
                                ({"SPARKCNN_DRIVER_JAVA_OPTS": ""}, None, None),
                                ({"PYSPARK_SUBMIT_ARGS": "--driver-java-options -Xss8m pyspark-shell"}, None, None),
                                ({}, {"spark.driver.extraJavaOptions": "-Xss2m"}, "-Xss2m")):
        seen.clear()
        for k in ("SPARKCNN_DRIVER_JAVA_OPTS", "PYSPARK_SUBMIT_ARGS"):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        with pytest.raises(RuntimeError, match="stop here"):
            B.get_or_create_spark("local[2]", conf=conf)
        assert seen.get("spark.driver.extraJavaOptions") == expected, (env, conf)
