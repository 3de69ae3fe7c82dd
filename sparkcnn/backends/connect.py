"""Training over Spark Connect: the stream transport's stages as barrier ``mapInArrow`` queries.

A Connect client has no SparkContext, RDDs, broadcasts or status store; it sends DataFrame
plans. :class:`ConnectBackend` is the :class:`~sparkcnn.backends.backend.Backend` built from
DataFrame operations alone:

    place(split, n)   packed chunks (worker.blocks.pack, as on a classic session), each tagged
                      with a key whose Spark hash lands in partition k for block k, then
                      repartition(n, key) and persist: partition k holds exactly block k
                      (one small query counts the rows and checks it)
    run_stage(fn)     placed.mapInArrow(task, barrier=True).repartition(1).collect(): every
                      block's task starts together, stores its block from its own input
                      (Connect gives no executor locality, so the data arrives with the stage)
                      and runs fn(block, ctx); the one-partition shuffle behind it makes the
                      barrier stage a shuffle map stage, which Spark retries as a whole
    map_blocks(fn)    the same without the barrier (evaluation over the test blocks)
    cluster           ConnectClusterView: what the session's configuration tells (slots of
                      a local master or spark.default.parallelism); no status store

Results come back as wire messages (:mod:`sparkcnn.streamwire`), not pickles. A block's state
between stages cannot stay in an executor that the next stage may not run on, so it
travels through the driver: each block's last push of a stage carries it (the epoch-end
cut) and the next stage starts from it (:attr:`resident` is False).

Only the stream transport runs here: the jobs transport is one RDD job per exchange over
blocks kept resident by executor locality, which Connect has neither of. The parameter-server
service runs in this client process, so this process must be on the Spark driver's host,
where the tasks reach it as on a classic session.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import uuid

from sparkcnn.backends.backend import Backend
from sparkcnn.backends.cluster import ClusterView
from sparkcnn.errors import BadInput
from sparkcnn.protocol import EvalResult, StreamTotals
from sparkcnn.scheduler import ExecutorSample

log = logging.getLogger(__name__)

RESULT_SCHEMA = "block int, result binary"
RESULT_TYPES = (StreamTotals, EvalResult)  # what the tasks of the stream and its evaluation return
_LOCAL_MASTER = re.compile(r"local(?:-cluster)?\[(\*|\d+)")


def _task_context():
    from sparkcnn.backends.backend import spark_task_context

    return spark_task_context()


def _block_task(fn, spec, split: str, num_blocks: int, shape: tuple, wanted):
    """The function ``mapInArrow`` runs over one placed partition: store the block it holds
    from the input rows, then ``fn(block, ctx)``, answered as one wire message."""

    def task(batches):
        import pyarrow as pa

        from sparkcnn.streamwire import encode
        from sparkcnn.worker.blocks import store

        chunks, blocks = [], set()
        for b in batches:
            cols = b.to_pydict()
            blocks.update(cols["block"])
            chunks += zip(cols["part"], cols["seq"], cols["images"], cols["labels"])
        if not blocks:
            return
        if len(blocks) != 1:
            raise RuntimeError(f"a placed partition holds blocks {sorted(blocks)}, not one")
        (block,) = blocks
        if wanted is not None and block not in wanted:
            return
        ctx = _task_context()
        store(spec, split, num_blocks, block, chunks, ctx, shape)
        out = fn(block, ctx)
        yield pa.RecordBatch.from_pydict({"block": [block], "result": [encode(out)]},
                                         schema=pa.schema([("block", pa.int32()), ("result", pa.binary())]))

    return task


def _count_task(batches):
    """(block, rows, blocks seen) of one placed partition: checks the placement."""
    import numpy as np
    import pyarrow as pa

    blocks, rows = set(), 0
    for b in batches:
        blocks.update(b.column("block").to_pylist())
        rows += sum(len(x) for x in b.column("labels").to_pylist()) // np.dtype(np.int32).itemsize
    if blocks:
        yield pa.RecordBatch.from_pydict({"block": [min(blocks)], "rows": [rows], "blocks": [len(blocks)]},
                                         schema=pa.schema([("block", pa.int32()), ("rows", pa.int64()),
                                                           ("blocks", pa.int32())]))


def _conf(spark, key: str, default: str | None = None) -> str | None:
    """A setting of the session; a key the server does not expose reads as unset."""
    try:
        return spark.conf.get(key, default)
    except Exception:  # noqa: BLE001 - a key the server does not expose reads as unset
        return default


class ConnectClusterView(ClusterView):
    """A Spark Connect session's cluster as its configuration tells it: no status store, no
    executor list, no job counter (the jobs transport, which needs one, does not run here)."""

    def __init__(self, spark):
        self.spark = spark

    @property
    def parallelism(self) -> int:
        return self.stage_slots() or 2

    def dynamic_allocation(self) -> bool:
        return (_conf(self.spark, "spark.dynamicAllocation.enabled") or "false").lower() == "true"

    def stage_slots(self) -> int | None:
        """Task slots of a local master, or ``spark.default.parallelism``; None when unknown
        (Spark itself then refuses a barrier stage that does not fit)."""
        cpus = int(_conf(self.spark, "spark.task.cpus") or 1)
        m = _LOCAL_MASTER.match(_conf(self.spark, "spark.master") or "")
        if m:
            return (os.cpu_count() or 1 if m.group(1) == "*" else int(m.group(1))) // max(1, cpus)
        par = _conf(self.spark, "spark.default.parallelism")
        return int(par) if par else None

    def session_info(self) -> dict:
        return {"master": _conf(self.spark, "spark.master") or "",
                "app_id": _conf(self.spark, "spark.app.id") or ""}

    def executor_samples(self) -> list[ExecutorSample]:
        return [ExecutorSample("default", self.parallelism, 0, 0)]

    def block_homes(self, universe: int) -> dict[int, str]:
        return {}

    def job_mark(self) -> int:
        raise NotImplementedError("the jobs transport does not run on Spark Connect")

    def wait_job_after(self, mark, timeout=30.0):
        raise NotImplementedError("the jobs transport does not run on Spark Connect")


class _Value:
    """:meth:`ConnectBackend.broadcast`'s handle: the value itself, shipped with the task."""

    def __init__(self, value):
        self.value = value


