"""What users train on, resolved to a :class:`Frame`: a DataFrame of images and labels.

Accepted inputs (``data=`` of :func:`sparkcnn.fit`, or ``data.path``):

- a prepared dataset (``sparkcnn prepare``): a path or URI holding ``train/`` and
  ``test/`` Parquet splits; shape and classes from its metadata;
- a Parquet dataset, a table name or a DataFrame with an image column and a label
  column (``data.image_col``, ``data.label_col``); the image column is binary uint8
  HWC, ``array<float>`` in [0, 1] or Spark's image struct
  (:mod:`sparkcnn.data.frames`); shape from ``data.image_shape`` or the column's
  metadata (``{"sparkcnn": {"shape": [H, W, C]}}``), classes from ``data.classes``,
  the label column's ML attribute, or ``max(label) + 1``;
- a folder of JPEG/PNG images in one sub-folder per class (or a folder holding such
  ``train/`` and ``test/`` folders), decoded once by byte-sized Spark tasks and cached
  until the blocks are placed (:mod:`sparkcnn.data.imagefolder`); classes are the
  sub-folder names, sorted; an image over ``data.max_image_pixels`` is refused from its header.

Everything is validated by one aggregate query in Spark before anything is
written: a missing or mistyped column, images of unequal size, labels outside
``[0, classes)``, an empty input, a missing table and an image file that does
not decode each raise :class:`BadInput` naming the column, value or file.
Spark reads the data; the driver never needs a path the executors share.
"""

from __future__ import annotations

import dataclasses
import json
import os

from sparkcnn.data.frames import image_kind
from sparkcnn.data.images import IMAGE_SUFFIXES, split_roots
from sparkcnn.data.parquet_io import SIDECAR
from sparkcnn.errors import BadInput

FORMATS = ("auto", "prepared", "parquet", "table", "images")


@dataclasses.dataclass(frozen=True)
class Frame:
    """Images and labels to train or evaluate on, checked."""

    df: object                     # DataFrame with columns ``image`` and ``label`` (int)
    kind: str                      # image column kind: binary | floats | struct
    shape: tuple[int, int, int]    # (H, W, C)
    classes: tuple[str, ...]       # class names, indexed by label
    num_rows: int
    origin: str                    # what the user gave, for messages and the summary
    cache: object = None           # a DataFrame this frame persisted (an image folder's decoded rows),
                                   # to unpersist once its blocks are placed (:func:`release`)
    stats: tuple | None = None     # (mean, std), per-channel pixel statistics in [0, 1] units: a prepared
                                   # dataset's train split's (data.normalize); None for other inputs
    local_dir: str | None = None   # a prepared split's directory on the driver's file system (None: other
                                   # inputs), which executors of a local master read directly


def is_dataframe(x) -> bool:
    """A pyspark DataFrame, classic or Connect (checked without importing either module eagerly)."""
    return type(x).__name__ == "DataFrame" and type(x).__module__.startswith("pyspark.sql")


def training_frames(spark, dcfg, data=None, test_data=None) -> tuple[Frame, Frame | None]:
    """(train, test or None) for ``data`` (default ``dcfg.path``) and ``test_data`` (default
    ``dcfg.test_path``, else a prepared dataset's test split)."""
    data = dcfg.path if data is None else data
    test_data = (dcfg.test_path or None) if test_data is None else test_data
    roots = None if is_dataframe(data) else _image_splits(spark, dcfg, data)
    if roots is not None:  # an image folder laid out in train/ (and test/)
        data = roots["train"]
        test_data = roots.get("test") if test_data is None else test_data
    if not is_dataframe(data) and _format(spark, dcfg, data) == "prepared":
        train = _prepared(spark, data, "train")
        test = (_prepared(spark, data, "test") if test_data is None
                else frame(spark, dcfg, test_data, "test_data"))
        return train, _same_shape(train, test)
    train = frame(spark, dcfg, data, "data")
    test = (frame(spark, dcfg, test_data, "test_data", classes=train.classes)
            if test_data is not None else None)
    return train, _same_shape(train, test)


def local_prepared(dcfg) -> tuple[Frame, Frame] | None:
    """``dcfg.path`` as a prepared dataset on a local path, read without Spark (the frames' ``df``
    is the split directory until :func:`attach`); None when it names something else.

    So the common case, ``sparkcnn train`` on a prepared dataset, rejects a bad path
    before a Spark session starts.
    """
    path = dcfg.path
    if dcfg.test_path or dcfg.format not in ("auto", "prepared") or is_uri(path):
        return None
    if not os.path.exists(path):
        if os.sep in path or dcfg.format == "prepared":  # meant as a path, not a table name
            raise BadInput(f"data.path {path!r}: no prepared split at {os.path.join(path, 'train')} "
                           "(run 'sparkcnn prepare' first)")
        return None
    if not os.path.isdir(os.path.join(path, "train")) or has_images(os.path.join(path, "train")):
        return None
    return _prepared(None, path, "train"), _prepared(None, path, "test")


