"""Readers for CIFAR-10 in its two published layouts.

Binary version (`cifar-10-batches-bin/`): files `data_batch_1.bin` …
`data_batch_5.bin` and `test_batch.bin`, each a run of 3073-byte records::

    label   1 byte, 0–9
    pixels  3072 bytes: the R, G, B planes of a 32×32 image, each row-major

Class names come from `batches.meta.txt` (one per line) when present.

Python version (`cifar-10-batches-py/`): files `data_batch_1` … `data_batch_5`
and `test_batch`, each a pickled dict with b"data" (uint8 N×3072, same CHW
order) and b"labels" (list of N ints); class names from the b"label_names" of
`batches.meta`. Pickles are loaded by `RestrictedUnpickler`, which resolves
only the globals a numpy array needs, so a crafted file cannot run code.

All readers return images as uint8 (N, 32, 32, 3) HWC and labels as int32 (N,).
"""

from __future__ import annotations

import codecs
import logging
import os
import pickle
import re

import numpy as np

from sparkcnn.data.labels import check_labels
from sparkcnn.errors import BadInput

log = logging.getLogger(__name__)

CIFAR10_CLASSES = (
    "airplane", "automobile", "bird", "cat", "deer",
    "dog", "frog", "horse", "ship", "truck",
)
SIDE, CHANNELS = 32, 3
IMAGE_BYTES = SIDE * SIDE * CHANNELS  # 3072
RECORD_BYTES = 1 + IMAGE_BYTES  # 3073

# The archives unpack into these folders; accept the parent directory too.
_SUBDIRS = {"bin": "cifar-10-batches-bin", "py": "cifar-10-batches-py"}
_SUFFIX = {"bin": ".bin", "py": ""}


