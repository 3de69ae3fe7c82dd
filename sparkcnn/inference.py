"""Batch inference on the executors: one Arrow UDF shared by the Transformer and the CLI.

The model travels as the bytes of its ``.keras`` file inside the UDF's closure
(no Spark broadcast, so it works on Spark Connect too) and is loaded with
Keras' ``safe_mode=True``; nothing is unpickled. Each Python worker keeps the
models it loaded in a small cache keyed by the SHA-256 of those bytes, so a
model is loaded once per Python worker, however many Arrow batches, tasks or
``transform`` calls it serves. Its TensorFlow runs on the GPUs Spark assigned
the task, as training's does (:mod:`sparkcnn.worker.devices`).

Per row the UDF returns ``rawPrediction`` (the model's logits),
``probability`` (``softmax(logits)``) and ``prediction`` (``argmax``, a
double, as Spark ML classifiers give it).
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import tempfile
import threading

import numpy as np

from sparkcnn.errors import BadInput

log = logging.getLogger(__name__)

RESULT_FIELDS = ("rawPrediction", "probability", "prediction")
RESULT_TYPE = "rawPrediction array<double>, probability array<double>, prediction double"
# debug=True adds, per row, the Python worker's pid and how often that process
# has loaded this model so far (tests check one load per worker)
DEBUG_TYPE = RESULT_TYPE + ", worker_pid long, model_loads long"

_CACHE_SIZE = 2  # models kept per Python worker (CrossValidator alternates few models at a time)
_models: collections.OrderedDict = collections.OrderedDict()  # sha256 -> keras.Model
_loads: collections.Counter = collections.Counter()  # sha256 -> loads in this process
_lock = threading.Lock()


def model_bytes(model) -> bytes:
    """The ``.keras`` file bytes of a ``keras.Model``, a ``.keras`` path, or bytes as given."""
    if isinstance(model, (bytes, bytearray)):
        return bytes(model)
    if isinstance(model, (str, os.PathLike)):  # a local path or a URI (sparkcnn.runfs)
        from sparkcnn import runfs

        return runfs.read_bytes(os.fspath(model))
    with tempfile.TemporaryDirectory(prefix="sparkcnn-model-") as d:
        path = os.path.join(d, "model.keras")
        model.save(path)
        with open(path, "rb") as f:
            return f.read()


def load_model_bytes(data: bytes, name: str = "model"):
    """A ``keras.Model`` from ``.keras`` file bytes (``safe_mode=True``); BadInput naming ``name``."""
    import keras

    with tempfile.TemporaryDirectory(prefix="sparkcnn-model-") as d:
        path = os.path.join(d, "model.keras")
        with open(path, "wb") as f:
            f.write(data)
        try:
            return keras.saving.load_model(path, safe_mode=True, compile=False)
        except Exception as e:  # noqa: BLE001 - any failure means the file is not a usable model
            raise BadInput(f"{name}: not a loadable Keras model ({type(e).__name__})") from None


def worker_model(data: bytes, key: str | None = None):
    """The model of ``data`` for this process: loaded on first use, then cached."""
    key = key or hashlib.sha256(data).hexdigest()
    with _lock:
        model = _models.get(key)
        if model is not None:
            _models.move_to_end(key)
            return model
        model = load_model_bytes(data)
        _loads[key] += 1
        _models[key] = model
        while len(_models) > _CACHE_SIZE:
            _models.popitem(last=False)
        log.debug("pid %d loaded model %s (%d loads)", os.getpid(), key[:12], _loads[key])
        return model


def load_count(key: str) -> int:
    """How often this process loaded the model with SHA-256 ``key``."""
    return _loads[key]


def logits(model, images: np.ndarray, batch_size: int) -> np.ndarray:
    """float64 logits (N, classes) of uint8 images (N, H, W, C), ``batch_size`` rows per call."""
    out = [np.asarray(model(images[i:i + batch_size].astype(np.float32), training=False), np.float64)
           for i in range(0, len(images), batch_size)]
    if not out:
        return np.zeros((0, int(model.output_shape[-1])), np.float64)
    return np.concatenate(out)


def softmax(z: np.ndarray) -> np.ndarray:
    """Row-wise ``exp(z - max) / sum(exp(z - max))``."""
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _list_array(values: np.ndarray):
    """(N, K) float64 → Arrow list<double> of N rows of K values (zero-copy offsets)."""
    import pyarrow as pa

    n, k = values.shape
    offsets = pa.array(np.arange(n + 1, dtype=np.int32) * k)
    return pa.ListArray.from_arrays(offsets, pa.array(np.ascontiguousarray(values).reshape(-1)))


def result_batch(z: np.ndarray, debug: dict | None = None):
    """The UDF's struct array for logits ``z``: rawPrediction, probability, prediction (+ debug)."""
    import pyarrow as pa

    arrays = [_list_array(z), _list_array(softmax(z) if len(z) else z),
              pa.array(np.argmax(z, axis=1).astype(np.float64) if len(z) else np.zeros(0))]
    names = list(RESULT_FIELDS)
    for name, value in (debug or {}).items():
        arrays.append(pa.array(np.full(len(z), value, dtype=np.int64)))
        names.append(name)
    return pa.StructArray.from_arrays(arrays, names=names)


