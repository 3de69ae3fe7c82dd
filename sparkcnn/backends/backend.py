"""The one narrow seam between training logic and Spark.

:class:`Backend` runs things, in the spirit of Horovod's ``run(fn) -> list``: ``place`` puts
each block on an executor, ``map_blocks(fn, blocks)`` runs ``fn(block, ctx)`` once per
block as one job and returns the results (``ctx``: the task's
:class:`~sparkcnn.protocol.TaskContextInfo`, which :func:`spark_task_context` reads inside a
Spark task; ``tree_depth``: gathered through ``treeAggregate``), ``run_stage`` runs every
block's task at once as a barrier stage, ``broadcast`` ships a value to every task. What a
run only reads about its cluster (slots, executors, block homes, the session, the job
counter) is the separate :class:`~sparkcnn.backends.cluster.ClusterView` at
``backend.cluster``. :class:`~sparkcnn.backends.inprocess.LocalBackend` runs in this
process so algorithm tests need no cluster; :class:`~sparkcnn.backends.spark.SparkBackend`
runs one Spark job per call, named in the Spark UI, over blocks placed by
:mod:`sparkcnn.backends.placement`; :class:`~sparkcnn.backends.connect.ConnectBackend`
runs the stream's stages over Spark Connect. Sessions are opened by
:mod:`sparkcnn.backends.session`.
"""

from __future__ import annotations

import abc

from sparkcnn.backends.cluster import ClusterView
from sparkcnn.protocol import TaskContextInfo


class Backend(abc.ABC):
    """Runs task functions over blocks: everything the engines ask Spark to do."""

    spark = None  # the SparkSession the run uses (None: no Spark)
    resident = True  # block data and state stay on the executor between jobs (Spark Connect: no)
    places_paths = False  # place() takes a prepared split whose ``df`` is still its directory

    @property
    @abc.abstractmethod
    def cluster(self) -> ClusterView:
        """The read-only view of the cluster this backend runs on (the load monitor reads it)."""

    @abc.abstractmethod
    def place(self, split: str, frame, num_blocks: int, spec, spread: bool = False) -> dict[int, int]:
        """Cut ``frame`` (:class:`~sparkcnn.data.source.Frame`) into ``num_blocks`` blocks of
        ``split`` and keep each resident where its tasks will run; returns block -> rows.
        ``spread``: every block on a task slot of its own (the stream's barrier stages need it)."""

    def place_later(self, split: str, frame, num_blocks: int, spec, after=None) -> None:
        """:meth:`place` ``split``'s blocks by the first job over them, then call ``after()``
        (release what the frame holds). Here: at once; a backend whose placement is a Spark job
        may wait, so that the training's first step need not wait for the test blocks."""
        self.place(split, frame, num_blocks, spec)
        if after is not None:
            after()

    @abc.abstractmethod
    def map_blocks(self, fn, blocks, description: str = "", universe: int | None = None,
                   split: str = "train", tree_depth: int | None = None) -> list:
        """``[fn(block, ctx) for block in blocks]``, one task per block, as one job.

        ``universe``: the block count of ``split``; blocks then run where :meth:`place` put them.
        ``tree_depth``: the results come back through a tree of that depth (``treeAggregate``)
        rather than each straight to the driver; still one result per block, none reduced.
        """

    @abc.abstractmethod
    def run_stage(self, fn, universe: int, description: str = "") -> list:
        """``fn(block, ctx)`` for every placed block, all at once (a barrier stage), as one job."""

    @abc.abstractmethod
    def driver_host(self) -> str:
        """The one address of the driver that executors reach (the stream's server binds it)."""

    @abc.abstractmethod
    def broadcast(self, value):
        """A handle whose ``.value`` is ``value`` in every task."""

    @abc.abstractmethod
    def unpersist(self, bcast) -> None:
        """Release a handle from :meth:`broadcast`."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Cancel the run's jobs."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release what the run holds (the session stays open)."""


def spark_task_context() -> TaskContextInfo:
    """What Spark tells the running task about itself (called inside the task); outside a
    task, ``gpus=None``: nothing was assigned."""
    from pyspark import SparkFiles, TaskContext

    tc = TaskContext.get()
    if tc is None:
        return TaskContextInfo(local_dir=SparkFiles.getRootDirectory())
    gpu = tc.resources().get("gpu")
    return TaskContextInfo(attempt=tc.attemptNumber(), cores=tc.cpus(),
                           gpus=tuple(gpu.addresses) if gpu is not None else (),
                           local_dir=SparkFiles.getRootDirectory())
