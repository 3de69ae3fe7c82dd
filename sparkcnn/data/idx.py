"""Readers for IDX files (MNIST, Fashion-MNIST), gzip-compressed or raw.

IDX layout (all integers big-endian)::

    magic   uint32   0x000008DD: two zero bytes, type code 0x08 (unsigned
                     byte), DD = number of dimensions
    dims    DD × uint32
    data    prod(dims) bytes, row-major, nothing after it

Images use magic 0x00000803 (N, rows, cols) and labels 0x00000801 (N).
A file is gzip-compressed when it starts with the gzip magic 1f 8b, whatever
its name. Truncated or trailing data is an error, not silently dropped.
"""

from __future__ import annotations

import gzip
import logging
import math
import os
import zlib

import numpy as np

from sparkcnn.data.labels import check_labels
from sparkcnn.errors import BadInput

log = logging.getLogger(__name__)

IMAGES_MAGIC = 0x00000803
LABELS_MAGIC = 0x00000801
NUM_CLASSES = 10

# Class names in label order, from the Fashion-MNIST README.
FASHION_MNIST_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)

# File name stems per split, as published (the .gz suffix is optional).
SPLIT_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}

_GZIP_MAGIC = b"\x1f\x8b"


def _read_bytes(path: str) -> bytes:
    """Whole file content, gunzipped when it starts with the gzip magic."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise BadInput(f"{path}: cannot read IDX file ({e.strerror or e})") from None
    if raw[:2] != _GZIP_MAGIC:
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as e:
        raise BadInput(f"{path}: corrupt or truncated gzip data ({' '.join(str(e).split())})") from None


def read_idx(path: str, expected_magic: int) -> np.ndarray:
    """Read one IDX file of unsigned bytes whose magic must be `expected_magic`.

    Returns a uint8 array shaped by the header dimensions.
    """
    data = _read_bytes(path)
    if len(data) < 4:
        raise BadInput(f"{path}: IDX file too short for a header ({len(data)} bytes)")
    magic = int.from_bytes(data[:4], "big")
    if magic != expected_magic:
        raise BadInput(
            f"{path}: bad IDX magic 0x{magic:08x}, expected 0x{expected_magic:08x}")
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    if len(data) < header:
        raise BadInput(f"{path}: IDX header truncated ({len(data)} of {header} bytes)")
    dims = tuple(int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    expected = header + math.prod(dims)  # Python int: no overflow
    if len(data) < expected:
        raise BadInput(
            f"{path}: IDX data truncated: {len(data)} bytes, header dims {dims} "
            f"need {expected}")
    if len(data) > expected:
        raise BadInput(
            f"{path}: {len(data) - expected} trailing bytes after IDX data "
            f"(header dims {dims} need {expected} bytes)")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


def read_idx_images(path: str) -> np.ndarray:
    """Images file (magic 0x803) → uint8 array (N, H, W, 1), pixel values 0–255."""
    images = read_idx(path, IMAGES_MAGIC)
    return images[..., np.newaxis]


def read_idx_labels(path: str, num_classes: int = NUM_CLASSES) -> np.ndarray:
    """Labels file (magic 0x801) → int32 array (N,), each in [0, num_classes)."""
    return check_labels(path, read_idx(path, LABELS_MAGIC), num_classes)


def find_split_file(source_dir: str, stem: str) -> str:
    """Path of `stem` or `stem.gz` in `source_dir`, BadInput if neither exists."""
    for name in (stem, stem + ".gz"):
        path = os.path.join(source_dir, name)
        if os.path.isfile(path):
            return path
    raise BadInput(f"{source_dir}: no {stem} or {stem}.gz found")


def read_idx_split(source_dir: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    """Read the `split` ("train" or "test") of an MNIST-style directory.

    Expects `train-images-idx3-ubyte[.gz]` + `train-labels-idx1-ubyte[.gz]`,
    or the `t10k-` pair for "test". Returns (images uint8 (N, H, W, 1),
    labels int32 (N,)).
    """
    if split not in SPLIT_FILES:
        raise BadInput(f"split must be one of {sorted(SPLIT_FILES)}, got {split!r}")
    if not os.path.isdir(source_dir):
        names = ", ".join(f"{s}[.gz]" for s in SPLIT_FILES[split])
        raise BadInput(f"{source_dir}: source directory not found (expected {names})")
    images_stem, labels_stem = SPLIT_FILES[split]
    images_path = find_split_file(source_dir, images_stem)
    labels_path = find_split_file(source_dir, labels_stem)
    images = read_idx_images(images_path)
    labels = read_idx_labels(labels_path)
    if len(images) != len(labels):
        raise BadInput(
            f"{images_path}: {len(images)} images but {labels_path} has "
            f"{len(labels)} labels")
    log.debug("read %s: %d images of %s", split, len(images), images.shape[1:])
    return images, labels
