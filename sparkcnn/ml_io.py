"""Saving and loading a :class:`~sparkcnn.ml.SparkCNNModel`, Spark ML's way.

A saved model is a directory: ``metadata/`` holds the Params in Spark's own
format (``DefaultParamsWriter``), and ``model.keras`` beside it the Keras
model's file as it is. Local paths (and ``file:`` URIs) are written directly,
through a temp file renamed into place; other URIs go through the session's
Hadoop ``FileSystem``, which classic sessions have and Spark Connect does not.
"""

from __future__ import annotations

import os

from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReader, MLWriter

from sparkcnn.errors import BadInput

MODEL_FILE = "model.keras"


class ModelWriter(MLWriter):
    """``<path>/metadata`` (Spark's Params JSON) and ``<path>/model.keras``."""

    def __init__(self, instance):
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:
        data = self.instance._model_bytes()
        DefaultParamsWriter.saveMetadata(self.instance, path, self.sparkSession)
        write_bytes(self.sparkSession, _join(path, MODEL_FILE), data)


class ModelReader(MLReader):
    def __init__(self, cls):
        super().__init__()
        self.cls = cls

    def load(self, path: str):
        metadata = DefaultParamsReader.loadMetadata(path, self.sparkSession)
        model = self.cls()
        model._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(model, metadata)
        where = _join(path, MODEL_FILE)
        model._set_model_bytes(read_bytes(self.sparkSession, where), where)
        return model


def _join(path: str, name: str) -> str:
    return path.rstrip("/") + "/" + name


def _local(path: str) -> str | None:
    if path.startswith("file://"):
        return path[len("file://"):]
    if path.startswith("file:"):
        return path[len("file:"):]
    return None if "://" in path else path


def write_bytes(spark, path: str, data: bytes) -> None:
    local = _local(path)
    if local is not None:
        os.makedirs(os.path.dirname(os.path.abspath(local)), exist_ok=True)
        tmp = local + ".tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, local)
        return
    fs, p = _hadoop(spark, path)
    out = fs.create(p, True)
    try:
        out.write(bytearray(data))
    finally:
        out.close()


def read_bytes(spark, path: str) -> bytes:
    local = _local(path)
    if local is not None:
        if not os.path.isfile(local):
            raise BadInput(f"{path}: no such model file")
        with open(local, "rb") as f:
            return f.read()
    fs, p = _hadoop(spark, path)
    if not fs.exists(p):
        raise BadInput(f"{path}: no such model file")
    jvm = spark.sparkContext._jvm
    stream = fs.open(p)
    try:
        return bytes(jvm.org.apache.commons.io.IOUtils.toByteArray(stream))
    finally:
        stream.close()


def _hadoop(spark, path: str):
    from sparkcnn.backends.session import is_connect

    if is_connect(spark):
        raise BadInput(f"{path}: a Spark Connect session saves and loads models on local paths only")
    sc = spark.sparkContext
    p = sc._jvm.org.apache.hadoop.fs.Path(path)
    return p.getFileSystem(sc._jsc.hadoopConfiguration()), p
