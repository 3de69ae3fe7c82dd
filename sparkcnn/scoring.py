"""``sparkcnn predict`` and ``sparkcnn evaluate``: the model applied on the executors.

Both run the Arrow UDF of :mod:`sparkcnn.inference` (the Transformer's) over
a DataFrame read by Spark: a Parquet file, split or dataset (a path or any URI
Spark reads), a table, or (predict) a folder of JPEG/PNG images. What can be
checked without Spark (the model file, a local path, a prepared split's image
shape, the output directory) is checked first; then one aggregate query checks
the columns, image sizes, labels and row count before the model runs.
Outputs are written to a temporary sibling and renamed into place only when
complete, so a failure leaves earlier outputs as they were.

``predict --out`` is a dataset that Spark writes (any filesystem of Spark's, such as
``s3a://`` with its connector). ``evaluate --out`` is a report, in a run directory in the
Airflow DAG: it goes where :mod:`sparkcnn.runfs` writes, a local path or a URI such as
``s3://bucket/runs/<id>/evaluation``, with the run directory's credentials (the AWS
variables) and no Hadoop connector. There the executors encode each partition of the
predictions as one Parquet file and the driver writes the files (see :func:`store_parts`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid

import numpy as np

from sparkcnn import runfs
from sparkcnn.data.source import column_stats, first_line, has_images, is_uri, read_images, table_exists
from sparkcnn.errors import BadInput

log = logging.getLogger(__name__)



# -- before Spark ----------------------------------------------------------------------------------

def model_path(path: str) -> str:
    """The ``.keras`` file of ``--model`` (a file, or a run directory holding ``model.keras``;
    a local path or a URI the driver reads, see :mod:`sparkcnn.runfs`)."""
    from sparkcnn import runfs

    runfs.check(path, "--model")
    if runfs.isdir(path):
        path = runfs.join(path, "model.keras")
    if not runfs.isfile(path):
        raise BadInput(f"--model: no model file at {path}")
    return path



def local_input(path: str, shape) -> tuple[str, tuple[str, ...] | None]:
    """Check a local ``--data`` path; returns (path, class names of a prepared split or None).

    A prepared dataset (``train/`` and ``test/``) stands for its test split.
    """
    from sparkcnn.data.parquet_io import read_meta

    if is_uri(path):
        return path, None
    if not os.path.exists(path):
        raise BadInput(f"{path}: no such Parquet file or directory")
    if os.path.isdir(os.path.join(path, "test")) and not any(
            n.endswith(".parquet") for n in os.listdir(path)):
        log.info("%s is a prepared dataset: using its test split", path)
        path = os.path.join(path, "test")
    try:
        meta = read_meta(path)
    except BadInput:
        return path, None  # not a prepared split: Spark reads it, the aggregate checks it
    got = (meta.height, meta.width, meta.channels)
    if got != tuple(shape):
        raise BadInput(f"{path}: images are {'x'.join(map(str, got))}, "
                       f"the model expects {'x'.join(map(str, shape))}")
    return path, tuple(meta.classes)


def check_out(out: str) -> None:
    """A local ``--out``'s parent directory must exist and be writable."""
    if is_uri(out):
        return
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise BadInput(f"--out {out}: directory {parent} is missing or not writable")


# -- with Spark ------------------------------------------------------------------------------------

def read_input(spark, data: str | None, table: str | None, image_col: str):
    """The input DataFrame of ``--data`` or ``--table``, and a name for it in messages."""
    if table:
        if not table_exists(spark, table):
            raise BadInput(f"--table {table}: no such table")
        return spark.table(table), f"table {table}"
    if not is_uri(data) and os.path.isdir(data) and has_images(data):
        df = read_images(spark, data)
        df = df.withColumn("origin", df["image"]["origin"])  # the file, as an id column
        return df.withColumnRenamed("image", image_col) if image_col != "image" else df, data
    try:
        return spark.read.parquet(data), data
    except Exception as e:  # noqa: BLE001 - AnalysisException and friends: the input is what is wrong
        raise BadInput(f"{data}: not readable as Parquet ({first_line(e)})") from None



def check_input(df, origin: str, image_col: str, shape, *, label_col: str | None = None,
                num_classes: int | None = None, id_cols=()) -> int:
    """Columns, types, image sizes, labels and row count, in one aggregate query; returns the rows."""
    st = column_stats(df, origin, (image_col, "--image-col"),
                      (label_col, "--label-col") if label_col else None,
                      tuple((c, "--id-cols") for c in id_cols))
    want = "x".join(map(str, shape))
    if st.kind == "struct":
        if st.size != tuple(shape):
            raise BadInput(f"{origin}: images are {'x'.join(map(str, st.size))}, the model expects {want}")
    elif st.size[0] != int(np.prod(shape)):
        raise BadInput(f"{origin}: images have {st.size[0]} {st.unit}, the model expects {want} "
                       f"({int(np.prod(shape))} {st.unit})")
    if label_col:
        st.check_labels(origin, label_col, num_classes)
    return st.rows