def _numpy_globals() -> dict[tuple[str, str], object]:
    """The only globals a pickled numpy uint8/int array refers to, by name.

    Resolved from the objects themselves (not by importing the pickled module
    name), so old `numpy.core` names map to numpy 2's `numpy._core` without
    importing anything.
    """
    reconstruct = np.zeros(1).__reduce__()[0]
    frombuffer = np.zeros(1).__reduce_ex__(5)[0]
    allowed = {("_codecs", "encode"): codecs.encode}
    for pkg in ("numpy.core", "numpy._core"):
        allowed[(f"{pkg}.multiarray", "_reconstruct")] = reconstruct
        allowed[(f"{pkg}.numeric", "_frombuffer")] = frombuffer
    allowed[("numpy", "ndarray")] = np.ndarray
    allowed[("numpy", "dtype")] = np.dtype
    return allowed


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickler for dicts, lists, str, bytes, ints and numpy arrays only.

    Any other global (a class or function the pickle wants to call) is refused
    with BadInput before it is looked up, so it never runs.
    """

    _ALLOWED = _numpy_globals()

    def __init__(self, file, path: str):
        # encoding="bytes": the original files were written by Python 2, whose
        # str objects (dict keys, array data) must load as bytes.
        super().__init__(file, encoding="bytes")
        self._path = path

    def find_class(self, module: str, name: str):
        try:
            return self._ALLOWED[(module, name)]
        except KeyError:
            raise BadInput(
                f"{self._path}: refused to unpickle global {module}.{name} "
                "(only numpy arrays, dicts, lists, str, bytes and ints are allowed)"
            ) from None

    def persistent_load(self, pid):
        raise BadInput(f"{self._path}: refused to unpickle a persistent id")


def load_pickle(path: str) -> object:
    """Load `path` through RestrictedUnpickler; any decoding failure is BadInput."""
    try:
        with open(path, "rb") as f:
            return RestrictedUnpickler(f, path).load()
    except BadInput:
        raise
    except OSError as e:
        raise BadInput(f"{path}: cannot read ({e.strerror or e})") from None
    except Exception as e:  # noqa: BLE001 - a corrupt pickle raises many kinds
        why = " ".join(str(e).split())
        raise BadInput(f"{path}: not a valid pickle ({type(e).__name__}: {why})") from None


def chw_to_hwc(flat: np.ndarray) -> np.ndarray:
    """uint8 (N, 3072) rows of R, G, B planes → uint8 (N, 32, 32, 3)."""
    return np.ascontiguousarray(flat.reshape(-1, CHANNELS, SIDE, SIDE).transpose(0, 2, 3, 1))


def read_cifar_bin_file(path: str, num_classes: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """One binary batch file → (images uint8 (N, 32, 32, 3), labels int32 (N,))."""
    try:
        raw = np.fromfile(path, dtype=np.uint8)
    except OSError as e:
        raise BadInput(f"{path}: cannot read ({e.strerror or e})") from None
    if raw.size % RECORD_BYTES:
        raise BadInput(
            f"{path}: length {raw.size} bytes is not a multiple of the "
            f"{RECORD_BYTES}-byte CIFAR-10 record")
    records = raw.reshape(-1, RECORD_BYTES)
    labels = check_labels(path, records[:, 0], num_classes)
    return chw_to_hwc(records[:, 1:]), labels


def read_cifar_py_file(path: str, num_classes: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """One pickled python batch → (images uint8 (N, 32, 32, 3), labels int32 (N,))."""
    batch = load_pickle(path)
    if not isinstance(batch, dict):
        raise BadInput(f"{path}: expected a pickled dict, got {type(batch).__name__}")
    data = batch.get(b"data", batch.get("data"))
    labels = batch.get(b"labels", batch.get("labels"))
    if data is None or labels is None:
        keys = sorted(repr(k) for k in batch)
        raise BadInput(f"{path}: missing key b'data' or b'labels' (keys: {', '.join(keys)})")
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 \
            or data.shape[1] != IMAGE_BYTES:
        desc = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise BadInput(f"{path}: b'data' must be a uint8 N×{IMAGE_BYTES} array, got {desc}")
    if not isinstance(labels, (list, np.ndarray)) or \
            not all(isinstance(x, (int, np.integer)) for x in labels):
        raise BadInput(f"{path}: b'labels' must be a list of ints")
    labels = np.asarray(labels, dtype=np.int64).reshape(-1)
    if len(labels) != len(data):
        raise BadInput(f"{path}: {len(data)} images but {len(labels)} labels")
    return chw_to_hwc(data), check_labels(path, labels, num_classes)


def _batch_dir(source_dir: str, kind: str) -> str:
    """`source_dir`, or its `cifar-10-batches-<kind>` subfolder when that exists."""
    if not os.path.isdir(source_dir):
        raise BadInput(
            f"{source_dir}: source directory not found (expected data_batch_1{_SUFFIX[kind]}"
            f" … and test_batch{_SUFFIX[kind]})")
    nested = os.path.join(source_dir, _SUBDIRS[kind])
    return nested if os.path.isdir(nested) else source_dir


def split_files(source_dir: str, kind: str, split: str) -> list[str]:
    """Batch files of `split` in order; train batches must be numbered 1..k."""
    suffix = _SUFFIX[kind]
    if split == "test":
        path = os.path.join(source_dir, "test_batch" + suffix)
        if not os.path.isfile(path):
            raise BadInput(f"{source_dir}: no test_batch{suffix} found")
        return [path]
    pattern = re.compile(rf"data_batch_(\d+){re.escape(suffix)}$")
    numbers = sorted(int(m.group(1)) for name in os.listdir(source_dir)
                     if (m := pattern.match(name)))
    if not numbers:
        raise BadInput(f"{source_dir}: no data_batch_1{suffix} … data_batch_5{suffix} found")
    missing = sorted(set(range(1, numbers[-1] + 1)) - set(numbers))
    if missing:
        raise BadInput(f"{source_dir}: data_batch_{missing[0]}{suffix} is missing "
                       f"(found batches {numbers})")
    return [os.path.join(source_dir, f"data_batch_{n}{suffix}") for n in numbers]


def read_classes(source_dir: str, kind: str) -> tuple[str, ...]:
    """Class names from the batch metadata file, else the standard 10 names."""
    if kind == "bin":
        path = os.path.join(source_dir, "batches.meta.txt")
        if not os.path.isfile(path):
            return CIFAR10_CLASSES
        with open(path, encoding="utf-8") as f:
            names = tuple(line.strip() for line in f if line.strip())
    else:
        path = os.path.join(source_dir, "batches.meta")
        if not os.path.isfile(path):
            return CIFAR10_CLASSES
        meta = load_pickle(path)
        raw = meta.get(b"label_names", meta.get("label_names")) if isinstance(meta, dict) else None
        if not isinstance(raw, list) or not all(isinstance(n, (bytes, str)) for n in raw):
            raise BadInput(f"{path}: b'label_names' must be a list of strings")
        names = tuple(n.decode("utf-8") if isinstance(n, bytes) else n for n in raw)
    if not names:
        raise BadInput(f"{path}: no class names")
    return names


def read_cifar_split(source_dir: str, kind: str, split: str
                     ) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """Read `split` ("train"/"test") of a CIFAR-10 directory of `kind` "bin" or "py".

    Returns (images uint8 (N, 32, 32, 3), labels int32 (N,), class names).
    """
    if kind not in _SUBDIRS:
        raise BadInput(f"CIFAR kind must be 'bin' or 'py', got {kind!r}")
    if split not in ("train", "test"):
        raise BadInput(f"split must be 'train' or 'test', got {split!r}")
    folder = _batch_dir(source_dir, kind)
    classes = read_classes(folder, kind)
    reader = read_cifar_bin_file if kind == "bin" else read_cifar_py_file
    parts = [reader(p, len(classes)) for p in split_files(folder, kind, split)]
    images = np.concatenate([p[0] for p in parts])
    labels = np.concatenate([p[1] for p in parts])
    log.debug("read CIFAR-10 %s %s: %d images from %d files", kind, split, len(images), len(parts))
    return images, labels, classes
