"""The classic session's :class:`~sparkcnn.backends.cluster.ClusterView`: Spark's status store.

:class:`SparkClusterView` reads what the Spark UI shows (the active executors with their cores
and task counts, and which executor caches each partition of a block's marker RDD) and the
DAG scheduler's job counter. It only reads: the marker RDDs it looks up belong to
:class:`~sparkcnn.backends.spark.SparkBackend`, which places the blocks.
"""

from __future__ import annotations

import logging
import re
import time

from sparkcnn.backends.cluster import ClusterView
from sparkcnn.scheduler import ExecutorSample

log = logging.getLogger(__name__)

DRIVER = "driver"  # the status store's id for the driver (local mode: it runs the tasks)
_BLOCK_NAME = re.compile(r"rdd_(\d+)_(\d+)$")


class SparkClusterView(ClusterView):
    """A classic SparkContext's executors, block homes and job counter.

    ``markers``: (split, blocks) -> the persisted marker RDD of a placement, read, never written.
    ``group``: the run's job group, for the job counter's fallback.
    """

    def __init__(self, sc, group: str, markers: dict):
        self.sc = sc
        self.group = group
        self.markers = markers
        self._job_counter = None  # the DAG scheduler (py4j), False where unreachable
        self._fallback_cores: int | None = None  # set once the status store failed

    @property
    def parallelism(self) -> int:
        return self.sc.defaultParallelism

    def session_info(self) -> dict:
        return {"master": self.sc.master, "app_id": self.sc.applicationId}

    def dynamic_allocation(self) -> bool:
        return (self.sc.getConf().get("spark.dynamicAllocation.enabled") or "false").lower() == "true"

    def stage_slots(self) -> int | None:
        cpus = int(self.sc.getConf().get("spark.task.cpus") or 1)
        return sum(e.cores for e in self.executor_samples()) // max(1, cpus)

    # -- the job counter ----------------------------------------------------------------------
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
        return max(self.sc.statusTracker().getJobIdsForGroup(self.group), default=-1)

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

    # -- the status store ---------------------------------------------------------------------
    def executor_samples(self) -> list[ExecutorSample]:
        """Active executors from Spark's status store; after one failure, ``defaultParallelism`` slots."""
        if self._fallback_cores is None:
            try:
                return self._read_status_store()
            except Exception as e:  # noqa: BLE001 - py4j / Spark Connect: any failure means no store
                log.warning("executor load unavailable from Spark's status store (%s); "
                            "assuming spark.default.parallelism task slots from now on", e)
                self._fallback_cores = int(self.sc.defaultParallelism)
        return [ExecutorSample("default", self._fallback_cores, 0, 0)]

    def block_homes(self, universe: int) -> dict[int, str]:
        """Block k -> the executor caching partition k of the marker RDD ({} before it exists)."""
        rdd = self.markers.get(("train", universe))
        if rdd is None or self._fallback_cores is not None:
            return {}
        try:
            return self._read_homes(rdd.id())
        except Exception:  # noqa: BLE001 - homes only steer locality; without one a block is not local
            log.debug("block homes unavailable for RDD %s", rdd.id(), exc_info=True)
            return {}

    def _read_status_store(self) -> list[ExecutorSample]:
        """Active executors from ``AppStatusStore.executorList(activeOnly=True)``.

        The driver has an entry too: with 0 cores on a cluster (skipped); in local
        mode it is the only entry and runs the tasks on its ``local[n]`` cores.
        Lost executors are not active, so their slots drop out of the sum.
        """
        sc = self.sc
        seq = sc._jsc.sc().statusStore().executorList(True)
        rows = []
        for i in range(seq.size()):
            e = seq.apply(i)
            if not e.isActive():
                continue
            rows.append(ExecutorSample(str(e.id()), int(e.totalCores()), int(e.activeTasks()),
                                       int(e.failedTasks()), int(e.completedTasks())))
        workers = [r for r in rows if r.executor_id != DRIVER]
        if workers or not sc.master.startswith("local"):
            return workers  # a cluster with no executor registered yet has no slots
        # local mode: the driver runs the tasks (it reports its local[n] cores; 0 is not expected)
        return [r if r.cores else ExecutorSample(r.executor_id, int(sc.defaultParallelism), r.running_tasks,
                                                 r.failed_tasks, r.completed_tasks) for r in rows]

    def _read_homes(self, rdd_id: int) -> dict[int, str]:
        """Block k -> the executor caching partition k of RDD ``rdd_id`` (status store's storage view)."""
        parts = self.sc._jsc.sc().statusStore().rdd(rdd_id).partitions()
        if not parts.isDefined():
            return {}
        parts = parts.get()
        homes = {}
        for i in range(parts.size()):
            p = parts.apply(i)
            m = _BLOCK_NAME.match(str(p.blockName()))
            where = p.executors()
            if m and int(m.group(1)) == rdd_id and where.size() > 0:
                homes[int(m.group(2))] = str(where.apply(0))
        return homes
