"""`sparkcnn prepare`: raw dataset files → the prepared Parquet dataset.

Input formats (`format`):

- `idx`: MNIST/Fashion-MNIST directory with `train-images-idx3-ubyte[.gz]`,
  `train-labels-idx1-ubyte[.gz]` and the `t10k-` pair (e.g. the Debian
  package dataset-fashion-mnist, `/usr/share/datasets/fashion-mnist/`);
  class names are Fashion-MNIST's.
- `cifar10-bin`: `data_batch_1.bin` … `data_batch_5.bin`, `test_batch.bin`.
- `cifar10-py`: `data_batch_1` … `data_batch_5`, `test_batch` (pickles, read
  through a restricted unpickler).
- `images`: a folder of JPEG/PNG images, one sub-folder per class, or one such folder
  per split in `train/` and `test/` (see `images.scan`); decoded by one Spark job
  (a local session unless `spark` is given), the files read once
  (`imagefolder.read_splits`); an image over `max_image_pixels` is refused from its
  header.
- `parquet`: a Parquet file or directory (→ split "train"), or a directory
  with `train/` and optionally `test/` subdirectories; see
  `parquet_io.read_parquet_input` for columns and options.

Every record is checked before anything is written. The output is built in
`<out>.tmp-<random>` beside `out` and renamed into place only when complete;
an existing dataset at `out` is moved aside, replaced, then deleted, so a
failed run never damages an earlier dataset.

The train split's per-channel pixel mean and standard deviation (in [0, 1] units) go into
its schema metadata (`sparkcnn.mean`, `sparkcnn.std`) and the sidecar, for normalisation.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil

import numpy as np

from sparkcnn.data import cifar, idx, parquet_io
from sparkcnn.data.images import channel_stats
from sparkcnn.data.labels import check_labels
from sparkcnn.errors import BadInput

log = logging.getLogger(__name__)

FORMATS = ("idx", "cifar10-bin", "cifar10-py", "images", "parquet")
SPLITS = ("train", "test")
# Parquet input without class names gets names "0".."k-1"; a label beyond this
# is almost surely not a class index.
MAX_UNNAMED_CLASSES = 65536

Splits = dict[str, tuple[np.ndarray, np.ndarray]]  # split → (uint8 NHWC, int labels)


def prepare(format: str, source, out, *, height: int | None = None,
            width: int | None = None, channels: int | None = None,
            rows_per_file: int = 10000, spark=None, max_image_pixels: int | None = None,
            progress: bool = False) -> dict:
    """Read, validate and write `source` as a prepared dataset at `out`.

    `height`/`width`/`channels` (pixels, pixels, channels) are needed for
    Parquet input without `sparkcnn.*` metadata; for other formats they are
    optional and must match the data. `images` only: `spark`, the session that
    decodes (default: the active one, else a local one), `max_image_pixels`
    (default: data.max_image_pixels's), `progress`, a bar of the decoding tasks.
    Returns a JSON-able summary.
    """
    source, out = os.fspath(source), os.fspath(out)
    if format not in FORMATS:
        raise BadInput(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    if format == "images":
        _check_replaceable(out)  # before the Spark pass, the expensive part
        splits, classes = _read_images(source, spark, max_image_pixels, progress)
    else:
        splits, classes = _read(format, source, height, width, channels)
    shape = _validate(source, splits, classes, {"height": height, "width": width,
                                                "channels": channels})
    _check_replaceable(out)
    mean, std = channel_stats(splits["train"][0])
    stats = {parquet_io.META_MEAN: json.dumps(mean), parquet_io.META_STD: json.dumps(std)}
    tmp = _make_tmp(out)
    try:
        files = {split: parquet_io.write_split(os.path.join(tmp, split), images, labels,
                                               classes, rows_per_file, stats if split == "train" else None)
                 for split, (images, labels) in splits.items()}
        parquet_io.write_sidecar(tmp, {split: (images, classes) for split, (images, _) in splits.items()},
                                 {"train": {"mean": mean, "std": std}})
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    summary = {
        "format": format, "source": source, "out": out,
        "height": shape[0], "width": shape[1], "channels": shape[2],
        "classes": list(classes), "mean": mean, "std": std,
        "splits": {split: {"rows": int(len(labels)), "files": len(files[split]),
                           "class_counts": np.bincount(labels, minlength=len(classes)).tolist()}
                   for split, (_, labels) in splits.items()},
    }
    log.info("prepared %s dataset at %s: %s", format, out,
             {s: v["rows"] for s, v in summary["splits"].items()})
    return summary


def _read_images(source: str, spark, max_pixels, progress: bool) -> tuple[Splits, tuple[str, ...]]:
    from sparkcnn.config_sections import DataConfig
    from sparkcnn.data.imagefolder import read_splits

    if not os.path.isdir(source):
        raise BadInput(f"{source}: no such image folder")
    if spark is None:
        from sparkcnn.backends.session import get_or_create_spark

        spark = get_or_create_spark(app_name="sparkcnn prepare")
    limit = DataConfig.max_image_pixels if max_pixels is None else max_pixels
    DataConfig(max_image_pixels=limit).validate("data")
    return read_splits(spark, source, limit, progress)


def _read(format: str, source: str, height, width, channels
          ) -> tuple[Splits, tuple[str, ...]]:
    """All splits of `source` and their class names."""
    if format == "idx":
        return {s: idx.read_idx_split(source, s) for s in SPLITS}, idx.FASHION_MNIST_CLASSES
    if format in ("cifar10-bin", "cifar10-py"):
        kind = format.rsplit("-", 1)[1]
        splits, classes = {}, None
        for s in SPLITS:
            images, labels, classes = cifar.read_cifar_split(source, kind, s)
            splits[s] = (images, labels)
        return splits, classes
    # parquet: train/ and test/ subdirectories, or one file/dir as "train".
    sub = {s: os.path.join(source, s) for s in SPLITS}
    if not os.path.isdir(sub["train"]):
        sub = {"train": source}
    elif not os.path.isdir(sub["test"]):
        del sub["test"]
    splits, found = {}, []
    for s, path in sub.items():
        images, labels, names = parquet_io.read_parquet_input(
            path, height=height, width=width, channels=channels)
        splits[s] = (images, labels)
        if names is not None:
            found.append((path, names))
    if any(names != found[0][1] for _, names in found):
        raise BadInput(f"{found[-1][0]}: class names differ from those of {found[0][0]}")
    if found:
        return splits, found[0][1]
    top = max((int(lab.max()) for _, lab in splits.values() if lab.size), default=0)
    if top >= MAX_UNNAMED_CLASSES:
        raise BadInput(f"{source}: label {top} is too large for a class index and there is no "
                       f"{parquet_io.META_CLASSES} metadata naming the classes")
    return splits, tuple(str(i) for i in range(top + 1))


def _validate(source: str, splits: Splits, classes, given: dict) -> tuple[int, int, int]:
    """Check non-empty splits, one image shape, labels in range; return (H, W, C)."""
    if len(set(classes)) != len(classes):
        raise BadInput(f"{source}: class names are not unique: {list(classes)}")
    shape = None
    for split, (images, labels) in splits.items():
        if len(images) == 0:
            raise BadInput(f"{source}: empty dataset: split '{split}' has no records")
        if len(images) != len(labels):
            raise BadInput(f"{source}: split '{split}' has {len(images)} images "
                           f"but {len(labels)} labels")
        check_labels(f"{source} (split '{split}')", labels, len(classes))
        if shape is None:
            shape = images.shape[1:]
        elif images.shape[1:] != shape:
            raise BadInput(f"{source}: split '{split}' images are {images.shape[1:]} (H, W, C) "
                           f"but the first split's are {shape}")
    for (name, value), actual in zip(given.items(), shape):
        if value is not None and value != actual:
            raise BadInput(f"{source}: {name}={value} given but the images have {name} {actual}")
    return tuple(int(d) for d in shape)


def _looks_prepared(out: str) -> bool:
    """True if `out` is empty or holds only split dirs of part-*.parquet files (and sparkcnn.json)."""
    for entry in os.scandir(out):
        if entry.name == parquet_io.SIDECAR and entry.is_file(follow_symlinks=False):
            continue
        if entry.name not in SPLITS or not entry.is_dir(follow_symlinks=False):
            return False
        for f in os.scandir(entry.path):
            if not (f.name.startswith("part-") and f.name.endswith(".parquet")):
                return False
    return True


def _check_replaceable(out: str) -> None:
    """Refuse to replace anything at `out` that is not a prepared dataset."""
    if os.path.islink(out) or (os.path.exists(out) and not os.path.isdir(out)):
        raise BadInput(f"{out}: output exists and is not a directory")
    if os.path.isdir(out) and not _looks_prepared(out):
        raise BadInput(f"{out}: refusing to replace a directory that is not a prepared "
                       "dataset (expected only train/ and test/ with part-*.parquet)")


def _make_tmp(out: str) -> str:
    """Create `<out>.tmp-<random>` beside `out` (and `out`'s parents)."""
    parent = os.path.dirname(os.path.abspath(out))
    tmp = os.path.join(parent, f"{os.path.basename(os.path.abspath(out))}.tmp-{secrets.token_hex(4)}")
    try:
        os.makedirs(parent, exist_ok=True)
        os.mkdir(tmp)
    except OSError as e:
        raise BadInput(f"{out}: output directory is not writable ({e.strerror or e}: "
                       f"{e.filename or parent})") from None
    return tmp


def _replace(tmp: str, out: str) -> None:
    """Move the finished `tmp` to `out`; an old `out` is kept until that worked."""
    if not os.path.exists(out):
        os.rename(tmp, out)
        return
    old = f"{os.path.abspath(out)}.old-{secrets.token_hex(4)}"
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)
