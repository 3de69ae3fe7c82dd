"""The driver's GPU checks (``sparkcnn.backends.gpus``): refused settings in one line, the one log line
of accepted ones, and the Python worker reuse a session gets. A worker's binding is
``tests/spark/test_devices.py``; Spark placing fake GPUs on a cluster, ``tests/cluster/test_cluster_gpus.py``."""

import logging
import os
import subprocess
import sys

import pytest

from sparkcnn.backends import gpus
from sparkcnn.errors import BadInput

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTER = "spark://10.0.0.1:7077"
EXE, TASK, REUSE = gpus.EXECUTOR_GPUS, gpus.TASK_GPUS, gpus.REUSE


@pytest.mark.parametrize("settings,master,message", [
    ({EXE: "2", TASK: "2"}, CLUSTER,
     "spark.task.resource.gpu.amount=2: sparkcnn trains one model replica per task on one GPU (no multi-GPU "
     "strategy); use 1, or a fraction to share a GPU between tasks"),
    ({EXE: "4", TASK: "1.5", REUSE: "false"}, CLUSTER, "spark.task.resource.gpu.amount=1.5: sparkcnn trains"),
    ({EXE: "1", TASK: "1"}, "local[2]",
     "spark.task.resource.gpu.amount=1 on master local[2]: local mode assigns tasks no GPUs and they would wait "
     "forever; use a cluster master, or unset it to train on the CPU"),
    ({EXE: "2", TASK: "1", REUSE: "true"}, CLUSTER,
     "spark.python.worker.reuse=true (Spark's default) with spark.executor.resource.gpu.amount=2: a reused Python "
     "worker keeps "
     "the GPU its TensorFlow started on, and its next task may be assigned another; set "
     "spark.python.worker.reuse=false, or give each executor one GPU"),
    ({EXE: "2", TASK: "0.5"}, CLUSTER, "spark.python.worker.reuse=true (Spark's default) with"),  # unset
    ({TASK: "one"}, CLUSTER, "spark.task.resource.gpu.amount='one' is not a number"),
    ({EXE: "-1"}, CLUSTER, "spark.executor.resource.gpu.amount='-1' must be a finite amount >= 0"),
    ({EXE: "1.5", TASK: "0.5"}, CLUSTER, "spark.executor.resource.gpu.amount='1.5' must be a whole number"),
])
def test_refused_gpu_settings_fail_in_one_line_naming_the_setting(settings, master, message):
    with pytest.raises(BadInput) as err:
        gpus.check(gpus.plan(settings, master))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.parametrize("settings,line,reuse", [
    ({}, "GPUs: none assigned (spark.task.resource.gpu.amount unset): TensorFlow trains on the CPU", "true"),
    ({EXE: "2"}, "GPUs: executors hold 2 GPUs each but spark.task.resource.gpu.amount is unset, so Spark "
                 "assigns tasks none: TensorFlow trains on the CPU", "true"),
    ({EXE: "1", TASK: "1"}, "GPUs: spark.task.resource.gpu.amount=1 with 1 per executor: each task trains on "
                            "its own GPU address; Python workers reused", "true"),
    ({EXE: "1", TASK: "0.25"}, "GPUs shared: spark.task.resource.gpu.amount=0.25 with 1 per executor: up to 4 "
                               "tasks train on each GPU address at once; Python workers reused", "true"),
    ({EXE: "2", TASK: "1", REUSE: "false"}, "GPUs: spark.task.resource.gpu.amount=1 with 2 per executor: each "
     "task trains on its own GPU address; Python workers not reused, each task starts its own TensorFlow",
     "false"),
    ({EXE: "4", TASK: "0.5", REUSE: "False"}, "GPUs shared: spark.task.resource.gpu.amount=0.5 with 4 per "
     "executor: up to 2 tasks train on each GPU address at once; Python workers not reused, each task starts its "
     "own TensorFlow", "false"),
])
def test_accepted_gpu_settings_give_one_line_and_the_reuse_to_fill_in(settings, line, reuse):
    assert gpus.check(gpus.plan(settings, CLUSTER)) == line
    # what a session opened without spark.python.worker.reuse gets
    assert gpus.reuse_setting({k: v for k, v in settings.items() if k != REUSE}, CLUSTER) == reuse


def test_local_cluster_masters_have_executors():
    assert gpus.plan({EXE: "1", TASK: "1"}, "local-cluster[2,1,1024]").local is False
    assert gpus.plan({}, "local[*]").local is True


@pytest.mark.spark
def test_a_session_without_gpus_is_checked_with_one_cpu_line(spark, caplog):
    with caplog.at_level(logging.INFO, logger="sparkcnn.backends.gpus"):
        p = gpus.check_session(spark)
    assert (p.executor, p.task, p.reuse) == (0, 0.0, True)
    assert [r.getMessage() for r in caplog.records if r.name == "sparkcnn.backends.gpus"] == [
        "GPUs: none assigned (spark.task.resource.gpu.amount unset): TensorFlow trains on the CPU"]


def test_train_refuses_more_than_one_gpu_per_task_before_it_starts(tiny_data, tmp_path):
    """The CLI as a user runs it, with the GPU settings spark-submit would pass: exit 2, one error
    line, no session started (no Spark job), nothing written."""
    runs = tmp_path / "runs"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_GATEWAY_")}
    # nothing listens on port 9: a session that started anyway would fail with another error
    env.update(PYTHONPATH=os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p),
               PYSPARK_SUBMIT_ARGS=f"--master spark://127.0.0.1:9 --conf {EXE}=2 --conf {TASK}=2 pyspark-shell")
    proc = subprocess.run([sys.executable, "-m", "sparkcnn", "train", "--no-progress",
                           "--set", f"data.path={tiny_data}", "--set", f"run.out_dir={runs}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("sparkcnn train: error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert errors == ["sparkcnn train: error: spark.task.resource.gpu.amount=2: sparkcnn trains one model "
                      "replica per task on one GPU (no multi-GPU strategy); use 1, or a fraction to share a "
                      "GPU between tasks"], proc.stderr[-3000:]
    assert not runs.exists() or list(runs.iterdir()) == []  # the run directory it made is gone again
