"""A Python worker's binding of TensorFlow to the GPUs Spark assigned its task
(``sparkcnn.worker.devices``), without a GPU: each case drives one process's binding through the
tasks a reused worker could receive, with its environment and TensorFlow stood in for."""

import json
import os
import subprocess
import sys

import pytest

from sparkcnn.protocol import TaskContextInfo, TaskSpec
from sparkcnn.worker import devices
from sparkcnn.worker.devices import DeviceMismatch, Devices

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Process:
    """A process's TensorFlow for :class:`Devices`: starts when told, lists ``gpus`` GPUs."""

    def __init__(self, started=False, gpus=0):
        self.started, self.gpus = started, gpus


def _devices(env=None, tf=None):
    tf = tf or _Process()
    return Devices(environ={} if env is None else env, started=lambda: tf.started, gpu_count=lambda: tf.gpus), tf


def test_the_first_task_points_tensorflow_at_its_gpus_and_a_reused_worker_keeps_them():
    d, tf = _devices()
    assert d.bind(("1",), "block 0 exchange 0") == "1" and d.environ == {devices.VISIBLE: "1"}
    tf.started = True  # the task's TensorFlow started on GPU 1
    assert d.bind(("1",), "block 1 exchange 1") == "1"  # the next task of this worker: same address
    with pytest.raises(DeviceMismatch) as err:
        d.bind(("0",), "block 0 exchange 2 attempt 0")
    assert str(err.value) == (
        f"block 0 exchange 2 attempt 0: Spark assigned GPU 0 but this Python worker (pid {os.getpid()}) already "
        f"runs TensorFlow with CUDA_VISIBLE_DEVICES='1', which cannot change; set spark.python.worker.reuse=false "
        f"or give each executor one GPU")
    assert d.environ == {devices.VISIBLE: "1"}  # left as TensorFlow read it


def test_before_tensorflow_starts_each_task_rebinds_to_its_own_gpus():
    d, _ = _devices()
    assert d.bind(("0", "1")) == "0,1"
    assert d.bind(("1",)) == "1" and d.environ[devices.VISIBLE] == "1"


def test_no_gpu_from_spark_hides_every_gpu_unless_the_executor_sets_its_own():
    d, tf = _devices()
    assert d.bind(()) == "" and d.environ == {devices.VISIBLE: ""}
    tf.started = True
    assert d.bind(()) == ""
    with pytest.raises(DeviceMismatch, match="Spark assigned GPU 1 but .* CUDA_VISIBLE_DEVICES=''"):
        d.bind(("1",))
    own, _ = _devices(env={devices.VISIBLE: "3"})  # spark.executorEnv.CUDA_VISIBLE_DEVICES=3
    assert own.bind(()) == "3" and own.environ == {devices.VISIBLE: "3"}


def test_a_cpu_task_fails_in_a_worker_whose_tensorflow_holds_a_gpu():
    d, tf = _devices(tf=_Process(gpus=1))
    d.bind(("0",))
    tf.started = True
    with pytest.raises(DeviceMismatch, match="Spark assigned GPU none but"):
        d.bind(())
    tf.gpus = 0  # a TensorFlow that lists no GPU (tensorflow-cpu) trains on the CPU whatever it was given
    assert d.bind(()) == "0"


def test_tensorflow_started_before_any_task_is_taken_as_it_is():
    d, _ = _devices(env={}, tf=_Process(started=True, gpus=0))  # e.g. a daemon that ran TF before forking
    assert d.bind(()) is None  # no GPU assigned, none listed: the CPU
    with pytest.raises(DeviceMismatch, match="CUDA_VISIBLE_DEVICES=None"):
        d.bind(("0",))  # TF sees every GPU: not just Spark's


def test_outside_spark_nothing_is_bound():
    d, _ = _devices(env={devices.VISIBLE: "7"})
    assert d.bind(None) == "7" and d.own is devices._NOT_YET


def test_get_trainer_binds_before_it_builds_or_reuses(monkeypatch):
    from sparkcnn.worker import trainer

    d, _ = _devices(env={}, tf=_Process(started=True, gpus=0))
    d.started_with = "0"  # this worker's TensorFlow runs on GPU 0
    monkeypatch.setattr(devices, "_PROCESS", d)
    spec = TaskSpec(run_id="t", num_blocks=1, test_blocks=0, model_name="fmnist_cnn", input_shape=(28, 28, 1),
                    num_classes=10, seed=0, batch_size=4, momentum=0.9, weight_decay=0.0, layout=())
    built = set(trainer._TRAINERS)
    with pytest.raises(DeviceMismatch, match="^block 3 exchange 5 attempt 1: Spark assigned GPU 1 but"):
        trainer.get_trainer(spec, TaskContextInfo(attempt=1, gpus=("1",)), "block 3 exchange 5 attempt 1")
    assert set(trainer._TRAINERS) == built  # nothing was built on the wrong device


def test_importing_tensorflow_does_not_start_it():
    """What a worker forked from a daemon that imported TensorFlow relies on: it can still bind."""
    code = ("import json, tensorflow as tf, keras; from sparkcnn.worker.devices import tf_started\n"
            "a = tf_started(); tf.constant(1.0); print(json.dumps([a, tf_started()]))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p),
               TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [False, True]
