"""The Transformer on a local Spark Connect session; training from Connect refuses in one line.

A local Connect session (``SparkSession.builder.remote("local[2]")``) starts a
Spark Connect server on its own SparkContext inside the calling process and
switches pyspark's process-wide mode to Connect, so it cannot share a process
with the suite's classic session: the session runs in a subprocess (this file,
run as a script) that writes what it saw as JSON.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = (28, 28, 1)

pytestmark = pytest.mark.spark


def _connect_available() -> bool:
    try:
        from pyspark.sql.connect.utils import check_dependencies

        check_dependencies()
        return True
    except Exception:  # noqa: BLE001 - ImportError or pyspark's own dependency error
        return False


@pytest.mark.skipif(not _connect_available(), reason="pyspark's connect extra is not installed")
def test_transformer_on_local_connect_session(tmp_path, tiny_data):
    import keras

    from sparkcnn.models import build_model

    keras_path = str(tmp_path / "m.keras")
    build_model("fmnist_cnn", SHAPE, 10, seed=4).save(keras_path)
    result = tmp_path / "result.json"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYSPARK_GATEWAY_", "SPARK_CONNECT", "SPARK_REMOTE")) and k != "PYSPARK_SUBMIT_ARGS"}
    env.update(PYSPARK_PYTHON=sys.executable, PYTHONPATH=os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), keras_path,
                           os.path.join(tiny_data, "test"), str(result), str(tmp_path / "saved")],
                          cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    got = json.loads(result.read_text())

    assert got["session"].startswith("pyspark.sql.connect")
    assert got["types"] == {"prediction": "double", "probability": "vector", "rawPrediction": "vector"}
    images = np.stack([np.frombuffer(base64.b64decode(b), np.uint8).reshape(SHAPE) for b in got["images"]])
    model = keras.saving.load_model(keras_path, safe_mode=True)
    z = model.predict(images.astype(np.float32), verbose=0).astype(np.float64)
    np.testing.assert_allclose(np.array(got["raw"]), z, rtol=1e-4, atol=1e-5)
    e = np.exp(z - z.max(axis=1, keepdims=True))
    np.testing.assert_allclose(np.array(got["prob"]), e / e.sum(axis=1, keepdims=True), rtol=1e-4, atol=1e-6)
    top2 = np.sort(z, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 1e-4
    assert clear.mean() > 0.9 and (np.array(got["pred"])[clear] == z[clear].argmax(axis=1)).all()
    assert got["reloaded_same"] is True

    msg = got["fit_error"]
    assert msg.startswith("BadInput: ") and "\n" not in msg
    assert "needs a classic SparkSession" in msg and "Spark Connect" in msg


def _connect_main(keras_path: str, split: str, result: str, save_dir: str) -> None:
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import SparkSession

    from sparkcnn.errors import BadInput
    from sparkcnn.ml import SparkCNNClassifier, SparkCNNModel

    spark = SparkSession.builder.remote("local[2]").getOrCreate()
    try:
        df = spark.read.parquet(split).limit(40)
        model = SparkCNNModel.from_keras(keras_path)
        out = model.transform(df)
        types = {f.name: ("vector" if isinstance(f.dataType, VectorUDT) else f.dataType.simpleString())
                 for f in out.schema.fields if f.name in ("prediction", "probability", "rawPrediction")}
        rows = out.collect()
        model.save(save_dir)
        again = SparkCNNModel.load(save_dir).transform(df).select("probability").collect()
        try:
            SparkCNNClassifier(epochs=1, imageShape=list(SHAPE)).fit(df)
            fit_error = "no error"
        except BadInput as e:
            fit_error = f"BadInput: {e}"
        report = {
            "session": type(spark).__module__,
            "types": types,
            "images": [base64.b64encode(r["image"]).decode() for r in rows],
            "raw": [r["rawPrediction"].toArray().tolist() for r in rows],
            "prob": [r["probability"].toArray().tolist() for r in rows],
            "pred": [r["prediction"] for r in rows],
            "reloaded_same": [r["probability"] for r in rows] == [r["probability"] for r in again],
            "fit_error": fit_error,
        }
        with open(result, "w", encoding="utf-8") as f:
            json.dump(report, f)
    finally:
        spark.stop()


if __name__ == "__main__":
    _connect_main(*sys.argv[1:5])