def release(fr: Frame | None) -> None:
    """Unpersist what ``fr`` cached for itself (once its blocks are placed); no-op otherwise."""
    if fr is not None and fr.cache is not None:
        fr.cache.unpersist()


def attach(spark, fr: Frame | None) -> Frame | None:
    """A frame of :func:`local_prepared` with its split read as a DataFrame (no-op for others)."""
    if fr is None or spark is None or not isinstance(fr.df, str):
        return fr
    return dataclasses.replace(fr, df=spark.read.parquet(fr.df).select("image", "label"))


def frame(spark, dcfg, src, role: str = "data", classes: tuple[str, ...] | None = None) -> Frame:
    """One input of any accepted kind as a checked :class:`Frame`."""
    if is_dataframe(src):
        return _checked(src, dcfg, f"{role} DataFrame", classes)
    if not isinstance(src, str) or not src:
        raise BadInput(f"{role}: expected a DataFrame, a path, a URI or a table name, got {src!r}")
    fmt = _format(spark, dcfg, src)
    if fmt == "prepared":
        return _prepared(spark, src, "test" if role == "test_data" else "train")
    if fmt == "table":
        return _checked(spark.table(src), dcfg, f"table {src!r}", classes)
    if fmt == "images":
        return _images(spark, src, dcfg, classes)
    return _checked(_read_parquet(spark, src), dcfg, src, classes)


# -- formats ---------------------------------------------------------------------------------

def is_uri(s: str) -> bool:
    return "://" in s or s.startswith(("file:", "hdfs:", "s3a:", "gs:", "abfs:", "dbfs:"))


def _format(spark, dcfg, src: str) -> str:
    if dcfg.format != "auto":
        return dcfg.format
    if not is_uri(src) and not os.path.exists(src):
        if spark is not None and table_exists(spark, src):
            return "table"
        raise BadInput(f"data {src!r}: no such path, and no table of that name")
    if not is_uri(src):
        if os.path.isdir(os.path.join(src, "train")):
            return "images" if has_images(os.path.join(src, "train")) else "prepared"
        if os.path.isdir(src) and (has_images(src) or not _has_parquet(src)):
            return "images"  # a folder without Parquet files is meant as images: scan names what is missing
        return "parquet"
    try:  # a URI: prepared when it has our metadata
        _sidecar(spark, src, "train")
        return "prepared"
    except BadInput:
        return "parquet"


def table_exists(spark, name: str) -> bool:
    try:
        return bool(spark.catalog.tableExists(name))
    except Exception:  # noqa: BLE001 - an unparsable name is no table
        return False


def _image_splits(spark, dcfg, src) -> dict[str, str] | None:
    """``train``/``test`` folders of an image folder laid out in splits, else None."""
    if not isinstance(src, str) or is_uri(src) or not os.path.isdir(os.path.join(src, "train")):
        return None
    return split_roots(src) if _format(spark, dcfg, src) == "images" else None


def _has_parquet(root: str) -> bool:
    for _, _, files in os.walk(root):
        if any(f.endswith(".parquet") for f in files):
            return True
    return False


def has_images(root: str) -> bool:
    for _, _, files in os.walk(root):
        if any(f.lower().endswith(IMAGE_SUFFIXES) for f in files):
            return True
    return False


def read_images(spark, root: str):
    """Every JPEG/PNG under ``root`` through Spark's image source; files that do not decode stay,
    as rows whose ``image.height`` is -1 (the checks name them)."""
    return (spark.read.format("image").option("dropInvalid", False).option("recursiveFileLookup", True)
            .load(root))


def _read_parquet(spark, path: str):
    try:
        return spark.read.parquet(path)
    except Exception as e:  # noqa: BLE001 - AnalysisException and friends: the path is what is wrong
        raise BadInput(f"data {path!r}: not readable as Parquet ({first_line(e)})") from None


def _sidecar(spark, path: str, split: str) -> dict:
    """A split's metadata from ``<path>/sparkcnn.json`` (written by ``prepare``), read through Spark."""
    where = path.rstrip("/") + "/" + SIDECAR
    try:
        return json.loads(spark.read.text(where, wholetext=True).first()[0])["splits"][split]
    except Exception:  # noqa: BLE001 - missing, unreadable or without that split: not prepared
        raise BadInput(f"data {path!r}: no {split} split described in {where} "
                       "(not a prepared dataset)") from None


