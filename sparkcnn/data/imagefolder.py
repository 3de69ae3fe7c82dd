"""Image folders through Spark in one pass: every file read once, by tasks sized by bytes.

The driver lists the folder and reads the first image's header (:mod:`sparkcnn.data.images`);
one DataFrame of ``spark.range`` with one row per task decodes each task's files there
(``mapInArrow``), so a task holds ~1-64 MB of files whatever their count, where Spark's own
file sources count each tiny file as 4 MB and start ~1,600 tasks for CIFAR-10. Refused files
come back as rows with an ``error``; the driver raises the first one (:class:`BadInput`).

- ``sparkcnn prepare --format images`` collects the decoded train and test splits to the
  driver (:func:`read_splits`), which writes them as a prepared dataset;
- training on a folder (:func:`folder_frame`) keeps the decoded rows cached by Spark: the
  query checking them reads the files, and the placement reads the cache.

Paths are read as local files by the tasks: the folder must be where the executors run
(a local session, or a shared mount), as with Spark's own file sources on ``file:`` paths.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import threading

import numpy as np
import pyarrow.compute as pc

from sparkcnn.data.images import Listing, groups, header, scan, split_roots
from sparkcnn.data.parquet_io import image_column_to_numpy
from sparkcnn.errors import BadInput

log = logging.getLogger(__name__)

DECODED_DDL = "split tinyint, image binary, label int, error string"


@dataclasses.dataclass(frozen=True)
class Decoded:
    """An image folder decoded through Spark, checked: what a training frame needs."""

    df: object                    # DataFrame: image (binary uint8 HWC), label (int)
    cache: object                 # the persisted DataFrame ``df`` reads; unpersist once placed
    shape: tuple[int, int, int]   # (H, W, C)
    classes: tuple[str, ...]
    rows: int


def parallelism(spark) -> int:
    try:
        return int(spark.sparkContext.defaultParallelism)
    except Exception:  # noqa: BLE001 - a Connect session has no SparkContext: its default, 2 slots
        return int(spark.conf.get("spark.default.parallelism", "2"))


def decoded_df(spark, listings: list[Listing], shape: tuple[int, int, int], max_pixels: int):
    """A DataFrame (:data:`DECODED_DDL`) of every image of ``listings``, ``split`` being the index of
    its listing; one task per byte-sized group of files, in listing order."""
    plan = []  # (split, root, files, labels) per task
    for s, listing in enumerate(listings):
        for a, b in groups(listing.sizes, parallelism(spark)):
            plan.append((s, listing.root, listing.files[a:b], listing.labels[a:b]))
    shape = tuple(int(v) for v in shape)

    def decode_tasks(batches):
        from sparkcnn.data.images import decode_group

        for batch in batches:
            for i in batch.column(0).to_pylist():
                s, root, files, labels = plan[i]
                yield decode_group(root, files, labels, s, shape, max_pixels)

    return spark.range(len(plan), numPartitions=len(plan)).mapInArrow(decode_tasks, DECODED_DDL)


def first_shape(listing: Listing, max_pixels: int) -> tuple[int, int, int]:
    """(H, W, C) of the folder's first image, from its header: every other image must match it."""
    return header(os.path.join(listing.root, listing.files[0]), max_pixels)


def read_splits(spark, source: str, max_pixels: int, progress: bool = False):
    """({split: (uint8 NHWC images, int32 labels)}, classes) of an image folder, ``train/`` and
    ``test/`` when it has them, else the folder as the train split; one Spark job."""
    roots = split_roots(source) or {"train": source}
    train = scan(roots["train"])
    listings = [train] + ([scan(roots["test"], train.classes)] if "test" in roots else [])
    shape = first_shape(train, max_pixels)
    df = decoded_df(spark, listings, shape, max_pixels)
    table = with_progress(spark, df.toArrow, f"decoding {sum(len(x.files) for x in listings)} images",
                          progress)
    raise_first_error(table.column("error"))
    out, start = {}, 0
    for name, listing in zip(roots, listings):
        n = len(listing.files)
        part = table.slice(start, n)
        start += n
        images = image_column_to_numpy(part.column("image"), int(np.prod(shape)), listing.root)
        out[name] = (images.reshape(n, *shape), part.column("label").to_numpy().astype(np.int32))
    return out, train.classes


def folder_frame(spark, root: str, max_pixels: int, classes: tuple[str, ...] | None = None) -> Decoded:
    """An image folder for training, decoded once: cached by Spark, checked by one query that reads
    every file (the placement then reads the cache, not the files)."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    listing = scan(root, classes)
    shape = first_shape(listing, max_pixels)
    cache = decoded_df(spark, [listing], shape, max_pixels).persist(StorageLevel.MEMORY_AND_DISK)
    try:
        row = cache.agg(F.count(F.lit(1)), F.min("error")).first()
        if row[1] is not None:
            raise BadInput(row[1])
        if row[0] != len(listing.files):
            raise BadInput(f"{root}: {row[0]} images decoded, {len(listing.files)} listed")
    except BaseException:
        cache.unpersist()
        raise
    df = cache.select("image", "label")
    return Decoded(df, cache, shape, listing.classes, len(listing.files))


def raise_first_error(errors) -> None:
    """BadInput with the first non-null error of an Arrow column (a refused file), if any."""
    if errors.null_count < len(errors):
        raise BadInput(pc.drop_null(errors)[0].as_py())


def with_progress(spark, action, desc: str, progress: bool):
    """``action()`` (a Spark action), with a bar of its tasks done when ``progress`` and stderr is a
    terminal (tqdm's rule); the tasks are read from Spark's status tracker."""
    if not progress:
        return action()
    try:
        sc = spark.sparkContext
    except Exception:  # noqa: BLE001 - Spark Connect: no status tracker, no bar
        return action()
    group = f"sparkcnn-prepare-{secrets.token_hex(4)}"
    sc.setJobGroup(group, f"sparkcnn prepare: {desc}")
    done = threading.Event()
    watcher = threading.Thread(target=_watch, args=(sc, group, desc, done), daemon=True)
    watcher.start()
    try:
        return action()
    finally:
        done.set()
        watcher.join()
        sc.setLocalProperty("spark.jobGroup.id", None)
        sc.setLocalProperty("spark.job.description", None)


def _watch(sc, group: str, desc: str, done: threading.Event) -> None:
    from tqdm.auto import tqdm

    bar = tqdm(total=None, desc=desc, unit="task", disable=None, leave=True, mininterval=0.2)
    tracker = sc.statusTracker()
    try:
        while True:
            finished = done.wait(0.25)
            total = completed = 0
            for job in tracker.getJobIdsForGroup(group):
                info = tracker.getJobInfo(job)
                for stage in (info.stageIds if info else ()):
                    st = tracker.getStageInfo(stage)
                    if st is not None:
                        total += st.numTasks
                        completed += st.numCompletedTasks
            if total and total != bar.total:  # known once the job's stage is submitted
                bar.reset(total=total)
            if total:
                bar.update(completed - bar.n)
            if finished:
                return
    except Exception:  # noqa: BLE001 - the bar is a convenience; the action's own errors matter
        log.debug("progress of %s unavailable", group, exc_info=True)
    finally:
        bar.close()
