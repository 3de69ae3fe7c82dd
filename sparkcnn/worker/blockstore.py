"""Executor-side storage of data blocks and per-block state.

A data block is one uint8 ``N×H×W×C`` image array and one int32 label array.
Spark delivers it (see :meth:`sparkcnn.backends.backend.Backend.place`): the
placement job stores each block here on the executor that will train it, and a
lost executor's blocks are rebuilt by Spark from the data's lineage.
``read_block`` reads a row range of a prepared split directly (benchmarks).

Blocks and block states live in this process's memory and are spilled to the
executor's local directory keyed by run id and block id, so every Python
worker process of the executor can pick them up. Nothing here imports Spark
or TensorFlow.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time

import numpy as np
import pyarrow.parquet as pq

from sparkcnn.data.parquet_io import image_column_to_numpy, parquet_files, read_meta

log = logging.getLogger(__name__)

_BLOCKS: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
_STATES: dict[tuple, dict] = {}
_LOCK = threading.Lock()


def block_range(num_rows: int, num_blocks: int, block: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of block ``block``: ``lo = block·n // N``."""
    return block * num_rows // num_blocks, (block + 1) * num_rows // num_blocks


def read_block(split_dir: str, num_blocks: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Read block ``block`` of ``num_blocks`` from a prepared split, touching only its row groups."""
    meta = read_meta(split_dir)
    lo, hi = block_range(meta.num_rows, num_blocks, block)
    images = np.empty((hi - lo, meta.height, meta.width, meta.channels), np.uint8)
    labels = np.empty(hi - lo, np.int32)
    row_bytes = meta.height * meta.width * meta.channels
    pos = 0  # global row index at the start of the current row group
    for path in parquet_files(split_dir):
        pf = pq.ParquetFile(path)
        for g in range(pf.metadata.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            a, b = max(lo, pos), min(hi, pos + n)
            if a < b:
                table = pf.read_row_group(g, columns=["image", "label"]).slice(a - pos, b - a)
                images[a - lo:b - lo] = image_column_to_numpy(table.column("image"), row_bytes, path).reshape(
                    b - a, meta.height, meta.width, meta.channels)
                labels[a - lo:b - lo] = table.column("label").to_numpy().astype(np.int32, copy=False)
            pos += n
            if pos >= hi:
                return images, labels
    return images, labels


def _dir(root: str, run_id: str) -> str:
    path = os.path.join(root, "sparkcnn", run_id)
    os.makedirs(path, exist_ok=True)
    return path


class BlockMissing(RuntimeError):
    """A block is neither in this process nor in the executor's spill (it was placed elsewhere)."""


def get_block(root: str, run_id: str, split: str, num_blocks: int, block: int,
              load=None) -> tuple[np.ndarray, np.ndarray]:
    """The block from this process, else the executor's spill, else ``load()`` (stored);
    :class:`BlockMissing` without ``load``."""
    key = (run_id, split, num_blocks, block)
    hit = _BLOCKS.get(key)
    if hit is not None:
        return hit
    base = os.path.join(_dir(root, run_id), f"data-{split}-{num_blocks}-{block}")
    try:
        hit = (np.load(base + ".x.npy", mmap_mode="r"), np.load(base + ".y.npy"))
    except (OSError, ValueError):
        if load is None:
            raise BlockMissing(f"run {run_id}: {split} block {block} of {num_blocks} is not resident on "
                               f"this executor ({root})") from None
        return put_block(root, run_id, split, num_blocks, block, *load())
    with _LOCK:
        _BLOCKS[key] = hit
    return hit


def put_block(root: str, run_id: str, split: str, num_blocks: int, block: int,
              images: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Keep a block in this process and spill it to the executor's local directory."""
    base = os.path.join(_dir(root, run_id), f"data-{split}-{num_blocks}-{block}")
    for suffix, arr in ((".x.npy", images), (".y.npy", labels)):
        _atomic_save(base + suffix, arr)
    with _LOCK:
        _BLOCKS[(run_id, split, num_blocks, block)] = (images, labels)
    return images, labels


def _atomic_save(path: str, arr: np.ndarray) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "wb") as fh:
        np.save(fh, arr, allow_pickle=False)
    os.replace(tmp, path)


def save_state(root: str, run_id: str, block: int, round_tag: int, arrays: dict[str, np.ndarray]) -> None:
    """Keep block state tagged with the round that produced it; the last two tags are kept.

    Two tags survive so that a round the driver re-runs (job failed after this
    task succeeded) still finds the state it started from.
    """
    with _LOCK:
        states = _STATES.setdefault((run_id, block), {})
        states[round_tag] = arrays
        for tag in sorted(states)[:-2]:
            del states[tag]
    d = _dir(root, run_id)
    fd, tmp = tempfile.mkstemp(dir=d, suffix=".tmp")
    with os.fdopen(fd, "wb") as fh:
        np.savez(fh, **arrays)
    os.replace(tmp, os.path.join(d, f"state-{block}-{round_tag}.npz"))
    for name in os.listdir(d):
        if name.startswith(f"state-{block}-") and name.endswith(".npz"):
            tag = int(name[len(f"state-{block}-"):-4])
            if tag < round_tag - 1:
                try:
                    os.remove(os.path.join(d, name))
                except FileNotFoundError:
                    pass


def load_state(root: str, run_id: str, block: int, round_tag: int,
               wait_s: float = 0.0) -> dict[str, np.ndarray] | None:
    """The block state produced by round ``round_tag``, or None when it is gone.

    ``wait_s`` > 0 (pipelined rounds): the previous round's task on this block
    may still be running in another Python worker; poll for its state.
    """
    path = os.path.join(_dir(root, run_id), f"state-{block}-{round_tag}.npz")
    deadline = time.monotonic() + wait_s
    while True:
        hit = _STATES.get((run_id, block), {}).get(round_tag)
        if hit is not None:
            return hit
        try:
            with np.load(path, allow_pickle=False) as z:
                return {k: z[k] for k in z.files}
        except (OSError, ValueError):
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.002)