def _prepared(spark, path: str, split: str) -> Frame:
    """A split of a prepared dataset: metadata from its footer (local) or sidecar (URIs)."""
    split_dir = path.rstrip("/") + "/" + split
    if is_uri(path):
        m = _sidecar(spark, path, split)
        shape, classes, rows = (m["height"], m["width"], m["channels"]), tuple(m["classes"]), int(m["rows"])
        mean, std = m.get("mean"), m.get("std")
    else:
        from sparkcnn.data.parquet_io import read_meta

        if not os.path.isdir(split_dir):
            raise BadInput(f"data.path {path!r}: no prepared split at {split_dir} "
                           "(run 'sparkcnn prepare' first)")
        meta = read_meta(split_dir)
        shape, classes, rows = (meta.height, meta.width, meta.channels), meta.classes, meta.num_rows
        mean, std = meta.mean, meta.std
        split_dir = os.path.abspath(split_dir)
    if split == "train" and rows == 0:
        raise BadInput(f"data.path {path!r}: the train split is empty")
    df = spark.read.parquet(split_dir).select("image", "label") if spark is not None else split_dir
    return Frame(df, "binary", tuple(int(v) for v in shape), tuple(classes), rows, split_dir,
                 stats=(tuple(mean), tuple(std)) if mean and std else None,
                 local_dir=None if is_uri(path) else split_dir)


def _images(spark, root: str, dcfg, classes) -> Frame:
    """A folder of JPEG/PNG files, one sub-folder per class, decoded once (see the module docstring)."""
    from sparkcnn.data.imagefolder import folder_frame

    if root.startswith("file:"):
        root = "/" + root[len("file:"):].lstrip("/")
    elif is_uri(root):
        return _uri_images(spark, root, dcfg, classes)
    d = folder_frame(spark, root, dcfg.max_image_pixels, tuple(classes) if classes else None)
    return Frame(d.df, "binary", d.shape, d.classes, d.rows, root, cache=d.cache)


def _uri_images(spark, root: str, dcfg, classes) -> Frame:
    """An image folder on a store (hdfs://, s3a://, ...) through Spark's image source, which decodes
    every file each time the frame is read; local folders take the one-pass route."""
    from pyspark.sql import functions as F

    df = read_images(spark, root)
    folder = F.element_at(F.split(F.col("image.origin"), "/"), -2)
    names = classes or tuple(sorted(r[0] for r in df.select(folder).distinct().collect()))
    if not names:
        raise BadInput(f"data {root!r}: no images found")
    label = F.array_position(F.array(*[F.lit(n) for n in names]), folder).cast("int") - 1
    df = df.select(F.col("image"), label.alias("label"))
    return _checked(df, dataclasses.replace(dcfg, image_col="image", label_col="label"), root, names)


# -- checks ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ColumnStats:
    """What :func:`column_stats`'s one aggregate query found (after its checks passed)."""

    kind: str  # the image column's kind (frames.KINDS)
    rows: int
    size: tuple[int, ...]  # struct: (height, width, channels); else (bytes or values per image,)
    labels: tuple[int, int] | None  # (smallest, largest) label, with a label column

    @property
    def unit(self) -> str:
        """What ``size`` counts for flat images: bytes (binary) or values (arrays); "" for structs."""
        return "" if self.kind == "struct" else "bytes" if self.kind == "binary" else "values"

    def check_labels(self, origin: str, column: str, classes: int) -> None:
        """Every label in ``[0, classes)``, else BadInput naming the first bound crossed."""
        lo, hi = self.labels
        if lo < 0 or hi >= classes:
            bad = lo if lo < 0 else hi
            raise BadInput(f"{origin}: column {column!r}: label {bad} outside [0, {classes})")


