"""Load monitor: executor load and block homes from the cluster view, block speed from each block's last task.

Feeds the async scheduler (:class:`~sparkcnn.scheduler.AsyncPolicy`) with

- executors: one :class:`~sparkcnn.scheduler.ExecutorSample` per active executor
  (task slots, running, failed and completed tasks), from
  :meth:`~sparkcnn.backends.cluster.ClusterView.executor_samples` (on Spark: its own
  status store, what the Spark UI shows);
- block speeds: images / compute seconds of each block's last task, with the
  executor holding the block's cached marker partition (where its next job runs),
  from :meth:`~sparkcnn.backends.cluster.ClusterView.block_homes`.

It reads a :class:`~sparkcnn.backends.cluster.ClusterView` (``backend.cluster``) and nothing
else: it cannot run a job.

Live task slots are ``sum(cores)`` over active executors
(:func:`~sparkcnn.scheduler.task_slots`): they shrink when an executor is lost
and grow when one joins. A sample costs ~7 py4j calls per executor (a few ms
in all), so it is cached for ``min_interval_s``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sparkcnn.backends.cluster import ClusterView
from sparkcnn.protocol import ExchangeResult
from sparkcnn.scheduler import BlockSpeed, ExecutorSample


@dataclass(frozen=True)
class LoadSample:
    executors: tuple[ExecutorSample, ...]  # active executors (a cluster's driver left out)
    at: float  # time.monotonic() of the sample, s


class LoadMonitor:
    """Samples the executors of a :class:`~sparkcnn.backends.cluster.ClusterView` and keeps each
    block's measured speed and home executor. Subclasses may override :meth:`_read` (tests)."""

    def __init__(self, cluster: ClusterView, min_interval_s: float = 0.5, clock=time.monotonic):
        self.cluster = cluster
        self.min_interval_s = min_interval_s  # s between executor reads; callers in between get the cache
        self.clock = clock
        self._last: LoadSample | None = None
        self._speed: dict[int, float] = {}   # block -> images/s of its last task
        self._home: dict[int, str] = {}      # block -> executor id holding its marker partition
        self._homes_at: float | None = None  # sample time of the last home look-up

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
        return self.cluster.executor_samples()

    # -- blocks -------------------------------------------------------------------------
    def record(self, result: ExchangeResult) -> None:
        """Remember the speed of a finished task: ``samples / compute_s`` of its block."""
        if result.compute_s > 0 and result.samples > 0:
            self._speed[result.block] = result.samples / result.compute_s

    def speeds(self, blocks) -> dict[int, BlockSpeed]:
        """Each block's last measured speed (None before its first task) and home executor."""
        blocks = list(blocks)
        at = self.sample().at
        if at != self._homes_at and any(k not in self._home for k in blocks):
            self._homes_at = at  # one look-up per sample at most
            self._home.update(self.cluster.block_homes(len(blocks)))
        return {k: BlockSpeed(k, self._speed.get(k), self._home.get(k)) for k in blocks}