class ConnectBackend(Backend):
    """:class:`Backend` over a Spark Connect session (module docstring)."""

    resident = False  # block data and state do not stay where the last stage ran

    def __init__(self, spark, run_id: str):
        self.spark = spark
        self.run_id = run_id
        self.tag = f"sparkcnn-{run_id}-{uuid.uuid4().hex[:8]}"
        self._placed: dict = {}  # (split, n) -> (persisted DataFrame, image shape, task spec)
        self._keys: dict[int, list[int]] = {}
        self._cluster = ConnectClusterView(spark)

    @property
    def cluster(self) -> ConnectClusterView:
        return self._cluster

    def _partition_keys(self, n: int) -> list[int]:
        """For k < n, a bigint whose partition under ``repartition(n, key)`` is k: Spark's
        hash partitioning is ``pmod(hash(key), n)`` with the ``hash`` function's Murmur3."""
        if n not in self._keys:
            from pyspark.sql import functions as F

            rows = (self.spark.range(0, 64 * n).select("id", F.pmod(F.hash("id"), F.lit(n)).alias("p"))
                    .groupBy("p").agg(F.min("id").alias("id")).collect())
            found = {int(r["p"]): int(r["id"]) for r in rows}
            if len(found) != n:
                raise RuntimeError(f"no partition key found for {n - len(found)} of {n} blocks")
            self._keys[n] = [found[k] for k in range(n)]
        return self._keys[n]

    def place(self, split, frame, num_blocks, spec, spread=False):
        """Pack the frame's rows per block and keep block k in partition k of a persisted
        DataFrame (module docstring); returns block -> rows."""
        from pyspark.sql import functions as F

        from sparkcnn.backends.placement import packed_chunks

        shape = tuple(frame.shape)
        keys = F.array(*[F.lit(k).cast("bigint") for k in self._partition_keys(num_blocks)])
        placed = (packed_chunks(frame, num_blocks)
                  .withColumn("_key", F.element_at(keys, F.col("block") + 1))
                  .repartition(num_blocks, "_key").drop("_key").persist())
        counts = self._run(
            lambda: placed.mapInArrow(_count_task, "block int, rows long, blocks int").collect())
        mixed = [r["block"] for r in counts if r["blocks"] != 1]
        if mixed or len(counts) != num_blocks:
            placed.unpersist()
            raise RuntimeError(f"placing {split}: {len(counts)} partitions for {num_blocks} blocks "
                               f"(mixed: {mixed})")
        old = self._placed.pop((split, num_blocks), None)
        if old is not None:
            old[0].unpersist()
        self._placed[(split, num_blocks)] = (placed, shape, spec)
        return {int(r["block"]): int(r["rows"]) for r in counts}

    def _run(self, action):
        """``action()`` with this run's tag on its queries, so :meth:`stop` can interrupt them."""
        self.spark.addTag(self.tag)
        try:
            return action()
        finally:
            self.spark.removeTag(self.tag)

    def _over_blocks(self, fn, blocks, universe, split, barrier: bool) -> list:
        from sparkcnn.streamwire import decode

        if universe is None or (split, universe) not in self._placed:
            raise BadInput(f"a Spark Connect session runs tasks over placed {split} blocks only")
        placed, shape, spec = self._placed[(split, universe)]
        wanted = None if sorted(blocks) == list(range(universe)) else set(blocks)
        task = _block_task(fn, spec, split, universe, shape, wanted)
        df = placed.mapInArrow(task, RESULT_SCHEMA, barrier=barrier)
        if barrier:  # Spark reruns a failed barrier stage only when it is a shuffle map stage
            df = df.repartition(1)
        rows = self._run(df.collect)
        return [decode(r["result"], RESULT_TYPES) for r in sorted(rows, key=lambda r: r["block"])]

    def map_blocks(self, fn, blocks, description="", universe=None, split="train", tree_depth=None):
        """``tree_depth`` is ignored: the results are a few small wire messages, collected."""
        return self._over_blocks(fn, list(blocks), universe, split, barrier=False)

    def run_stage(self, fn, universe, description=""):
        return self._over_blocks(fn, list(range(universe)), universe, "train", barrier=True)

    def driver_host(self) -> str:
        """The Spark driver's address, which must be one of this process's: the parameter-server
        service runs here and the tasks reach it there."""
        host = _conf(self.spark, "spark.driver.host") or "127.0.0.1"
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((socket.gethostbyname(host), 0))
        except OSError:
            raise BadInput(f"engine.transport=stream on Spark Connect runs the parameter server in this "
                           f"process, which must be on the Spark driver's host ({host}); it is not") from None
        return host

    def broadcast(self, value):
        return _Value(value)

    def unpersist(self, bcast):
        pass

    def stop(self):
        self.spark.interruptTag(self.tag)

    def close(self):
        for placed, _, _ in self._placed.values():
            placed.unpersist()
        self._placed.clear()
