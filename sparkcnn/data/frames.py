"""Image columns of DataFrames, as Arrow arrays, to one ``uint8 N×H×W×C`` numpy array.

Three column kinds are accepted, decided from the Spark type:

- ``binary``: the uint8 HWC pixels of one image per row (the prepared format);
- ``floats``: ``array<float|double>`` of H·W·C values in [0, 1], scaled by 255 and rounded;
- ``struct``: Spark's image struct (``origin, height, width, nChannels, mode, data``), whose
  ``data`` is OpenCV's BGR(A) order; converted to RGB(A) so that pixels mean the same as in
  the other kinds.

Used by training (blocks packed on the executors) and by inference (the Transformer's
UDF) alike, so both see the same pixels. Nothing here imports Spark at module level.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparkcnn.errors import BadInput

KINDS = ("binary", "floats", "struct")
IMAGE_STRUCT_FIELDS = ("origin", "height", "width", "nChannels", "mode", "data")


def image_kind(dtype, name: str = "image") -> str:
    """``binary`` | ``floats`` | ``struct`` for a Spark ``DataType``; BadInput naming the column otherwise."""
    from pyspark.sql import types as T

    if isinstance(dtype, T.BinaryType):
        return "binary"
    if isinstance(dtype, T.ArrayType) and isinstance(dtype.elementType, (T.FloatType, T.DoubleType)):
        return "floats"
    if isinstance(dtype, T.StructType) and set(IMAGE_STRUCT_FIELDS) <= set(dtype.fieldNames()):
        return "struct"
    raise BadInput(f"column {name!r}: type {dtype.simpleString()} is not an image column "
                   "(binary uint8 HWC, array<float> in [0, 1], or Spark's image struct)")


def struct_shape(column, name: str) -> tuple[int, int, int] | None:
    """(H, W, C) of the first valid image of an image-struct Arrow column (None if empty)."""
    for h, w, c in zip(column.field("height").to_pylist(), column.field("width").to_pylist(),
                       column.field("nChannels").to_pylist()):
        if h is not None and h > 0:
            return int(h), int(w), int(c)
    return None


def images_from_arrow(column, shape: tuple[int, int, int] | None, name: str = "image",
                      kind: str | None = None) -> np.ndarray:
    """``uint8 (N, H, W, C)`` pixels of an Arrow image column of any :data:`KINDS`.

    ``shape`` is (H, W, C); for ``struct`` columns it may be None (taken from the
    data). Every row must have that shape: BadInput names the column (and, for
    image structs, the file) otherwise.
    """
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    kind = kind or _arrow_kind(column, name)
    if column.null_count:
        raise BadInput(f"column {name!r}: {column.null_count} null image(s)")
    n = len(column)
    if kind == "struct":
        return _from_struct(column, shape, name)
    if shape is None:
        raise BadInput(f"column {name!r}: the image shape is unknown; give data.image_shape [H, W, C]")
    h, w, c = shape
    size = h * w * c
    if kind == "binary":
        lengths = pc.binary_length(column).to_numpy(zero_copy_only=False)
        _same_size(lengths, size, name, "bytes")
        if n == 0:
            return np.empty((0, h, w, c), np.uint8)
        offsets_dtype = np.int64 if pa.types.is_large_binary(column.type) else np.int32
        bufs = column.buffers()
        offsets = np.frombuffer(bufs[1], offsets_dtype)[column.offset:column.offset + n + 1]
        data = np.frombuffer(bufs[2], np.uint8)[offsets[0]:offsets[-1]]
        return data.reshape(n, h, w, c).copy()
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    _same_size(lengths, size, name, "values")
    values = column.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    if values.size and not (np.isfinite(values).all() and values.min() >= 0.0 and values.max() <= 1.0):
        bad = values[~(np.isfinite(values) & (values >= 0) & (values <= 1))][0]
        raise BadInput(f"column {name!r}: float pixels must lie in [0, 1], found {float(bad)!r}")
    return np.rint(values * 255.0).astype(np.uint8).reshape(n, h, w, c)


def _arrow_kind(column, name: str) -> str:
    t = column.type
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return "binary"
    if (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_floating(t.value_type):
        return "floats"
    if pa.types.is_struct(t) and set(IMAGE_STRUCT_FIELDS) <= {t.field(i).name for i in range(t.num_fields)}:
        return "struct"
    raise BadInput(f"column {name!r}: Arrow type {t} is not an image column")


def _same_size(lengths: np.ndarray, size: int, name: str, unit: str) -> None:
    bad = np.flatnonzero(lengths != size)
    if bad.size:
        raise BadInput(f"column {name!r}: images of unequal size: row {int(bad[0])} has "
                       f"{int(lengths[bad[0]])} {unit}, expected {size}")


def _from_struct(column, shape, name: str) -> np.ndarray:
    heights = column.field("height").to_numpy(zero_copy_only=False)
    origins = column.field("origin")
    invalid = np.flatnonzero(heights < 1)
    if invalid.size:
        raise BadInput(f"{origins[int(invalid[0])].as_py()}: image file does not decode (column {name!r})")
    if shape is None:
        shape = struct_shape(column, name)
        if shape is None:
            return np.empty((0, 1, 1, 1), np.uint8)
    h, w, c = shape
    dims = np.stack([heights, column.field("width").to_numpy(zero_copy_only=False),
                     column.field("nChannels").to_numpy(zero_copy_only=False)], axis=1)
    bad = np.flatnonzero((dims != (h, w, c)).any(axis=1))
    if bad.size:
        i = int(bad[0])
        raise BadInput(f"{origins[i].as_py()}: image is {'x'.join(map(str, dims[i]))}, expected {h}x{w}x{c} "
                       f"(images of unequal size in column {name!r})")
    images = images_from_arrow(column.field("data"), (h, w, c), name, kind="binary")
    if c >= 3:  # OpenCV order BGR(A) -> RGB(A)
        images[..., :3] = images[..., 2::-1].copy()
    return images
