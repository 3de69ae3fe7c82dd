"""Load monitor: executor load from Spark's status store, block speed from each block's last task.

Feeds the async scheduler (:class:`~sparkcnn.scheduler.AsyncPolicy`) with

- executors: one :class:`~sparkcnn.scheduler.ExecutorSample` per active executor
  (task slots, running, failed and completed tasks), read from Spark's own status
  store (``AppStatusStore.executorList``, what the Spark UI shows) through py4j;
- block speeds: images / compute seconds of each block's last task, with the
  executor holding the block's cached marker partition (where its next job runs).

Live task slots are ``sum(cores)`` over active executors
(:func:`~sparkcnn.scheduler.task_slots`): they shrink when an executor is lost
and grow when one joins. A sample costs ~7 py4j calls per executor (a few ms
in all), so it is cached for ``min_interval_s``.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass

from sparkcnn.scheduler import BlockSpeed, ExecutorSample

log = logging.getLogger(__name__)

DRIVER = "driver"  # the status store's id for the driver (local mode: it runs the tasks)
_BLOCK_NAME = re.compile(r"rdd_(\d+)_(\d+)$")


@dataclass(frozen=True)
class LoadSample:
    executors: tuple[ExecutorSample, ...]  # active executors (a cluster's driver left out)
    at: float  # time.monotonic() of the sample, s


class LoadMonitor:
    """Samples executors and keeps each block's measured speed and home executor.

    Backends with a SparkContext (``backend.sc``) are read from its status store;
    anything else (:class:`~sparkcnn.engine.backend.LocalBackend`) is one executor
    with one slot. Subclasses may override :meth:`_read` (tests).
    """

    def __init__(self, backend, min_interval_s: float = 0.5, clock=time.monotonic):
        self.backend = backend
        self.min_interval_s = min_interval_s  # s between status-store reads; callers in between get the cache
        self.clock = clock
        self._last: LoadSample | None = None
        self._speed: dict[int, float] = {}   # block -> images/s of its last task
        self._home: dict[int, str] = {}      # block -> executor id holding its marker partition
        self._homes_at: float | None = None  # sample time of the last home look-up
        self._fallback_cores: int | None = None  # set once the status store failed

    # -- executors ----------------------------------------------------------------------
    def sample(self) -> LoadSample:
        """The latest sample, read anew at most every ``min_interval_s``."""
        now = self.clock()
        if self._last is None or now - self._last.at >= self.min_interval_s:
            self._last = LoadSample(tuple(self._read()), now)
            alive = {e.executor_id for e in self._last.executors}
            # a block whose executor is gone moves on its next job: look up its home again
            self._home = {k: e for k, e in self._home.items() if e in alive}
        return self._last

    def _read(self) -> list[ExecutorSample]:
        sc = getattr(self.backend, "sc", None)
        if sc is None:
            # LocalBackend runs one task at a time in this process
            return [ExecutorSample("local", 1, 0, 0)]
        if self._fallback_cores is None:
            try:
                return _read_status_store(sc)
            except Exception as e:  # noqa: BLE001 - py4j / Spark Connect: any failure means no store
                log.warning("executor load unavailable from Spark's status store (%s); "
                            "assuming spark.default.parallelism task slots from now on", e)
                self._fallback_cores = int(sc.defaultParallelism)
        return [ExecutorSample("default", self._fallback_cores, 0, 0)]

    # -- blocks -------------------------------------------------------------------------
    def record(self, result: dict) -> None:
        """Remember the speed of a finished task (a worker result dict)."""
        if result.get("compute_s", 0) > 0 and result.get("samples", 0) > 0:
            self._speed[result["block"]] = result["samples"] / result["compute_s"]

    def speeds(self, blocks) -> dict[int, BlockSpeed]:
        """Each block's last measured speed (None before its first task) and home executor."""
        blocks = list(blocks)
        at = self.sample().at
        if at != self._homes_at and any(k not in self._home for k in blocks):
            self._homes_at = at  # one look-up per sample at most
            self._home.update(self._homes(blocks))
        return {k: BlockSpeed(k, self._speed.get(k), self._home.get(k)) for k in blocks}

    def _homes(self, blocks: list[int]) -> dict[int, str]:
        sc = getattr(self.backend, "sc", None)
        if sc is None:
            return {k: "local" for k in blocks}
        rdd_id = self.backend.marker_rdd_id(len(blocks)) if hasattr(self.backend, "marker_rdd_id") else None
        if rdd_id is None or self._fallback_cores is not None:
            return {}
        try:
            return _read_homes(sc, rdd_id)
        except Exception:  # noqa: BLE001 - homes only steer locality; without one a block is not local
            log.debug("block homes unavailable for RDD %s", rdd_id, exc_info=True)
            return {}


def _read_status_store(sc) -> list[ExecutorSample]:
    """Active executors from ``AppStatusStore.executorList(activeOnly=True)``.

    The driver has an entry too: with 0 cores on a cluster (skipped); in local
    mode it is the only entry and runs the tasks on its ``local[n]`` cores.
    Lost executors are not active, so their slots drop out of the sum.
    """
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


def _read_homes(sc, rdd_id: int) -> dict[int, str]:
    """Block k -> the executor caching partition k of RDD ``rdd_id`` (status store's storage view)."""
    parts = sc._jsc.sc().statusStore().rdd(rdd_id).partitions()
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
