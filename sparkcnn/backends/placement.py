"""Block placement on a classic Spark session: every block kept where its tasks will run.

Blocks go through Spark itself, no shared path: the frame's rows are packed per
block on the executors (``worker.blocks.pack``), shuffled so that partition k
holds block k's chunks, and stored there (``worker.blocks.store``) by the
partition's task, whose output, one ``(k, rows)`` marker, is persisted.

The cached markers give every block a home executor: jobs derived from them run
block k where its data and state live (PROCESS_LOCAL) and read only the tiny
marker, not the data, so a round costs what it did over a plain marker RDD. If
that executor is lost, Spark recomputes the marker elsewhere from the shuffle
(or the source), which stores the block there, and the block's state restart is
counted by the worker.

``spread``: the storing tasks run as one barrier stage, so each block gets a
task slot of its own at once. Otherwise Spark may store two blocks on one
executor (a reduce task prefers the executor holding most of its shuffle input,
and one executor often finishes both), and the stream's barrier stage, which
needs every block at once, would then start a block's task on an executor that
does not hold it.

A prepared split on the driver's file system, on a local master, is read by the
RDD's own Python workers instead (``worker.blocks.pack_files``, one task per
Parquet file): its rows no longer go through the JVM as a DataFrame (Arrow to
rows, then each row pickled to Python for the shuffle), and the SQL engine's
Python workers are not started for it. The rule of the blocks is the same,
with file i as input partition i.

The functions shipped to the executors import the worker modules inside
themselves: the driver's side imports none.
"""

from __future__ import annotations

import os

from sparkcnn.backends.backend import spark_task_context

# rows per Arrow batch read from a local split's files: Spark's own batch for mapInArrow
# (spark.sql.execution.arrow.maxRecordsPerBatch's default), so chunks are as large either way
LOCAL_BATCH_ROWS = 10000


def _chunk_pair(row):
    """A packed chunk row -> (block, (part, seq, images, labels)) for the shuffle by block."""
    return row[0], (row[1], row[2], row[3], row[4])


def _block_partition(block: int) -> int:
    return block


def _one_key(x):
    return 0, x


def barrier_results(rdd):
    """The output of ``rdd``, a barrier stage, through a one-partition shuffle: Spark reruns a
    failed barrier stage as a whole only when it is a shuffle map stage (a failed barrier
    result stage aborts the job)."""
    return rdd.map(_one_key).partitionBy(1).values()


def packed_chunks(frame, num_blocks: int):
    """``frame``'s rows packed per block on the executors (``worker.blocks.pack``): a DataFrame of
    chunk rows (:data:`~sparkcnn.protocol.SPARK_CHUNK_SCHEMA`), the start of every placement."""
    from sparkcnn.protocol import SPARK_CHUNK_SCHEMA

    kind, shape = frame.kind, tuple(frame.shape)

    def packer(batches):
        from pyspark import TaskContext

        from sparkcnn.worker.blocks import pack

        return pack(batches, TaskContext.get().partitionId(), kind, shape, num_blocks)

    return frame.df.mapInArrow(packer, SPARK_CHUNK_SCHEMA)


def local_files(frame, master: str) -> list[str]:
    """The Parquet files of ``frame``'s prepared split when a local master's executors can read them
    where the driver does (its directory on this file system); [] otherwise."""
    if not frame.local_dir or not master.startswith("local") or not os.path.isdir(frame.local_dir):
        return []
    return sorted(os.path.join(frame.local_dir, f) for f in os.listdir(frame.local_dir)
                  if f.endswith(".parquet") and not f.startswith(("_", ".")))


def local_pairs(sc, files: list[str], shape: tuple, num_blocks: int):
    """``(block, chunk)`` pairs of :func:`packed_chunks`'s rows, read from ``files`` by the RDD's
    Python workers: file i is input partition i."""

    def read(part, paths):
        from sparkcnn.worker.blocks import pack_files

        return pack_files(list(paths), part, shape, num_blocks, LOCAL_BATCH_ROWS)

    return sc.parallelize(files, len(files)).mapPartitionsWithIndex(read)


def place_blocks(spark, frame, split: str, num_blocks: int, spec, spread: bool, name: str):
    """(the persisted marker RDD, block -> rows) of ``split``'s ``num_blocks`` blocks, placed as
    the module docstring says; ``name``: the RDD's name in the Spark UI. ``frame.df`` may still
    be a prepared split's directory (:func:`~sparkcnn.data.source.local_prepared`): read through
    ``spark`` here unless its files are read directly."""
    from pyspark import StorageLevel

    shape = tuple(frame.shape)

    def store(k, it):
        from sparkcnn.worker.blocks import store as store_block

        yield store_block(spec, split, num_blocks, k, [v for _, v in it], spark_task_context(), shape)

    sc = spark.sparkContext
    files = local_files(frame, sc.master)
    if files:
        pairs = local_pairs(sc, files, shape, num_blocks)
    else:
        from sparkcnn.data.source import attach

        pairs = packed_chunks(attach(spark, frame), num_blocks).rdd.map(_chunk_pair)
    pairs = pairs.partitionBy(num_blocks, _block_partition)
    stored = (pairs.barrier() if spread else pairs).mapPartitionsWithIndex(store)
    rdd = stored.persist(StorageLevel.MEMORY_ONLY)
    rdd.setName(name)
    sizes = dict((barrier_results(rdd) if spread else rdd).collect())
    return rdd, sizes
