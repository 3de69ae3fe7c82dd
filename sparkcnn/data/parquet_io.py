"""The prepared Parquet dataset, and the reader for user Parquet input.

Prepared layout, one directory per split::

    <out>/train/part-00000.parquet, part-00001.parquet, …
    <out>/test/part-00000.parquet, …

Columns: `image` binary, the uint8 HWC pixels of one image (H·W·C bytes);
`label` int32, an index into the class list. Schema metadata (strings):
`sparkcnn.height`, `sparkcnn.width`, `sparkcnn.channels` (pixels, pixels,
channels) and `sparkcnn.classes` (JSON list of class names), plus
`sparkcnn.format_version`; the train split also `sparkcnn.mean` and `sparkcnn.std`
(JSON lists, per-channel pixel statistics in [0, 1] units, read for `data.normalize`).

Columns are converted to and from numpy through their Arrow buffers (one
offsets buffer + one data buffer), never through per-row Python objects.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from sparkcnn.data.labels import check_labels
from sparkcnn.errors import BadInput

log = logging.getLogger(__name__)

FORMAT_VERSION = "1"
META_HEIGHT = "sparkcnn.height"
META_WIDTH = "sparkcnn.width"
META_CHANNELS = "sparkcnn.channels"
META_CLASSES = "sparkcnn.classes"
META_VERSION = "sparkcnn.format_version"
META_MEAN = "sparkcnn.mean"  # train split: JSON list, per-channel pixel mean in [0, 1] units
META_STD = "sparkcnn.std"    # train split: JSON list, per-channel pixel standard deviation, same units
_DIM_KEYS = {"height": META_HEIGHT, "width": META_WIDTH, "channels": META_CHANNELS}
_MAX_INT32_OFFSET = 2**31 - 1
SIDECAR = "sparkcnn.json"  # beside the splits: their metadata for readers that reach them only through Spark


@dataclasses.dataclass(frozen=True)
class DatasetMeta:
    """Shape and classes of one prepared split."""

    height: int  # pixels
    width: int  # pixels
    channels: int  # 1 (grey) or 3 (RGB)
    classes: tuple[str, ...]  # class names, indexed by label
    num_rows: int  # images in the split
    mean: tuple[float, ...] | None = None  # train split: per-channel pixel mean in [0, 1] units (META_MEAN)
    std: tuple[float, ...] | None = None   # train split: per-channel pixel standard deviation (META_STD)

    @property
    def image_bytes(self) -> int:
        """Bytes of one HWC uint8 image."""
        return self.height * self.width * self.channels


def write_split(out_dir: str, images: np.ndarray, labels: np.ndarray,
                classes, rows_per_file: int = 10000, extra: dict | None = None) -> list[str]:
    """Write uint8 images (N, H, W, C) and int labels (N,) as `out_dir/part-NNNNN.parquet`.

    Labels must lie in [0, len(classes)); `extra`: more schema metadata (strings), such as
    `META_MEAN`. Returns the paths written.
    """
    if images.dtype != np.uint8 or images.ndim != 4:
        raise BadInput(f"images must be uint8 (N, H, W, C), got {images.dtype} {images.shape}")
    if labels.shape != (len(images),):
        raise BadInput(f"labels shape {labels.shape} does not match {len(images)} images")
    if rows_per_file < 1:
        raise BadInput(f"rows_per_file must be >= 1, got {rows_per_file}")
    classes = [str(c) for c in classes]
    check_labels(out_dir, labels, len(classes))
    _, h, w, c = images.shape
    row_bytes = h * w * c
    metadata = {META_HEIGHT: str(h), META_WIDTH: str(w), META_CHANNELS: str(c),
                META_CLASSES: json.dumps(classes), META_VERSION: FORMAT_VERSION, **(extra or {})}
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    # At least one file, so an empty split still carries its schema and metadata.
    for part, start in enumerate(range(0, max(len(images), 1), rows_per_file)):
        chunk = np.ascontiguousarray(images[start:start + rows_per_file])
        n = len(chunk)
        large = n * row_bytes > _MAX_INT32_OFFSET
        offsets = np.arange(n + 1, dtype=np.int64 if large else np.int32) * row_bytes
        image_col = pa.Array.from_buffers(
            pa.large_binary() if large else pa.binary(), n,
            [None, pa.py_buffer(offsets), pa.py_buffer(chunk)])
        label_col = pa.array(labels[start:start + n].astype(np.int32, copy=False))
        table = pa.table({"image": image_col, "label": label_col}).replace_schema_metadata(metadata)
        path = os.path.join(out_dir, f"part-{part:05d}.parquet")
        pq.write_table(table, path)
        paths.append(path)
    log.debug("wrote %d rows to %d files in %s", len(images), len(paths), out_dir)
    return paths


def write_sidecar(out: str, splits: dict, stats: dict | None = None) -> None:
    """``<out>/sparkcnn.json``: each split's shape, classes and rows, as in its schema metadata;
    ``stats``: more keys per split (the train split's ``mean`` and ``std``).

    Spark (hence a reader of a URI) does not expose Parquet footers' key-value
    metadata, and skips files named ``_*`` even when asked for them by name; a
    file beside the split directories is read as text without touching them.
    """
    doc = {"format_version": FORMAT_VERSION, "splits": {}}
    for split, (images, classes) in splits.items():
        _, h, w, c = images.shape
        doc["splits"][split] = {"height": h, "width": w, "channels": c, "classes": [str(x) for x in classes],
                                "rows": int(len(images)), **(stats or {}).get(split, {})}
    with open(os.path.join(out, SIDECAR), "w", encoding="utf-8") as fh:
        json.dump(doc, fh)


def parquet_files(path: str) -> list[str]:
    """`path` itself if a file, else the `*.parquet` files directly in it, sorted."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise BadInput(f"{path}: no such Parquet file or directory")
    files = sorted(os.path.join(path, n) for n in os.listdir(path)
                   if n.endswith(".parquet") and not n.startswith((".", "_")))
    if not files:
        raise BadInput(f"{path}: no *.parquet files found")
    return files


def one_line(e: BaseException) -> str:
    """An exception's text on one line (BadInput messages are one line)."""
    return " ".join(str(e).split())


def _schema(path: str) -> pa.Schema:
    try:
        return pq.read_schema(path)
    except (OSError, pa.ArrowException) as e:
        raise BadInput(f"{path}: not a readable Parquet file ({one_line(e)})") from None


def _meta_dims(path: str, schema: pa.Schema) -> dict:
    """height/width/channels/classes found in the schema metadata (absent keys omitted)."""
    raw = {k.decode(): v.decode() for k, v in (schema.metadata or {}).items()}
    found = {}
    for name, key in _DIM_KEYS.items():
        if key in raw:
            try:
                found[name] = int(raw[key])
            except ValueError:
                raise BadInput(f"{path}: metadata {key} must be an integer, got {raw[key]!r}") from None
            if found[name] < 1:
                raise BadInput(f"{path}: metadata {key} must be >= 1, got {found[name]}")
    if META_CLASSES in raw:
        try:
            classes = json.loads(raw[META_CLASSES])
        except ValueError:
            classes = None
        if not isinstance(classes, list) or not classes or \
                not all(isinstance(c, str) for c in classes):
            raise BadInput(f"{path}: metadata {META_CLASSES} must be a JSON list of names")
        found["classes"] = tuple(classes)
    for name, key in (("mean", META_MEAN), ("std", META_STD)):
        if key in raw:
            found[name] = _meta_floats(path, key, raw[key], found.get("channels"))
    return found


def _meta_floats(path: str, key: str, text: str, channels: int | None) -> tuple[float, ...]:
    """A per-channel statistic (``META_MEAN``, ``META_STD``): a JSON list of one number per channel."""
    try:
        values = json.loads(text)
    except ValueError:
        values = None
    if not isinstance(values, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                               for v in values) or \
            (channels is not None and len(values) != channels):
        raise BadInput(f"{path}: metadata {key} must be a JSON list of one number per channel")
    return tuple(float(v) for v in values)


def read_meta(split_dir: str) -> DatasetMeta:
    """Shape, classes and row count of a prepared split directory."""
    files = parquet_files(split_dir)
    first = None
    num_rows = 0
    for path in files:
        meta = _meta_dims(path, _schema(path))
        missing = [k for k in (*_DIM_KEYS, "classes") if k not in meta]
        if missing:
            raise BadInput(f"{path}: not a prepared sparkcnn split (metadata lacks {', '.join(missing)})")
        if first is None:
            first = meta
        elif meta != first:
            raise BadInput(f"{path}: metadata differs from {files[0]}")
        num_rows += pq.read_metadata(path).num_rows
    return DatasetMeta(first["height"], first["width"], first["channels"], first["classes"], num_rows,
                       first.get("mean"), first.get("std"))


def image_column_to_numpy(column: pa.ChunkedArray, row_bytes: int, path: str) -> np.ndarray:
    """Column of binary or list<uint8> images → uint8 (N, row_bytes), via buffers.

    Every value must be non-null and exactly `row_bytes` long; BadInput names
    the first row that is not.
    """
    out, base = [], 0
    for chunk in column.chunks:
        n = len(chunk)
        if chunk.null_count:
            row = int(np.flatnonzero(chunk.is_null().to_numpy(zero_copy_only=False))[0])
            raise BadInput(f"{path}: row {base + row}: column 'image' is null")
        offsets, data = _offsets_and_data(chunk, path)
        lengths = np.diff(offsets)
        bad = np.flatnonzero(lengths != row_bytes)
        if bad.size:
            row = int(bad[0])
            raise BadInput(f"{path}: row {base + row}: column 'image' has {int(lengths[row])} "
                           f"bytes, expected {row_bytes} (height × width × channels)")
        out.append(data[offsets[0]:offsets[0] + n * row_bytes].reshape(n, row_bytes))
        base += n
    if not out:
        return np.empty((0, row_bytes), np.uint8)
    return np.concatenate(out)


def _offsets_and_data(chunk: pa.Array, path: str) -> tuple[np.ndarray, np.ndarray]:
    """(value offsets (n+1,), uint8 data) of one binary-like or list<uint8> chunk."""
    t, n = chunk.type, len(chunk)
    if pa.types.is_fixed_size_binary(t):
        data = _u8(chunk.buffers()[1])[chunk.offset * t.byte_width:]
        return np.arange(n + 1, dtype=np.int64) * t.byte_width, data
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        bufs = chunk.buffers()
        dtype = np.int64 if pa.types.is_large_binary(t) else np.int32
        offsets = np.frombuffer(bufs[1], dtype)[chunk.offset:chunk.offset + n + 1]
        return offsets.astype(np.int64), _u8(bufs[2])
    if pa.types.is_fixed_size_list(t):
        values = chunk.flatten()
        return np.arange(n + 1, dtype=np.int64) * t.list_size, _values_u8(values, path)
    # list / large_list: offsets index into the unsliced child array.
    offsets = chunk.offsets.to_numpy().astype(np.int64)
    return offsets, _values_u8(chunk.values, path)


def _u8(buf) -> np.ndarray:
    return np.frombuffer(buf, np.uint8) if buf is not None else np.empty(0, np.uint8)


def _values_u8(values: pa.Array, path: str) -> np.ndarray:
    if values.null_count:
        raise BadInput(f"{path}: column 'image' has null elements inside a list")
    return _u8(values.buffers()[1])[values.offset:values.offset + len(values)]


def read_split_numpy(split_dir: str) -> tuple[np.ndarray, np.ndarray]:
    """Prepared split → (images uint8 (N, H, W, C), labels int32 (N,))."""
    meta = read_meta(split_dir)
    images, labels = [], []
    for path in parquet_files(split_dir):
        img, lab = _read_columns(path, meta.image_bytes)
        check_labels(path, lab, len(meta.classes))
        images.append(img)
        labels.append(lab.astype(np.int32, copy=False))
    return (np.concatenate(images).reshape(-1, meta.height, meta.width, meta.channels),
            np.concatenate(labels))


def check_columns(path: str, schema: pa.Schema) -> None:
    """BadInput unless `image` is binary or list<uint8> and `label` an integer."""
    for name in ("image", "label"):
        if name not in schema.names:
            raise BadInput(f"{path}: missing column '{name}' (columns: {', '.join(schema.names)})")
    t = schema.field("image").type
    binary = pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t)
    listish = (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t))
    if not (binary or (listish and pa.types.is_uint8(t.value_type))):
        raise BadInput(f"{path}: column 'image' has type {t}, expected binary or list<uint8>")
    t = schema.field("label").type
    if not pa.types.is_integer(t):
        raise BadInput(f"{path}: column 'label' has type {t}, expected an integer type")