def column_stats(df, origin: str, image: tuple[str, str], label: tuple[str, str] | None = None,
                 more: tuple[tuple[str, str], ...] = ()) -> ColumnStats:
    """The checks every image DataFrame gets, training's and scoring's alike, in one Spark job:
    the columns exist, the label column is an integer type, there are rows, no image or label
    is null, every image decodes and all have one size. ``image``, ``label`` and each of ``more``
    are (column, the setting or flag that names it); a failure is one line naming them."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    cols = df.columns
    for name, role in (image, *((label,) if label else ()), *more):
        if name not in cols:
            raise BadInput(f"{origin}: no column {name!r} ({role}; columns: {', '.join(cols) or 'none'})")
    fields = {f.name: f.dataType for f in df.schema.fields}
    image_col = image[0]
    kind = image_kind(fields[image_col], image_col)
    if label and not isinstance(fields[label[0]], T.IntegralType):
        raise BadInput(f"{origin}: column {label[0]!r} has type {fields[label[0]].simpleString()}, "
                       "expected an integer type")
    img = F.col(image_col)
    if kind == "struct":
        dims = [img.height, img.width, img.nChannels]
    else:
        dims = [F.length(img) if kind == "binary" else F.size(img)]
    aggs = [F.count(F.lit(1)), F.count(img), *(f(d) for d in dims for f in (F.min, F.max))]
    if label:
        lab = F.col(label[0])
        aggs += [F.count(lab), F.min(lab), F.max(lab)]
    row = df.agg(*aggs).first()
    n, n_img, sizes = row[0], row[1], row[2:2 + 2 * len(dims)]
    if n == 0:
        raise BadInput(f"{origin}: no rows")
    if label and row[-3] < n:
        raise BadInput(f"{origin}: column {label[0]!r} has {n - row[-3]} null label(s)")
    if n_img < n:
        raise BadInput(f"{origin}: column {image_col!r} has {n - n_img} null image(s)")
    lo, hi = tuple(int(v) for v in sizes[0::2]), tuple(int(v) for v in sizes[1::2])
    st = ColumnStats(kind, int(n), lo, (int(row[-2]), int(row[-1])) if label else None)
    if kind == "struct" and lo[0] < 1:
        bad = df.filter(img.height < 1).select(img.origin).first()[0]
        raise BadInput(f"{bad}: image file does not decode (column {image_col!r})")
    if lo != hi:
        unit = f" {st.unit}" if st.unit else ""
        raise BadInput(f"{origin}: column {image_col!r}: images of unequal size "
                       f"({'x'.join(map(str, lo))} to {'x'.join(map(str, hi))}{unit})")
    return st


def _checked(df, dcfg, origin: str, classes) -> Frame:
    """Select, type-check and aggregate-check the image and label columns (one Spark job)."""
    from pyspark.sql import functions as F

    st = column_stats(df, origin, (dcfg.image_col, "data.image_col"), (dcfg.label_col, "data.label_col"))
    fields = {f.name: f for f in df.schema.fields}
    shape = _shape(dcfg, fields[dcfg.image_col], st, origin)
    names = _classes(dcfg, fields[dcfg.label_col], classes, st.labels[1])
    st.check_labels(origin, dcfg.label_col, len(names))
    out = df.select(F.col(dcfg.image_col).alias("image"), F.col(dcfg.label_col).cast("int").alias("label"))
    return Frame(out, st.kind, shape, names, st.rows, origin)


def _shape(dcfg, field, st: ColumnStats, origin: str) -> tuple[int, int, int]:
    """The images' HWC shape: the struct's own, else data.image_shape or the column's metadata."""
    if st.kind == "struct":
        return st.size
    name = dcfg.image_col
    given = tuple(dcfg.image_shape) or tuple((field.metadata.get("sparkcnn") or {}).get("shape", ()))
    if len(given) != 3 or not all(isinstance(v, int) and v > 0 for v in given):
        raise BadInput(f"{origin}: column {name!r} holds {st.kind} images of unknown shape: "
                       f"set data.image_shape to [H, W, C]" + (f" (got {list(given)})" if given else ""))
    if st.size[0] != given[0] * given[1] * given[2]:
        raise BadInput(f"{origin}: column {name!r}: images have {st.size[0]} {st.unit}, "
                       f"data.image_shape {list(given)} needs {given[0] * given[1] * given[2]}")
    return tuple(int(v) for v in given)


def _classes(dcfg, field, given, max_label) -> tuple[str, ...]:
    if given:
        return tuple(given)
    if dcfg.classes:
        return tuple(str(c) for c in dcfg.classes)
    attr = (field.metadata.get("ml_attr") or {})
    if attr.get("vals"):  # StringIndexer's nominal attribute
        return tuple(str(v) for v in attr["vals"])
    return tuple(str(i) for i in range(int(max_label) + 1))


def _same_shape(train: Frame, test: Frame | None) -> Frame | None:
    if test is not None and test.shape != train.shape:
        raise BadInput(f"{test.origin}: test images are {'x'.join(map(str, test.shape))}, "
                       f"training images {'x'.join(map(str, train.shape))}")
    return test


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
