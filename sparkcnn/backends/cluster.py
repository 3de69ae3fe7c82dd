"""The read-only view of the cluster a run's backend runs on.

:class:`ClusterView` is what the load monitor and the engines' planning read, never what
runs anything: the task slots, the active executors and where each block lives, the
session, whether barrier stages fit, and the job counter that orders two rounds in flight.
Every :class:`~sparkcnn.backends.backend.Backend` exposes one as ``backend.cluster``;
:class:`~sparkcnn.backends.monitor.LoadMonitor` takes only the view. The classic
session's reads Spark's status store (:mod:`sparkcnn.backends.status`); the in-process
and Connect ones answer from what they know.
"""

from __future__ import annotations

import abc

from sparkcnn.scheduler import ExecutorSample


class ClusterView(abc.ABC):
    """What a run may read about its cluster; nothing here submits work."""

    @property
    @abc.abstractmethod
    def parallelism(self) -> int:
        """Task slots the engines plan for (Spark: ``defaultParallelism``)."""

    @abc.abstractmethod
    def executor_samples(self) -> list[ExecutorSample]:
        """Active executors now: task slots, running, failed and completed tasks."""

    @abc.abstractmethod
    def block_homes(self, universe: int) -> dict[int, str]:
        """Block -> executor where its next job runs ({} where unknown)."""

    @abc.abstractmethod
    def session_info(self) -> dict:
        """``{"master": ..., "app_id": ...}`` of the session the run uses."""

    def dynamic_allocation(self) -> bool:
        """Whether executors come and go (barrier stages refuse it)."""
        return False

    def stage_slots(self) -> int | None:
        """Tasks a barrier stage can run at once (None: no limit, tasks run in turn)."""
        return None

    @abc.abstractmethod
    def job_mark(self) -> int:
        """Jobs entered so far: pass to :meth:`wait_job_after`."""

    @abc.abstractmethod
    def wait_job_after(self, mark: int, timeout: float = 30.0) -> bool:
        """Wait until a job newer than ``mark`` is submitted; False on timeout (s)."""
