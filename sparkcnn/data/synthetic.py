"""Writers for the real on-disk formats, and a tiny learnable fake dataset.

Tests and demos use these to produce files byte-compatible with the published
datasets, so the readers are exercised on the exact formats:

- `write_idx`: IDX (MNIST/Fashion-MNIST), raw or gzip;
- `write_cifar_bin`: CIFAR-10 binary batches (label byte + R, G, B planes);
- `write_cifar_py`: CIFAR-10 python batches, a protocol-2 pickle laid out like
  the original Python 2 files (byte-string keys, `numpy.core.multiarray`
  reconstructor);
- `make_fake_fashion`: a small Fashion-MNIST-shaped dataset in IDX .gz whose
  classes are separable (a fixed 28×28 pattern per class plus noise).
"""

from __future__ import annotations

import gzip
import io
import os
import pickle
import struct

import numpy as np

from sparkcnn.data.idx import SPLIT_FILES

_RECONSTRUCT = np.zeros(1).__reduce__()[0]


def write_idx(path: str, images_or_labels: np.ndarray, gz: bool = False) -> str:
    """Write a uint8 array as IDX: labels (N,) get magic 0x801, images
    (N, H, W) or (N, H, W, 1) get 0x803. Values must be in 0–255."""
    arr = np.asarray(images_or_labels)
    if arr.ndim == 4 and arr.shape[-1] == 1:
        arr = arr[..., 0]
    if arr.ndim not in (1, 3):
        raise ValueError(f"expected labels (N,) or images (N, H, W[, 1]), got {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() > 255):
        raise ValueError("IDX unsigned-byte values must be in 0..255")
    header = struct.pack(">I", 0x0800 | arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape)
    payload = header + np.ascontiguousarray(arr, dtype=np.uint8).tobytes()
    if gz:
        payload = gzip.compress(payload, mtime=0)  # mtime 0: same bytes every run
    with open(path, "wb") as f:
        f.write(payload)
    return path


def _hwc_to_chw_rows(images_hwc: np.ndarray) -> np.ndarray:
    """uint8 (N, 32, 32, 3) → (N, 3072) rows of R, G, B planes."""
    images = np.asarray(images_hwc, dtype=np.uint8)
    if images.ndim != 4 or images.shape[1:] != (32, 32, 3):
        raise ValueError(f"CIFAR-10 images must be (N, 32, 32, 3), got {images.shape}")
    return np.ascontiguousarray(images.transpose(0, 3, 1, 2)).reshape(len(images), 3072)


def write_cifar_bin(path: str, images_hwc: np.ndarray, labels) -> str:
    """Write a CIFAR-10 binary batch: per image 1 label byte + 3072 pixel bytes."""
    rows = _hwc_to_chw_rows(images_hwc)
    labels = np.asarray(labels, dtype=np.uint8).reshape(-1, 1)
    if len(labels) != len(rows):
        raise ValueError(f"{len(rows)} images but {len(labels)} labels")
    with open(path, "wb") as f:
        f.write(np.concatenate([labels, rows], axis=1).tobytes())
    return path


class _Py2Pickler(pickle._Pickler):
    """Protocol-2 pickler writing bytes and str as Python 2 `str` (BINSTRING),
    and the array reconstructor under its numpy 1.x name, as the original
    CIFAR-10 python files do."""

    dispatch = dict(pickle._Pickler.dispatch)

    def save_py2_str(self, obj):
        data = obj.encode("latin1") if isinstance(obj, str) else obj
        if len(data) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(data)]) + data)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(data)) + data)
        self.memoize(obj)

    dispatch[bytes] = save_py2_str
    dispatch[str] = save_py2_str

    def save_global(self, obj, name=None):
        if obj is _RECONSTRUCT:
            self.write(pickle.GLOBAL + b"numpy.core.multiarray\n_reconstruct\n")
            self.memoize(obj)
        else:
            super().save_global(obj, name)


def write_cifar_py(path: str, images_hwc: np.ndarray, labels, *, py2: bool = True,
                   batch_label: str = "training batch 1 of 5") -> str:
    """Write a CIFAR-10 python batch: a pickled dict with b"batch_label",
    b"labels" (list of int), b"data" (uint8 N×3072, R, G, B planes) and
    b"filenames". `py2=False` writes a plain Python 3 protocol-2 pickle."""
    rows = _hwc_to_chw_rows(images_hwc)
    labels = [int(x) for x in labels]
    if len(labels) != len(rows):
        raise ValueError(f"{len(rows)} images but {len(labels)} labels")
    batch = {
        b"batch_label": batch_label.encode(),
        b"labels": labels,
        b"data": rows,
        b"filenames": [f"image_{i:05d}.png".encode() for i in range(len(rows))],
    }
    buf = io.BytesIO()
    if py2:
        _Py2Pickler(buf, protocol=2).dump(batch)
    else:
        pickle.dump(batch, buf, protocol=2)
    with open(path, "wb") as f:
        f.write(buf.getvalue())
    return path


def class_patterns(num_classes: int = 10, side: int = 28) -> np.ndarray:
    """Fixed per-class binary patterns (num_classes, side, side), 7×7 blocks of 4×4 px."""
    coarse = np.random.default_rng(20240601).random((num_classes, 7, 7)) > 0.5
    scale = -(-side // 7)
    return np.kron(coarse, np.ones((scale, scale), dtype=bool))[:, :side, :side]


def fake_images(labels: np.ndarray, rng: np.random.Generator, side: int = 28) -> np.ndarray:
    """uint8 (N, side, side): the class pattern at intensity 150 + uniform noise 0–105."""
    patterns = class_patterns(10, side)  # labels must be in [0, 10)
    noise = rng.integers(0, 106, size=(len(labels), side, side))
    return (patterns[labels] * 150 + noise).astype(np.uint8)


def make_fake_fashion(dir: str, n_train: int, n_test: int, seed: int = 0) -> str:
    """Write a learnable Fashion-MNIST look-alike (28×28 grey, 10 classes) as
    the four IDX .gz files into `dir` (created if needed). Returns `dir`."""
    os.makedirs(dir, exist_ok=True)
    rng = np.random.default_rng(seed)
    for split, n in (("train", n_train), ("test", n_test)):
        labels = (np.arange(n) % 10).astype(np.uint8)
        rng.shuffle(labels)
        images_stem, labels_stem = SPLIT_FILES[split]
        write_idx(os.path.join(dir, images_stem + ".gz"), fake_images(labels, rng), gz=True)
        write_idx(os.path.join(dir, labels_stem + ".gz"), labels, gz=True)
    return dir
