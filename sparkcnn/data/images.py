"""Folders of JPEG/PNG images, one sub-folder per class: listed and checked on the driver, decoded
on the executors.

Layout: ``<root>/<class>/<image>`` (an image may sit deeper inside its class folder); classes
are the sorted sub-folder names. A root holding ``train/`` (and ``test/``) is one such folder
per split. Listing reads no image: it refuses a folder whose images have no class sub-folder,
a class folder holding no image and a folder with no image at all, each naming the folder.

Decoding (:func:`decode_group`, run in a Spark task) opens each file's header first and
refuses an image over ``max_pixels`` before its pixels are decoded; a file that does not
decode, or whose size differs from the first image's, is refused too. A refusal is a row
whose ``error`` names the file, never an exception in the task, so the driver reports the
first one in one line. This module imports neither Spark nor TensorFlow.
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import numpy as np
import pyarrow as pa

from sparkcnn.errors import BadInput

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
SPLITS = ("train", "test")
DECODED_SCHEMA = pa.schema([("split", pa.int8()), ("image", pa.binary()), ("label", pa.int32()),
                            ("error", pa.string())])
_CHANNELS = {"L": 1, "RGB": 3, "RGBA": 4}
_FORMATS = ("JPEG", "PNG")  # Pillow's plugins to try: the suffixes listed, no guessing among all


@dataclasses.dataclass(frozen=True)
class Listing:
    """The images of one split folder, in a fixed order (class, then path)."""

    root: str                    # the split folder
    classes: tuple[str, ...]     # class names, indexed by label
    files: tuple[str, ...]       # paths relative to ``root``
    labels: tuple[int, ...]      # label of each file
    sizes: tuple[int, ...]       # bytes on disk of each file

    @property
    def bytes(self) -> int:
        return sum(self.sizes)


def is_image(name: str) -> bool:
    return name.lower().endswith(IMAGE_SUFFIXES) and not name.startswith(".")


def split_roots(root: str) -> dict[str, str] | None:
    """``{"train": <root>/train, "test": <root>/test}`` (test when present) for a root laid out in
    splits, None for a root that is one image folder."""
    if not os.path.isdir(os.path.join(root, "train")):
        return None
    return {s: os.path.join(root, s) for s in SPLITS if os.path.isdir(os.path.join(root, s))}


def scan(root: str, classes: tuple[str, ...] | None = None) -> Listing:
    """Every image under ``root``, labelled by its class folder; ``classes``: the training classes
    that a test folder's class folders must be among (default: its own sub-folder names)."""
    if not os.path.isdir(root):
        raise BadInput(f"{root}: no such image folder")
    dirs, loose = [], []
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if entry.name.startswith("."):
            continue
        if entry.is_dir():
            dirs.append(entry.name)
        elif is_image(entry.name):
            loose.append(entry.name)
    if loose:
        where = "outside its class sub-folders" if dirs else "but no class sub-folders"
        raise BadInput(f"{root}: {len(loose)} image(s) {where} (e.g. {loose[0]}); expected "
                       "one sub-folder per class: <folder>/<class>/<image>")
    found = {d: _images_under(os.path.join(root, d)) for d in dirs}
    if not any(found.values()):
        what = f"in its {len(dirs)} sub-folder(s)" if dirs else "and no class sub-folders"
        raise BadInput(f"{root}: no images found ({', '.join(IMAGE_SUFFIXES)}) {what}")
    for d in dirs:
        if not found[d]:
            raise BadInput(f"{os.path.join(root, d)}: class folder holds no images "
                           f"({', '.join(IMAGE_SUFFIXES)})")
    names = tuple(classes) if classes else tuple(dirs)
    index = {n: i for i, n in enumerate(names)}
    files, labels, sizes = [], [], []
    for d in dirs:
        if d not in index:
            raise BadInput(f"{os.path.join(root, d)}: class {d!r} is not one of the training classes "
                           f"({', '.join(names)})")
        for rel, size in found[d]:
            files.append(os.path.join(d, rel))
            labels.append(index[d])
            sizes.append(size)
    return Listing(root, names, tuple(files), tuple(labels), tuple(sizes))


def _images_under(folder: str) -> list[tuple[str, int]]:
    """(path relative to ``folder``, bytes) of every image under it, sorted by path."""
    out = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for f in filenames:
            if is_image(f):
                path = os.path.join(dirpath, f)
                out.append((os.path.relpath(path, folder), os.stat(path).st_size))
    return sorted(out)


