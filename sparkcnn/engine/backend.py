"""The one narrow seam between training logic and Spark.

``Backend.map_blocks(fn, blocks, description)`` runs ``fn(block, attempt)`` once
per block and returns the results; ``aggregate_blocks`` does the same but
reduces the results with ``seq``/``comb`` (Spark: ``treeAggregate``).
:class:`LocalBackend` runs in this process so algorithm tests need no cluster;
:class:`SparkBackend` runs one Spark job per call, named in the Spark UI.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

log = logging.getLogger(__name__)


class LocalBackend:
    """In-process backend: blocks run one after another in this Python process."""

    parallelism = 1

    def __init__(self, run_id: str = "local"):
        self.run_id = run_id
        # one "executor" with one slot: concurrent jobs (pipelining, async) take turns,
        # as tasks do on a single-core executor; the worker's TF model is not shared
        self._slot = threading.Lock()
        self._jobs = 0  # jobs entered so far (job_mark / wait_job_after)
        self._jobs_cv = threading.Condition()

    max_attempts = 4  # like spark.task.maxFailures: a failed task is retried as attempt + 1

    def _task(self, fn, block):
        for attempt in range(self.max_attempts):
            try:
                with self._slot:
                    return fn(block, attempt)
            except Exception:
                if attempt + 1 == self.max_attempts:
                    raise
                log.warning("block %s attempt %s failed; retrying", block, attempt, exc_info=True)

    def _enter_job(self):
        with self._jobs_cv:
            self._jobs += 1
            self._jobs_cv.notify_all()

    def job_mark(self) -> int:
        return self._jobs

    def wait_job_after(self, mark: int, timeout: float = 30.0) -> bool:
        with self._jobs_cv:
            return self._jobs_cv.wait_for(lambda: self._jobs > mark, timeout)

    def map_blocks(self, fn, blocks, description="", universe=None):
        self._enter_job()
        return [self._task(fn, b) for b in blocks]

    def aggregate_blocks(self, fn, blocks, zero, seq, comb, description="", depth=2, universe=None):
        self._enter_job()
        acc = zero()
        for b in blocks:
            acc = seq(acc, self._task(fn, b))
        return acc

    def broadcast(self, value):
        return _LocalBroadcast(value)

    def unpersist(self, bcast):
        pass

    def stop(self):
        pass

    def close(self):
        pass


class _LocalBroadcast:
    def __init__(self, value):
        self.value = value


LOCAL_DRIVER_JAVA_OPTS = "-XX:TieredStopAtLevel=1"


def get_or_create_spark(master: str = "", app_name: str = "sparkcnn", conf: dict | None = None):
    """The active SparkSession (notebooks, spark-submit) or a new local one.

    In local mode the Python workers must run this interpreter, so
    ``spark.pyspark.python`` is set to ``sys.executable``.
    """
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    master = master or os.environ.get("SPARKCNN_MASTER") or "local[2]"
    builder = SparkSession.builder.appName(app_name).master(master)
    if master.startswith("local") or "127.0.0.1" in master or "localhost" in master:
        # workers on this machine must run this interpreter (same packages as the driver)
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        builder = builder.config("spark.pyspark.python", sys.executable)
    java_opts = os.environ.get("SPARKCNN_DRIVER_JAVA_OPTS", LOCAL_DRIVER_JAVA_OPTS)
    submit_args = os.environ.get("PYSPARK_SUBMIT_ARGS", "")
    if (master.startswith("local") and java_opts and "spark.driver.extraJavaOptions" not in (conf or {})
            and "driver-java-options" not in submit_args and "extraJavaOptions" not in submit_args):
        # The one JVM this process starts: C1-only JIT starts it ~25 % faster (Spark SQL's
        # start-up is mostly class loading). Over 40 pipelined H=10 rounds the JVM used
        # 110 ms of CPU per round against 240 ms with C2 compiling beside the workers; only
        # after ~500 jobs does C2 pull ahead on dense results (~5 % less JVM CPU per job).
        builder = builder.config("spark.driver.extraJavaOptions", java_opts)
    # a console progress bar of our own is printed by the CLI; Spark's would interleave
    builder = builder.config("spark.ui.showConsoleProgress", "false")
    builder = builder.config("spark.python.worker.reuse", "true")
    # async mode submits jobs from several threads; FAIR shares executors between them
    builder = builder.config("spark.scheduler.mode", "FAIR")
    for k, v in (conf or {}).items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


class SparkBackend:
    """One Spark job per call over a tiny RDD of block ids (uncached: ~3x cheaper per job
    than reading a persisted RDD; the blocks themselves stay resident in the workers)."""

    def __init__(self, spark, run_id: str, pool: str | None = None):
        self.spark = spark
        self.sc = spark.sparkContext
        self.run_id = run_id
        self.pool = pool
        self._marker_rdds: dict = {}
        self._job_counter = None  # the DAG scheduler (py4j), False where unreachable

    @property
    def parallelism(self) -> int:
        return self.sc.defaultParallelism

    def _describe(self, description: str) -> None:
        self.sc.setJobGroup(self._group(), description, interruptOnCancel=True)
        if self.pool:
            self.sc.setLocalProperty("spark.scheduler.pool", self.pool)

    def _markers(self, universe: int):
        """A persisted RDD whose partition k holds block id k.

        Its cached partitions give every block a home executor: jobs derived from it
        run block k where its data and state live (PROCESS_LOCAL), instead of
        wherever Spark's shuffled offers put an unplaced task. If that executor is
        lost, Spark recomputes the partition elsewhere and the block moves (its
        state restart is counted by the worker).
        """
        rdd = self._marker_rdds.get(universe)
        if rdd is None:
            from pyspark import StorageLevel

            self._describe(f"sparkcnn {self.run_id} place {universe} blocks")
            rdd = self.sc.parallelize(range(universe), universe).persist(StorageLevel.MEMORY_ONLY)
            rdd.count()
            self._marker_rdds[universe] = rdd
        return rdd

    def marker_rdd_id(self, universe: int) -> int | None:
        """Id of the persisted block-id RDD for ``universe`` blocks (None before its first job);
        the load monitor looks up each block's home executor by it."""
        rdd = self._marker_rdds.get(universe)
        return None if rdd is None else rdd.id()

    @staticmethod
    def _part(fn, wanted):
        def part(it):
            from pyspark import TaskContext

            tc = TaskContext.get()
            attempt = tc.attemptNumber() if tc is not None else 0
            for b in it:
                if wanted is None or b in wanted:
                    yield fn(b, attempt)

        return part

    def _rdd(self, fn, blocks, universe=None):
        if universe is None:
            return self.sc.parallelize(list(blocks), len(blocks)).mapPartitions(self._part(fn, None))
        return self._markers(universe).mapPartitions(self._part(fn, None))

    def _group(self) -> str:
        return f"sparkcnn-{self.run_id}"

    def job_mark(self) -> int:
        """Jobs submitted to this SparkContext so far (the next job's id).

        Read from the DAG scheduler's job counter, which submitJob bumps before
        it queues the job: one cheap call. Spark's status tracker (the public
        route) scans every retained job per call, ~1000 in a long run, and is
        the fallback where the counter cannot be reached.
        """
        if self._job_counter is None:
            try:
                self._job_counter = self.sc._jsc.sc().dagScheduler()
                int(self._job_counter.nextJobId())
            except Exception:  # noqa: BLE001 - py4j raises several types; any means "not here"
                self._job_counter = False
        if self._job_counter:
            return int(self._job_counter.nextJobId()) - 1
        return max(self.sc.statusTracker().getJobIdsForGroup(self._group()), default=-1)

    def wait_job_after(self, mark: int, timeout: float = 30.0) -> bool:
        """Wait until a job newer than ``mark`` is submitted to the scheduler.

        Two rounds in flight are submitted from two threads; the scheduler runs
        the earlier-submitted job's tasks first, so round t+1 is submitted only
        once round t is (else its tasks could run first and wait for block
        states that round t has not produced yet). A job of another thread of
        the application can end the wait early; the round then pays at most
        the state wait, counted in ``stale_states``.
        """
        end = time.monotonic() + timeout
        pause = 0.001
        while time.monotonic() < end:
            if self.job_mark() > mark:
                return True
            time.sleep(pause)
            pause = min(0.005, pause * 1.5)
        return False

    def map_blocks(self, fn, blocks, description="", universe=None):
        blocks = list(blocks)
        if universe is not None and sorted(blocks) != list(range(universe)):
            # a subset (async: one block per job): run only those partitions, still at home
            rdd = self._markers(universe).mapPartitions(self._part(fn, set(blocks)))
            self._describe(description)
            return self.sc.runJob(rdd, lambda it: list(it), partitions=sorted(blocks))
        self._describe(description)
        return self._rdd(fn, blocks, universe).collect()

    def aggregate_blocks(self, fn, blocks, zero, seq, comb, description="", depth=2, universe=None):
        self._describe(description)
        return self._rdd(fn, blocks, universe).treeAggregate(zero(), seq, comb, depth=depth)

    def broadcast(self, value):
        return self.sc.broadcast(value)

    def unpersist(self, bcast):
        bcast.destroy(blocking=False)

    def stop(self):
        self.sc.cancelJobGroup(self._group())

    def close(self):
        for rdd in self._marker_rdds.values():
            rdd.unpersist()
        self._marker_rdds.clear()