def scored(df, data: bytes, shape, image_col: str, batch_size: int):
    """``df`` plus the UDF's struct column ``_p`` (rawPrediction, probability, prediction)."""
    from pyspark.sql import functions as F

    from sparkcnn.inference import prediction_udf

    return df.withColumn("_p", prediction_udf(data, shape, image_col, batch_size)(F.col(image_col)))


def write_parquet(df, out: str) -> None:
    """Write ``df`` to a temporary sibling of ``out``, then rename it into place (replacing ``out``)."""
    tmp = out.rstrip("/") + f".tmp-{uuid.uuid4().hex[:8]}"
    try:
        df.write.parquet(tmp)
    except BaseException:
        _remove(df.sparkSession, tmp)
        raise
    _replace(df.sparkSession, tmp, out)


def _replace(spark, tmp: str, out: str) -> None:
    if not is_uri(out):
        runfs.replace_dir(tmp, out)
        return
    fs, jpath = _hadoop(spark, out)
    if fs.exists(jpath):
        fs.delete(jpath, True)
    if not fs.rename(_hadoop(spark, tmp)[1], jpath):
        raise OSError(f"--out {out}: rename from {tmp} failed")


def _remove(spark, path: str) -> None:
    if not is_uri(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    fs, jpath = _hadoop(spark, path)
    fs.delete(jpath, True)


def _hadoop(spark, path: str):
    sc = spark.sparkContext
    p = sc._jvm.org.apache.hadoop.fs.Path(path)
    return p.getFileSystem(sc._jsc.hadoopConfiguration()), p



def _encode_part(batches):
    """Executor side: one partition's Arrow batches as the bytes of one Parquet file (none when empty)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink, writer = pa.BufferOutputStream(), None
    for batch in batches:
        if writer is None:
            writer = pq.ParquetWriter(sink, batch.schema)
        writer.write_batch(batch)
    if writer is not None:
        writer.close()
        yield pa.RecordBatch.from_pydict({"data": [sink.getvalue().to_pybytes()]})


def store_parts(rows, dest: str, num_classes: int) -> tuple[np.ndarray, float]:
    """Write ``rows`` under ``dest`` (a :mod:`sparkcnn.runfs` URI) as ``part-NNNNN.parquet``; returns the
    confusion matrix and summed loss of what was written (columns ``label``, ``prediction``, ``loss``).

    The executors encode the files, in parallel, into a cache on the executors (the model runs
    once); the driver then fetches them one partition at a time and writes each with one upload,
    so it never holds more than a partition's predictions and the executors need no credentials.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pyspark import StorageLevel

    parts = rows.mapInArrow(_encode_part, "data binary").persist(StorageLevel.MEMORY_AND_DISK)
    try:
        parts.count()  # one job: every partition encoded at once
        matrix, loss = np.zeros((num_classes, num_classes), np.int64), 0.0
        for i, row in enumerate(parts.toLocalIterator()):
            data = bytes(row["data"])
            runfs.write_bytes(runfs.join(dest, f"part-{i:05d}.parquet"), data)
            t = pq.read_table(pa.BufferReader(data), columns=["label", "prediction", "loss"])
            np.add.at(matrix, (t["label"].to_numpy(), t["prediction"].to_numpy()), 1)
            loss += float(np.sum(t["loss"].to_numpy()))
        return matrix, loss
    finally:
        parts.unpersist()


def _tally(rows, num_classes: int) -> tuple[np.ndarray, float]:
    """Confusion matrix and summed loss of ``rows``, aggregated by Spark."""
    from pyspark.sql import functions as F

    cells = (rows.groupBy("label", "prediction")
             .agg(F.count(F.lit(1)).alias("n"), F.sum("loss").alias("loss")).collect())
    matrix, loss = np.zeros((num_classes, num_classes), np.int64), 0.0
    for r in cells:
        matrix[r["label"], r["prediction"]] += r["n"]
        loss += r["loss"]
    return matrix, loss


def from_task(e: Exception) -> Exception:
    """A BadInput raised inside a Spark task, as a driver-side BadInput; else ``e`` itself."""
    from sparkcnn.inference import bad_input_in

    return bad_input_in(e) or e


# -- the two commands --------------------------------------------------------------------------------

def predict(spark, model, data, shape, *, out: str, table=None, image_col="image", id_cols=(),
            classes=None, batch_size=256) -> dict:
    """Write ``id_cols``, ``prediction`` (int), ``class`` (when names are known) and
    ``probability`` (array<double>) of every row to Parquet at ``out``."""
    from pyspark.sql import functions as F

    df, origin = read_input(spark, data, table, image_col)
    n = check_input(df, origin, image_col, shape, id_cols=id_cols)
    s = scored(df, model, shape, image_col, batch_size)
    cols = [F.col(c) for c in id_cols] + [F.col("_p.prediction").cast("int").alias("prediction")]
    if classes:
        cols.append(F.element_at(F.array(*[F.lit(c) for c in classes]),
                                 F.col("_p.prediction").cast("int") + 1).alias("class"))
    cols.append(F.col("_p.probability").alias("probability"))
    try:
        write_parquet(s.select(*cols), out)
    except Exception as e:  # noqa: BLE001 - a task's BadInput comes back wrapped
        raise from_task(e) from None
    return {"rows": n, "out": out}


def evaluate(spark, model, data, shape, num_classes: int, *, table=None, image_col="image",
             label_col="label", id_cols=(), classes=None, out=None, batch_size=256) -> dict:
    """Accuracy, mean cross-entropy and the confusion matrix; with ``out``: the per-row
    predictions (Parquet), ``confusion_matrix.png`` and ``metrics.json`` in that directory."""
    from pyspark.sql import functions as F

    df, origin = read_input(spark, data, table, image_col)
    n = check_input(df, origin, image_col, shape, label_col=label_col, num_classes=num_classes,
                    id_cols=id_cols)
    s = scored(df, model, shape, image_col, batch_size)
    raw, label = F.col("_p.rawPrediction"), F.col(label_col).cast("int")
    top = F.array_max(raw)
    lse = top + F.log(F.aggregate(F.transform(raw, lambda x: F.exp(x - top)), F.lit(0.0), lambda a, x: a + x))
    rows = s.select(*[F.col(c) for c in id_cols if c != label_col], label.alias("label"),
                    F.col("_p.prediction").cast("int").alias("prediction"),
                    F.col("_p.probability").alias("probability"), (lse - F.get(raw, label)).alias("loss"))
    tmp = out.rstrip("/") + f".tmp-{uuid.uuid4().hex[:8]}" if out else None
    try:
        if out:
            check_out(out)
        if out and runfs.is_uri(out):
            matrix, loss = store_parts(rows, runfs.join(tmp, "predictions"), num_classes)
        else:
            if out:
                write_parquet(rows, tmp + "/predictions")
                rows = spark.read.parquet(tmp + "/predictions")  # the model ran once; aggregate what it wrote
            matrix, loss = _tally(rows, num_classes)
    except Exception as e:  # noqa: BLE001
        if tmp:
            runfs.rmtree(tmp)
        raise from_task(e) from None
    names = list(classes) if classes else [str(i) for i in range(num_classes)]
    result = {"samples": n, "test_accuracy": float(np.trace(matrix) / n), "test_loss": float(loss / n),
              "classes": names, "confusion_matrix": matrix.tolist()}
    if out:
        try:
            result["out"] = out
            runfs.write_bytes(runfs.join(tmp, "confusion_matrix.png"), confusion_png(matrix, names))
            runfs.write_text(runfs.join(tmp, "metrics.json"), json.dumps(result, indent=2) + "\n")
            runfs.replace_dir(tmp, out, last="metrics.json")  # metrics.json last: its presence means complete
        except BaseException:
            runfs.rmtree(tmp)
            raise
    return result


def confusion_png(matrix: np.ndarray, names) -> bytes:
    """Row-normalised confusion matrix (true class down, predicted across) with counts, as PNG bytes."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    k = len(names)
    frac = matrix / np.maximum(matrix.sum(axis=1, keepdims=True), 1)
    fig = Figure(figsize=(1.0 + 0.6 * k, 0.8 + 0.6 * k), dpi=100)
    ax = fig.add_subplot()
    im = ax.imshow(frac, cmap="Blues", vmin=0, vmax=1)
    ax.set_xticks(range(k), names, rotation=45, ha="right")
    ax.set_yticks(range(k), names)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    acc = np.trace(matrix) / max(matrix.sum(), 1)
    ax.set_title(f"accuracy {acc:.3f} ({int(matrix.sum())} images)")
    if k <= 20:
        for i in range(k):
            for j in range(k):
                if matrix[i, j]:
                    ax.text(j, i, str(matrix[i, j]), ha="center", va="center", fontsize=7,
                            color="white" if frac[i, j] > 0.5 else "black")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()
