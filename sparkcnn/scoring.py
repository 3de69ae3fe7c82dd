"""``sparkcnn predict`` and ``sparkcnn evaluate``: the model applied on the executors.

Both run the Arrow UDF of :mod:`sparkcnn.inference` (the Transformer's) over
a DataFrame read by Spark: a Parquet file, split or dataset (a path or any URI
Spark reads), a table, or (predict) a folder of JPEG/PNG images. What can be
checked without Spark (the model file, a local path, a prepared split's image
shape, the output directory) is checked first; then one aggregate query checks
the columns, image sizes, labels and row count before the model runs.
Outputs are written to a temporary sibling and renamed into place only when
complete, so a failure leaves earlier outputs as they were.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid

import numpy as np

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
        old = None
        if os.path.exists(out):
            old = out.rstrip("/") + f".old-{uuid.uuid4().hex[:8]}"
            os.rename(out, old)
        os.rename(tmp, out)
        if old:
            shutil.rmtree(old) if os.path.isdir(old) else os.remove(old)
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
    tmp = None
    try:
        if out:
            check_out(out)
            tmp = out.rstrip("/") + f".tmp-{uuid.uuid4().hex[:8]}"
            write_parquet(rows, tmp + "/predictions")
            rows = spark.read.parquet(tmp + "/predictions")  # the model ran once; aggregate what it wrote
        counts = (rows.groupBy("label", "prediction")
                  .agg(F.count(F.lit(1)).alias("n"), F.sum("loss").alias("loss")))
        cells = counts.collect()
    except Exception as e:  # noqa: BLE001
        if tmp:
            _remove(spark, tmp)
        raise from_task(e) from None
    matrix = np.zeros((num_classes, num_classes), np.int64)
    loss = 0.0
    for r in cells:
        matrix[r["label"], r["prediction"]] += r["n"]
        loss += r["loss"]
    names = list(classes) if classes else [str(i) for i in range(num_classes)]
    result = {"samples": n, "test_accuracy": float(np.trace(matrix) / n), "test_loss": float(loss / n),
              "classes": names, "confusion_matrix": matrix.tolist()}
    if out:
        try:
            result["out"] = out
            _write_report(tmp, result, names, matrix)
            _replace(spark, tmp, out)
        except BaseException:
            _remove(spark, tmp)
            raise
    return result


def _write_report(tmp: str, result: dict, names, matrix: np.ndarray) -> None:
    from sparkcnn.metrics import atomic_write_text

    if is_uri(tmp):
        raise BadInput(f"--out {tmp}: evaluate writes its report to a local directory")
    atomic_write_text(os.path.join(tmp, "metrics.json"), json.dumps(result, indent=2) + "\n")
    confusion_png(matrix, names, os.path.join(tmp, "confusion_matrix.png"))


def confusion_png(matrix: np.ndarray, names, path: str) -> None:
    """Row-normalised confusion matrix (true class down, predicted across) with counts, as a PNG."""
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
    fig.savefig(path)
