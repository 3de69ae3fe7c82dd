"""The in-process backend: blocks run one after another in this Python process.

Algorithm tests, ``engine.master=inprocess`` and benchmarks use it to run the
engines without a cluster. It runs the executors' code (block placement, the
task functions) in the driver's own process by design, which is why it lives
apart from the Spark backends (:mod:`sparkcnn.backends.spark`,
:mod:`sparkcnn.backends.placement`), whose driver side imports no worker module.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading

from sparkcnn.backends.backend import Backend
from sparkcnn.backends.cluster import ClusterView
from sparkcnn.protocol import TaskContextInfo
from sparkcnn.scheduler import ExecutorSample

log = logging.getLogger(__name__)


class _Jobs:
    """Jobs entered so far, counted by :class:`LocalBackend` and read by its view."""

    def __init__(self):
        self.count = 0
        self.changed = threading.Condition()

    def enter(self) -> None:
        with self.changed:
            self.count += 1
            self.changed.notify_all()

    def wait_after(self, mark: int, timeout: float) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: self.count > mark, timeout)


class LocalClusterView(ClusterView):
    """This process as the cluster: one executor ``local`` with one slot, every block at home."""

    def __init__(self, jobs: _Jobs):
        self.jobs = jobs

    @property
    def parallelism(self) -> int:
        return 1

    def executor_samples(self) -> list[ExecutorSample]:
        return [ExecutorSample("local", 1, 0, 0)]  # one task at a time in this process

    def block_homes(self, universe: int) -> dict[int, str]:
        return {k: "local" for k in range(universe)}

    def session_info(self) -> dict:
        return {"master": "inprocess", "app_id": None}

    def job_mark(self) -> int:
        return self.jobs.count

    def wait_job_after(self, mark: int, timeout: float = 30.0) -> bool:
        return self.jobs.wait_after(mark, timeout)


class LocalBackend(Backend):
    """In-process backend: blocks run one after another in this Python process."""

    places_paths = True  # it reads the split's files itself

    max_attempts = 4  # like spark.task.maxFailures: a failed task is retried as attempt + 1

    def __init__(self, run_id: str = "local"):
        self.run_id = run_id
        # one "executor" with one slot: concurrent jobs (pipelining, async) take turns,
        # as tasks do on a single-core executor; the worker's TF model is not shared
        self._slot = threading.Lock()
        self._jobs = _Jobs()  # jobs entered so far (the view's job_mark / wait_job_after)
        self._cluster = LocalClusterView(self._jobs)
        self._local_dir = os.path.join(tempfile.gettempdir(), f"sparkcnn-{os.getuid()}")

    @property
    def cluster(self) -> LocalClusterView:
        return self._cluster

    def _task(self, fn, block):
        for attempt in range(self.max_attempts):
            try:
                with self._slot:
                    return fn(block, TaskContextInfo(attempt=attempt, cores=1, local_dir=self._local_dir))
            except Exception:
                if attempt + 1 == self.max_attempts:
                    raise
                log.warning("block %s attempt %s failed; retrying", block, attempt, exc_info=True)

    def place(self, split, frame, num_blocks, spec, spread=False):
        """Read a prepared split (``frame.df`` is its directory) into this process's block store."""
        from sparkcnn.worker import blockstore
        from sparkcnn.data.parquet_io import read_split_numpy
        from sparkcnn.worker.blocks import split_arrays
        from sparkcnn.worker.task import local_root

        if not isinstance(frame.df, str):
            raise TypeError("the in-process backend places prepared splits only")
        root = local_root(spec, TaskContextInfo(local_dir=self._local_dir))
        images, labels = read_split_numpy(frame.df)
        sizes = {}
        for k, (x, y) in enumerate(split_arrays(images, labels, num_blocks)):
            blockstore.put_block(root, spec.run_id, split, num_blocks, k, x, y)
            sizes[k] = len(y)
        return sizes

    def map_blocks(self, fn, blocks, description="", universe=None, split="train", tree_depth=None):
        self._jobs.enter()
        return [self._task(fn, b) for b in blocks]

    def run_stage(self, fn, universe, description=""):
        return self.map_blocks(fn, list(range(universe)), description, universe)  # one slot: in turn

    def driver_host(self) -> str:
        return "127.0.0.1"

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
