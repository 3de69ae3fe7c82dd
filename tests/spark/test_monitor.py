"""Load monitor: executors from Spark's status store, block speeds and homes, throttling, fallback."""

import logging

import pytest

from sparkcnn.backends.inprocess import LocalBackend
from sparkcnn.backends.monitor import LoadMonitor
from sparkcnn.backends.spark import SparkBackend
from sparkcnn.protocol import ExchangeResult
from sparkcnn.scheduler import ExecutorSample, task_slots


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def result(block: int, samples: int, compute_s: float) -> ExchangeResult:
    """A block's answer with the fields the monitor reads; the rest zero."""
    return ExchangeResult(block=block, seq=0, attempt=0, base_version=0, payload=b"", samples=samples,
                       steps=0, loss_sum=0.0, correct=0, nnz=0, prep_s=0.0, compute_s=compute_s, encode_s=0.0,
                       task_s=0.0, state_reset=False, state_stale=False, replica_resync=False, view_bytes=0,
                       pid=0, executor="local", lr=0.1, density=1.0, first_step=0)


def test_local_backend_is_one_slot_and_results_give_speeds():
    monitor = LoadMonitor(LocalBackend("t-mon").cluster)
    assert monitor.sample().executors == (ExecutorSample("local", 1, 0, 0),)
    monitor.record(result(1, 640, 2.0))
    monitor.record(result(0, 0, 0.0))  # an empty task measures nothing
    speeds = monitor.speeds([0, 1])
    assert (speeds[0].images_per_s, speeds[1].images_per_s) == (None, 320.0)
    assert speeds[1].executor_id == "local"


def test_samples_are_cached_for_min_interval():
    class Counting(LoadMonitor):
        reads = 0

        def _read(self):
            self.reads += 1
            return [ExecutorSample("e1", self.reads, 0, 0)]

    clock = Clock()
    monitor = Counting(LocalBackend("t-mon").cluster, min_interval_s=0.5, clock=clock)
    first = monitor.sample()
    clock.t += 0.4
    assert monitor.sample() is first and monitor.reads == 1
    clock.t += 0.1
    assert monitor.sample().executors[0].cores == 2 and monitor.reads == 2


def test_no_status_store_warns_once_and_uses_default_parallelism(caplog):
    class NoStore:
        defaultParallelism = 6
        master = "spark://nowhere:7077"

        @property
        def _jsc(self):
            raise AttributeError("no JVM (Spark Connect)")

    class Session:
        sparkContext = NoStore()

    monitor = LoadMonitor(SparkBackend(Session(), "t-mon").cluster, min_interval_s=0)
    with caplog.at_level(logging.WARNING, logger="sparkcnn.backends.status"):
        samples = [monitor.sample() for _ in range(3)]
    assert all(s.executors == (ExecutorSample("default", 6, 0, 0),) for s in samples)
    assert len([r for r in caplog.records if "status store" in r.getMessage()]) == 1
    assert monitor.speeds([0, 1])[0].executor_id is None


@pytest.mark.spark
def test_status_store_on_local_spark(spark):
    """local[2]: the driver is the one executor, with 2 slots; its task counts grow with a job."""
    backend = SparkBackend(spark, "t-monitor")
    monitor = LoadMonitor(backend.cluster, min_interval_s=0)
    [before] = monitor.sample().executors
    assert (before.executor_id, before.cores, before.running_tasks) == ("driver", 2, 0)
    assert task_slots(monitor.sample().executors, blocks=4) == 2
    assert monitor.speeds(range(3))[0].executor_id is None  # no block placed yet

    [(block, attempt)] = backend.map_blocks(lambda b, ctx: (b, ctx.attempt), [1], "t", universe=3)
    monitor.record(result(block, 50, 0.25))
    [after] = monitor.sample().executors
    # the job placed 3 blocks (3 tasks), then ran block 1 (1 task)
    assert after.completed_tasks >= before.completed_tasks + 4
    assert after.failed_tasks == before.failed_tasks
    speeds = monitor.speeds(range(3))
    assert {k: s.executor_id for k, s in speeds.items()} == {0: "driver", 1: "driver", 2: "driver"}
    assert (speeds[0].images_per_s, speeds[1].images_per_s) == (None, 200.0)
    assert attempt == 0
    backend.close()
