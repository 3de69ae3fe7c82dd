"""Executor side of block placement: rows -> per-block chunks -> one resident block.

Placement is two steps inside Spark (see ``Backend.place``)::

    input partition p, row j  ->  block (p + j) mod N      (pack: Arrow batches -> chunks)
    shuffle by block          ->  block k = its chunks in (p, seq) order   (store)

Round-robin over each input partition keeps blocks within a few rows of equal
size whatever order the rows come in (a folder of images arrives class by
class), and sorting the chunks makes a block's row order the same on every
recomputation. Nothing here imports Spark.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from sparkcnn.worker import blockstore
from sparkcnn.data.frames import images_from_arrow
from sparkcnn.protocol import TaskContextInfo, TaskSpec

CHUNK_SCHEMA = pa.schema([("block", pa.int32()), ("part", pa.int32()), ("seq", pa.int32()),
                          ("images", pa.large_binary()), ("labels", pa.large_binary())])


def assign_blocks(part: int, start: int, n: int, num_blocks: int) -> np.ndarray:
    """Blocks of rows ``start .. start + n - 1`` of input partition ``part``."""
    return (part + start + np.arange(n)) % num_blocks


def pack_rows(batches, part: int, kind: str, shape: tuple, num_blocks: int):
    """Arrow batches of (image, label) rows of input partition ``part`` -> per batch, its number
    and the chunks of the blocks that have rows in it: ``(seq, [(block, images bytes, labels bytes)])``."""
    start = 0
    for seq, batch in enumerate(batches):
        n = batch.num_rows
        if n == 0:
            continue
        images = images_from_arrow(batch.column(0), tuple(shape), "image", kind)
        labels = batch.column(1).to_numpy(zero_copy_only=False).astype(np.int32)
        blocks = assign_blocks(part, start, n, num_blocks)
        start += n
        rows = []
        for k in np.unique(blocks):
            sel = blocks == k
            rows.append((int(k), np.ascontiguousarray(images[sel]).tobytes(), labels[sel].tobytes()))
        yield seq, rows


def pack(batches, part: int, kind: str, shape: tuple, num_blocks: int):
    """Arrow batches of (image, label) rows of input partition ``part`` -> chunk batches
    (:data:`CHUNK_SCHEMA`), one per block that has rows in a batch."""
    for seq, rows in pack_rows(batches, part, kind, shape, num_blocks):
        yield pa.RecordBatch.from_arrays(
            [pa.array([r[0] for r in rows], pa.int32()), pa.array([part] * len(rows), pa.int32()),
             pa.array([seq] * len(rows), pa.int32()), pa.array([r[1] for r in rows], pa.large_binary()),
             pa.array([r[2] for r in rows], pa.large_binary())], schema=CHUNK_SCHEMA)


def pack_files(paths, part: int, shape: tuple, num_blocks: int, batch_rows: int):
    """A prepared split's Parquet files (``paths``, input partition ``part``), read here, as
    ``(block, (part, seq, images bytes, labels bytes))`` pairs: :func:`pack_rows` over their
    batches of ``batch_rows`` rows."""
    import pyarrow.parquet as pq

    def batches():
        for path in paths:
            yield from pq.ParquetFile(path).iter_batches(batch_size=batch_rows, columns=["image", "label"])

    for seq, rows in pack_rows(batches(), part, "binary", shape, num_blocks):
        for k, images, labels in rows:
            yield k, (part, seq, images, labels)


def store(spec: TaskSpec, split: str, num_blocks: int, block: int, chunks, ctx: TaskContextInfo,
          shape: tuple) -> tuple[int, int]:
    """Assemble block ``block`` from its ``(part, seq, images, labels)`` chunks and keep it on
    this executor; warm the worker's model up (TF import, tracing). Returns (block, rows)."""
    from sparkcnn.worker.task import local_root
    from sparkcnn.worker.trainer import get_trainer

    chunks = sorted(chunks, key=lambda c: (c[0], c[1]))
    h, w, c = shape
    images = np.concatenate([np.frombuffer(ch[2], np.uint8) for ch in chunks] or [np.empty(0, np.uint8)])
    labels = np.concatenate([np.frombuffer(ch[3], np.int32) for ch in chunks] or [np.empty(0, np.int32)])
    images = images.reshape(-1, h, w, c)
    blockstore.put_block(local_root(spec, ctx), spec.run_id, split, num_blocks, block, images, labels)
    trainer = get_trainer(spec, ctx, f"placing {split} block {block} attempt {ctx.attempt}")
    if split == "train":
        trainer.warm_up(images, labels, spec.per_step)
    return block, int(len(labels))


def split_arrays(images: np.ndarray, labels: np.ndarray,
                 num_blocks: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """In-process placement: the same rule with the whole input as partition 0."""
    blocks = assign_blocks(0, 0, len(labels), num_blocks)
    return [(np.ascontiguousarray(images[blocks == k]), labels[blocks == k].astype(np.int32))
            for k in range(num_blocks)]
