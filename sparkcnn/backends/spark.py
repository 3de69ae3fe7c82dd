"""The Spark implementation of the :class:`~sparkcnn.backends.backend.Backend` seam: one job per call.

:class:`SparkBackend` runs each call as one Spark job over a small RDD of block
ids, named in the Spark UI under the run's job group; once blocks are placed
(:mod:`sparkcnn.backends.placement`), the jobs derive from the persisted marker
RDD, so every block runs where its data and state live. The load monitor's
reads (active executors, block homes) come from Spark's status store.
"""

from __future__ import annotations

import logging
import re
import time

from sparkcnn.backends.backend import Backend, spark_task_context
from sparkcnn.backends.placement import barrier_results, place_blocks
from sparkcnn.scheduler import ExecutorSample

log = logging.getLogger(__name__)

DRIVER = "driver"  # the status store's id for the driver (local mode: it runs the tasks)
_BLOCK_NAME = re.compile(r"rdd_(\d+)_(\d+)$")


# map_blocks with tree_depth: one Spark job over the blocks through treeAggregate whose combine
# step only concatenates the per-block results into a list: nothing is reduced on the executors,
# because the driver deduplicates and guards each block's delta alone (one bad block must not
# take others with it).
def _gather_one(acc: list, result) -> list:
    acc.append(result)
    return acc


def _gather_both(a: list, b: list) -> list:
    a.extend(b)
    return a


class SparkBackend(Backend):
    """One Spark job per call over a small RDD of block ids.

    With ``universe`` the jobs derive from the persisted marker RDD of :meth:`place`,
    so each block has a home executor; the blocks' data and state stay resident in
    the Python workers, not in Spark's block manager.
    """

    def __init__(self, spark, run_id: str, pool: str | None = None):
        self.spark = spark
        self.sc = spark.sparkContext
        self.run_id = run_id
        self.pool = pool
        self._marker_rdds: dict = {}
        self._job_counter = None  # the DAG scheduler (py4j), False where unreachable
        self._fallback_cores: int | None = None  # set once the status store failed

    @property
    def parallelism(self) -> int:
        return self.sc.defaultParallelism

    def _describe(self, description: str) -> None:
        self.sc.setJobGroup(self._group(), description, interruptOnCancel=True)
        if self.pool:
            self.sc.setLocalProperty("spark.scheduler.pool", self.pool)

    def place(self, split, frame, num_blocks, spec, spread=False):
        """Blocks through Spark itself, no shared path, each at home on an executor
        (:mod:`sparkcnn.backends.placement`); the marker RDD is kept for the jobs over them."""
        self._describe(f"sparkcnn {self.run_id} place {split} blocks")
        rdd, sizes = place_blocks(frame, split, num_blocks, spec, spread,
                                  name=f"sparkcnn {self.run_id} {split} blocks")
        old = self._marker_rdds.pop((split, num_blocks), None)
        if old is not None:
            old.unpersist()
        self._marker_rdds[(split, num_blocks)] = rdd
        return sizes

    def _markers(self, universe: int, split: str = "train"):
        """The persisted marker RDD of ``split`` (see :meth:`place`); where nothing was placed,
        one whose partition k holds block id k, which still gives each block a home."""
        rdd = self._marker_rdds.get((split, universe))
        if rdd is None:
            from pyspark import StorageLevel

            self._describe(f"sparkcnn {self.run_id} place {universe} blocks")
            rdd = self.sc.parallelize(range(universe), universe).persist(StorageLevel.MEMORY_ONLY)
            rdd.count()
            self._marker_rdds[(split, universe)] = rdd
        return rdd

    @staticmethod
    def _part(fn, wanted):
        def part(it):
            ctx = spark_task_context()
            for item in it:
                b = item[0] if isinstance(item, tuple) else item  # (block, rows) from place()
                if wanted is None or b in wanted:
                    yield fn(b, ctx)

        return part

    def _rdd(self, fn, blocks, universe=None, split="train"):
        if universe is None:
            return self.sc.parallelize(blocks, len(blocks)).mapPartitions(self._part(fn, None))
        wanted = None if sorted(blocks) == list(range(universe)) else set(blocks)
        return self._markers(universe, split).mapPartitions(self._part(fn, wanted))

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

    def map_blocks(self, fn, blocks, description="", universe=None, split="train", tree_depth=None):
        blocks = list(blocks)
        if tree_depth is not None:
            rdd = self._rdd(fn, blocks, universe, split)
            self._describe(description)
            return rdd.treeAggregate([], _gather_one, _gather_both, depth=tree_depth)
        if universe is not None and sorted(blocks) != list(range(universe)):
            # a subset (async: one block per job): run only those partitions, still at home
            rdd = self._markers(universe, split).mapPartitions(self._part(fn, set(blocks)))
            self._describe(description)
            return self.sc.runJob(rdd, lambda it: list(it), partitions=sorted(blocks))
        rdd = self._rdd(fn, blocks, universe, split)  # may run the placement job, under its own name
        self._describe(description)
        return rdd.collect()

    def run_stage(self, fn, universe, description=""):
        """One barrier stage over the placed blocks: every task starts together, where its block
        lives; Spark retries the stage as a whole. Its UI name is ``description``."""
        from pyspark.traceback_utils import SCCallSiteSync

        # the tasks' small results through a one-partition shuffle, so that Spark can rerun the stage
        rdd = barrier_results(self._markers(universe).barrier().mapPartitions(self._part(fn, None)))
        self._describe(description)
        # the stage's UI name is the job's call site, which PySpark sets from the Python stack
        # at the outermost action; set it ourselves and keep collect() from replacing it
        self.sc._jsc.setCallSite(description)
        SCCallSiteSync._spark_stack_depth += 1
        try:
            return rdd.collect()
        finally:
            SCCallSiteSync._spark_stack_depth -= 1
            self.sc._jsc.setCallSite(None)

    def driver_host(self) -> str:
        return self.sc.getConf().get("spark.driver.host") or "127.0.0.1"

    def dynamic_allocation(self) -> bool:
        return (self.sc.getConf().get("spark.dynamicAllocation.enabled") or "false").lower() == "true"

    def stage_slots(self) -> int | None:
        cpus = int(self.sc.getConf().get("spark.task.cpus") or 1)
        return sum(e.cores for e in self.executor_samples()) // max(1, cpus)

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

    def session_info(self) -> dict:
        return {"master": self.sc.master, "app_id": self.sc.applicationId}

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
        rdd = self._marker_rdds.get(("train", universe))
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