def _read_columns(path: str, row_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """One Parquet file → (uint8 (N, row_bytes), int64 labels (N,)), validated."""
    check_columns(path, _schema(path))
    try:
        table = pq.read_table(path, columns=["image", "label"])
    except (OSError, pa.ArrowException) as e:
        raise BadInput(f"{path}: cannot read Parquet data ({one_line(e)})") from None
    label = table.column("label")
    if label.null_count:
        row = int(np.flatnonzero(label.is_null().to_numpy())[0])
        raise BadInput(f"{path}: row {row}: column 'label' is null")
    images = image_column_to_numpy(table.column("image"), row_bytes, path)
    return images, label.to_numpy().astype(np.int64, copy=False)


def read_parquet_input(source: str, *, height: int | None = None, width: int | None = None,
                       channels: int | None = None
                       ) -> tuple[np.ndarray, np.ndarray, tuple[str, ...] | None]:
    """Read a user Parquet file, or every `*.parquet` in a directory.

    Columns: `image` (binary of H·W·C uint8 HWC bytes, or list<uint8>) and
    `label` (any integer type). H, W, C come from the arguments or from the
    `sparkcnn.*` schema metadata; where both are given they must agree.
    Returns (images uint8 (N, H, W, C), labels int64 (N,), class names from
    the metadata or None).
    """
    files = parquet_files(source)
    given = {"height": height, "width": width, "channels": channels}
    dims, classes = {}, None
    for path in files:
        schema = _schema(path)
        check_columns(path, schema)
        meta = _meta_dims(path, schema)
        for name, value in given.items():
            found = meta.get(name)
            if value is not None and found is not None and found != value:
                raise BadInput(f"{path}: metadata {_DIM_KEYS[name]}={found} contradicts "
                               f"{name}={value}")
            if found is not None and dims.setdefault(name, found) != found:
                raise BadInput(f"{path}: metadata {_DIM_KEYS[name]}={found} differs from "
                               f"{dims[name]} in {files[0]}")
        if "classes" in meta and classes not in (None, meta["classes"]):
            raise BadInput(f"{path}: metadata {META_CLASSES} differs from {files[0]}")
        classes = meta.get("classes", classes)
    for name, value in given.items():
        if value is not None:
            if value < 1:
                raise BadInput(f"{name} must be >= 1, got {value}")
            dims[name] = value
    missing = [n for n in given if n not in dims]
    if missing:
        raise BadInput(f"{source}: image {'/'.join(missing)} unknown: pass them as options or "
                       f"set schema metadata {', '.join(_DIM_KEYS[n] for n in missing)}")
    images, labels = [], []
    for path in files:
        img, lab = _read_columns(path, dims["height"] * dims["width"] * dims["channels"])
        images.append(img)
        labels.append(lab)
    images = np.concatenate(images).reshape(-1, dims["height"], dims["width"], dims["channels"])
    return images, np.concatenate(labels), classes
