"""The Spark implementation of the :class:`~sparkcnn.backends.backend.Backend` seam: one job per call.

:class:`SparkBackend` runs each call as one Spark job over a small RDD of block
ids, named in the Spark UI under the run's job group; once blocks are placed
(:mod:`sparkcnn.backends.placement`), the jobs derive from the persisted marker
RDD, so every block runs where its data and state live. Its cluster view (active
executors, block homes, the job counter) reads Spark's status store
(:mod:`sparkcnn.backends.status`).
"""

from __future__ import annotations

from sparkcnn.backends.backend import Backend, spark_task_context
from sparkcnn.backends.placement import barrier_results, place_blocks
from sparkcnn.backends.status import SparkClusterView


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

    # a prepared split's directory is placed from its files on a local master, else read then:
    # a run on one never reads it as a DataFrame (the schema's jobs, ~1.5 s of its start)
    places_paths = True

    def __init__(self, spark, run_id: str, pool: str | None = None):
        self.spark = spark
        self.sc = spark.sparkContext
        self.run_id = run_id
        self.pool = pool
        self._marker_rdds: dict = {}
        self._later: dict = {}  # (split, blocks) -> (frame, spec, after): placed by the first job over them
        self._cluster = SparkClusterView(self.sc, self._group(), self._marker_rdds)

    @property
    def cluster(self) -> SparkClusterView:
        return self._cluster

    def _describe(self, description: str) -> None:
        self.sc.setJobGroup(self._group(), description, interruptOnCancel=True)
        if self.pool:
            self.sc.setLocalProperty("spark.scheduler.pool", self.pool)

    def place(self, split, frame, num_blocks, spec, spread=False):
        """Blocks through Spark itself, no shared path, each at home on an executor
        (:mod:`sparkcnn.backends.placement`); the marker RDD is kept for the jobs over them."""
        self._describe(f"sparkcnn {self.run_id} place {split} blocks")
        rdd, sizes = place_blocks(self.spark, frame, split, num_blocks, spec, spread,
                                  name=f"sparkcnn {self.run_id} {split} blocks")
        old = self._marker_rdds.pop((split, num_blocks), None)
        if old is not None:
            old.unpersist()
        self._marker_rdds[(split, num_blocks)] = rdd
        return sizes

    def place_later(self, split, frame, num_blocks, spec, after=None):
        """Placed by the first job over ``split``'s blocks (:meth:`_markers`): the test blocks,
        first read at the end of epoch 1, no longer delay the first training step (their
        placement took 1.2 s of a CIFAR-10 run's start on 2 idle cores)."""
        self._later[(split, num_blocks)] = (frame, spec, after)

    def _markers(self, universe: int, split: str = "train"):
        """The persisted marker RDD of ``split`` (see :meth:`place`, :meth:`place_later`); where
        nothing was placed, one whose partition k holds block id k, which still gives each block
        a home."""
        later = self._later.pop((split, universe), None)
        if later is not None:
            frame, spec, after = later
            self.place(split, frame, universe, spec)
            if after is not None:
                after()
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
        lives; Spark retries the stage as a whole. Its UI name is ``description``.

        An RDD barrier stage, not Connect's ``mapInArrow(..., barrier=True)``: on a classic
        session that runs in Spark SQL's own Python workers, away from the ones placement warmed
        (TensorFlow imported, model built), and measured slower and larger (docs/architecture.md,
        "Two barrier paths, measured")."""
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
        for _, _, after in self._later.values():  # never needed: what their frames hold goes too
            if after is not None:
                after()
        self._later.clear()