def groups(sizes: tuple[int, ...], parallelism: int, min_bytes: int = 1 << 20,
           max_bytes: int = 64 << 20) -> list[tuple[int, int]]:
    """[start, end) file ranges of about equal bytes: ~8 per task slot so that a slow task does not
    hold the pass and progress moves, each between ``min_bytes`` and ``max_bytes`` (bytes on
    disk). Sized by bytes, not by file count: Spark's file sources count every file as at
    least 4 MB (``spark.sql.files.openCostInBytes``), which makes ~30 tiny images a task."""
    total = sum(sizes)
    target = min(max_bytes, max(min_bytes, total // max(1, 8 * parallelism)))
    out, start, acc = [], 0, 0
    for i, size in enumerate(sizes):
        acc += size
        if acc >= target:
            out.append((start, i + 1))
            start, acc = i + 1, 0
    if start < len(sizes):
        out.append((start, len(sizes)))
    return out


def header(path: str, max_pixels: int) -> tuple[int, int, int]:
    """(H, W, C) of an image from its header alone; BadInput naming the file when it is over
    ``max_pixels`` (data.max_image_pixels) or not an image."""
    with _opened(path, max_pixels) as im:
        return im.height, im.width, _CHANNELS[_mode(im)]


class _opened:
    """``Image.open`` (reads the header only) with the pixel limit checked; BadInput on failure."""

    def __init__(self, path: str, max_pixels: int):
        self.path, self.max_pixels, self.im = path, max_pixels, None

    def __enter__(self):
        from PIL import Image

        try:
            with warnings.catch_warnings():  # over Pillow's warning limit: we check our own below
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                self.im = Image.open(self.path, formats=_FORMATS)
        except Image.DecompressionBombError:
            raise BadInput(f"{self.path}: image has more than data.max_image_pixels={self.max_pixels} "
                           "pixels") from None
        except (OSError, ValueError, SyntaxError) as e:
            raise BadInput(f"{self.path}: image file does not decode ({_one_line(e)})") from None
        w, h = self.im.size
        if w * h > self.max_pixels:
            self.im.close()
            raise BadInput(f"{self.path}: image is {w}x{h} = {w * h} pixels, over "
                           f"data.max_image_pixels={self.max_pixels}")
        return self.im

    def __exit__(self, *exc):
        self.im.close()
        return False


def _mode(im) -> str:
    """The mode an image is decoded to: grey stays one channel, alpha stays, the rest is RGB."""
    if im.mode in ("1", "L", "I", "I;16", "F"):
        return "L"
    if im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info):
        return "RGBA"
    return "RGB"


def decode(path: str, shape: tuple[int, int, int], max_pixels: int) -> bytes:
    """The uint8 HWC pixels of one image of ``shape`` (H, W, C); BadInput naming the file."""
    with _opened(path, max_pixels) as im:
        got = (im.height, im.width, _CHANNELS[_mode(im)])
        if got != tuple(shape):
            raise BadInput(f"{path}: image is {'x'.join(map(str, got))}, expected "
                           f"{'x'.join(map(str, shape))} like the first image (images of unequal size)")
        mode = _mode(im)
        try:
            return (im if im.mode == mode else im.convert(mode)).tobytes()
        except (OSError, ValueError, SyntaxError) as e:
            raise BadInput(f"{path}: image file does not decode ({_one_line(e)})") from None


def decode_group(root: str, files, labels, split: int, shape: tuple[int, int, int],
                 max_pixels: int) -> pa.RecordBatch:
    """One task's images as a :data:`DECODED_SCHEMA` batch; a refused file is a row with its error."""
    images, errors = [], []
    for rel in files:
        try:
            images.append(decode(os.path.join(root, rel), shape, max_pixels))
            errors.append(None)
        except BadInput as e:
            images.append(b"")
            errors.append(str(e))
    n = len(images)
    return pa.RecordBatch.from_arrays(
        [pa.array(np.full(n, split, np.int8)), pa.array(images, pa.binary()),
         pa.array(np.asarray(labels, np.int32)), pa.array(errors, pa.string())], schema=DECODED_SCHEMA)


def channel_stats(images: np.ndarray, chunk: int = 2048) -> tuple[list[float], list[float]]:
    """Per-channel mean and (population) standard deviation of uint8 NHWC images, in [0, 1] units
    (pixel / 255), exact: from each channel's histogram of the 256 values, counted ``chunk``
    images at a time (no float or index copy of the whole set)."""
    c = images.shape[-1]
    hist = np.zeros((c, 256), np.int64)
    for start in range(0, len(images), chunk):
        x = images[start:start + chunk].reshape(-1, c)
        for ch in range(c):
            hist[ch] += np.bincount(x[:, ch], minlength=256)
    values = np.arange(256, dtype=np.float64) / 255.0
    n = np.maximum(hist.sum(axis=1), 1).astype(np.float64)
    mean = hist @ values / n
    var = (hist * np.square(values[None, :] - mean[:, None])).sum(axis=1) / n
    return [round(float(v), 6) for v in mean], [round(float(v), 6) for v in np.sqrt(var)]


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