def prediction_udf(data: bytes, input_shape, column: str, batch_size: int = 256, debug: bool = False):
    """An Arrow UDF (iterator of batches) mapping an image column to the prediction struct.

    ``data``: the ``.keras`` bytes; ``input_shape``: the model's (H, W, C), which
    every image must have; ``column``: the image column's name, for messages.
    Images may be binary uint8 HWC, array<float> in [0, 1] or Spark's image struct
    (:func:`sparkcnn.data.frames.images_from_arrow`).
    """
    from typing import Iterator

    import pyarrow as pa
    from pyspark.sql.functions import arrow_udf

    key = hashlib.sha256(data).hexdigest()
    shape = tuple(int(d) for d in input_shape)
    batch_size = int(batch_size)

    def predict(batches: Iterator[pa.Array]) -> Iterator[pa.Array]:
        from sparkcnn.data.frames import images_from_arrow

        model = None
        for batch in batches:
            if model is None:  # first batch: the worker's cached model, loaded at most once
                from sparkcnn.backends.backend import spark_task_context
                from sparkcnn.worker.devices import bind

                ctx = spark_task_context()
                bind(ctx.gpus, f"inference attempt {ctx.attempt}")  # the task's GPUs, as for training
                model = worker_model(data, key)
            images = images_from_arrow(batch, shape, column)
            extra = {"worker_pid": os.getpid(), "model_loads": load_count(key)} if debug else None
            yield result_batch(logits(model, images, batch_size), extra)

    # real types, not this module's postponed strings: Spark reads them to pick the iterator form
    predict.__annotations__ = {"batches": Iterator[pa.Array], "return": Iterator[pa.Array]}
    return arrow_udf(predict, DEBUG_TYPE if debug else RESULT_TYPE)


def add_predictions(df, data: bytes, input_shape, *, features_col: str, prediction_col: str = "prediction",
                    probability_col: str = "probability", raw_prediction_col: str = "rawPrediction",
                    batch_size: int = 256, debug: bool = False):
    """``df`` with the prediction columns added (an empty name skips that column).

    ``rawPrediction`` and ``probability`` are ``pyspark.ml.linalg`` dense vectors
    (VectorUDT), ``prediction`` a double. The UDF runs once per row: its struct is
    computed in one projection and the columns are read from it.
    """
    from pyspark.ml.functions import array_to_vector
    from pyspark.sql import functions as F

    check_image_column(df, features_col)
    tmp = "__sparkcnn_prediction"
    udf = prediction_udf(data, input_shape, features_col, batch_size=batch_size, debug=debug)
    out = df.withColumn(tmp, udf(F.col(features_col)))
    new = {}
    if raw_prediction_col:
        new[raw_prediction_col] = array_to_vector(F.col(f"{tmp}.rawPrediction"))
    if probability_col:
        new[probability_col] = array_to_vector(F.col(f"{tmp}.probability"))
    if prediction_col:
        new[prediction_col] = F.col(f"{tmp}.prediction")
    if debug:
        new["worker_pid"] = F.col(f"{tmp}.worker_pid")
        new["model_loads"] = F.col(f"{tmp}.model_loads")
    return out.withColumns(new).drop(tmp)


def check_image_column(df, column: str) -> None:
    """BadInput unless ``df`` has ``column`` of a supported image type."""
    from sparkcnn.data.frames import image_kind

    if column not in df.columns:
        raise BadInput(f"image column {column!r} not found (columns: {', '.join(df.columns)})")
    image_kind(df.schema[column].dataType, column)


def bad_input_in(exc: BaseException) -> BadInput | None:
    """The BadInput raised inside a Spark task, recovered from the driver-side exception text."""
    text = str(exc)
    marker = "BadInput: "
    i = text.rfind(marker)
    if i < 0:
        return None
    return BadInput(text[i + len(marker):].splitlines()[0].strip())
