"""sparkcnn on a local Spark Connect session: the Transformer, a Pipeline that trains on the stream
transport (fit, transform, evaluate, save, load), the jobs transport refused in one line, and a
run whose driver is SIGKILLed resumed from a new Connect session.

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

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
def test_transformer_and_pipeline_on_local_connect_session(tmp_path, tiny_data):
    import keras

    from sparkcnn.models import build_model

    keras_path = str(tmp_path / "m.keras")
    build_model("fmnist_cnn", SHAPE, 10, seed=4).save(keras_path)
    result = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), keras_path, tiny_data, str(result),
                           str(tmp_path / "saved")], cwd=str(tmp_path), env=_connect_env(), capture_output=True,
                          text=True, timeout=500)
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

    msg = got["jobs_error"]
    assert msg.startswith("BadInput: ") and "\n" not in msg
    assert "engine.transport=jobs" in msg and "Spark Connect" in msg

    # the Pipeline trained over Connect (the stream transport, chosen by itself; BSP) and evaluated there
    assert got["fit"]["transport"] == "stream" and got["fit"]["mode"] == "sync" and got["fit"]["run_session"].startswith("local")
    print("connect pipeline fit:", json.dumps(got["fit"]))
    assert got["fit"]["accuracy"] > 0.6, got["fit"]
    assert got["fit"]["reloaded_same"] is True


def _connect_env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYSPARK_GATEWAY_", "SPARK_CONNECT", "SPARK_REMOTE")) and k != "PYSPARK_SUBMIT_ARGS"}
    env.update(PYSPARK_PYTHON=sys.executable, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p))
    return env


@pytest.mark.skipif(not _connect_available(), reason="pyspark's connect extra is not installed")
def test_connect_driver_killed_mid_run_resumes(tiny_data, tmp_path):
    """sparkcnn.fit over Connect, async, one step per push, a checkpoint every 10 exchanges: the
    driver (this client, which runs the parameter server) is SIGKILLed mid epoch 2
    (chaos.kill_driver_round); a new client on a new local Connect server resumes the run
    directory from its mid-epoch cut, keeps the records the cut covers as they were, and
    finishes with every step applied once. (The stream's engine is the same on a classic
    session, where tests/spark/test_exchange.py kills sync H = 10.)"""
    from sparkcnn.metrics import read_jsonl

    run_dir = str(tmp_path / "run")
    args = [sys.executable, os.path.abspath(__file__), "--fit", tiny_data, run_dir]
    per_epoch = 2 * (600 // 24)  # exchanges per epoch: 2 blocks of 600 rows, batches of 24, one step each
    killed = subprocess.run([*args, str(per_epoch + per_epoch // 2)], cwd=str(tmp_path), env=_connect_env(),
                            capture_output=True, text=True, timeout=400)
    assert killed.returncode == -9, killed.stderr[-4000:]
    before = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    with open(os.path.join(run_dir, "checkpoints", "LATEST")) as f:
        latest = f.read().strip()
    with open(os.path.join(run_dir, "checkpoints", latest, "state.json")) as f:
        covered = json.load(f)["records"]
    assert 0 < covered < len(before)  # the kill fell after the last checkpoint, mid-epoch
    resumed = subprocess.run([*args, "resume"], cwd=str(tmp_path), env=_connect_env(), capture_output=True,
                             text=True, timeout=400)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    summary = json.loads(resumed.stdout.strip().splitlines()[-1])
    print("connect kill/resume:", json.dumps({k: summary[k] for k in ("transport", "rounds", "test_accuracy")}),
          "records kept:", covered)
    assert summary["transport"] == "stream" and summary["test_accuracy"] > 0.6, summary
    records = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert records[:covered] == before[:covered]  # what the checkpoint covers stays as it was
    rounds = [r for r in records if r["kind"] == "round"]
    assert [r["round"] for r in rounds] == list(range(len(rounds)))
    assert [r["epoch"] for r in records if r["kind"] == "epoch"] == [0, 1, 2]
    steps = [(r["block"], r["block_epoch"], r["block_step"] + i) for r in rounds for i in range(r["steps"])]
    assert len(steps) == len(set(steps)) == 3 * per_epoch


def _classifier(out_dir: str, **kw):
    """BSP rounds of 2 steps (the kill/resume test runs async, one step per push)."""
    from sparkcnn.ml import SparkCNNClassifier

    return SparkCNNClassifier(epochs=3, batchSize=24, stepsPerRound=2, engineMode="sync", lr=0.05,
                              lrWarmupEpochs=0.0, lrSchedule="constant", numBlocks=2, imageShape=list(SHAPE),
                              outDir=out_dir, **kw)


def _connect_main(keras_path: str, data: str, result: str, save_dir: str) -> None:
    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import SparkSession

    from sparkcnn.errors import BadInput
    from sparkcnn.ml import SparkCNNModel

    spark = SparkSession.builder.remote("local[2]").getOrCreate()
    try:
        df = spark.read.parquet(os.path.join(data, "test")).limit(40)
        model = SparkCNNModel.from_keras(keras_path)
        out = model.transform(df)
        types = {f.name: ("vector" if isinstance(f.dataType, VectorUDT) else f.dataType.simpleString())
                 for f in out.schema.fields if f.name in ("prediction", "probability", "rawPrediction")}
        rows = out.collect()
        model.save(save_dir)
        again = SparkCNNModel.load(save_dir).transform(df).select("probability").collect()
        try:
            _classifier("runs", transport="jobs").fit(df)
            jobs_error = "no error"
        except BadInput as e:
            jobs_error = f"BadInput: {e}"
        train_df, test_df = (spark.read.parquet(os.path.join(data, s)) for s in ("train", "test"))
        fitted = Pipeline(stages=[_classifier("runs")]).fit(train_df)
        scored = fitted.transform(test_df)
        acc = MulticlassClassificationEvaluator(metricName="accuracy").evaluate(scored)
        fitted.save("pipeline")
        before = [r["probability"] for r in scored.limit(40).collect()]
        after = [r["probability"] for r in PipelineModel.load("pipeline").transform(test_df).limit(40).collect()]
        with open(os.path.join(fitted.stages[0].getRunDir(), "summary.json"), encoding="utf-8") as f:
            summary = json.load(f)
        report = {
            "session": type(spark).__module__,
            "types": types,
            "images": [base64.b64encode(r["image"]).decode() for r in rows],
            "raw": [r["rawPrediction"].toArray().tolist() for r in rows],
            "prob": [r["probability"].toArray().tolist() for r in rows],
            "pred": [r["prediction"] for r in rows],
            "reloaded_same": [r["probability"] for r in rows] == [r["probability"] for r in again],
            "jobs_error": jobs_error,
            "fit": {"accuracy": acc, "transport": summary["transport"], "mode": summary["mode"],
                    "run_session": summary["master"],
                    "reloaded_same": before == after},
        }
        with open(result, "w", encoding="utf-8") as f:
            json.dump(report, f)
    finally:
        spark.stop()


def _fit_main(data: str, run_dir: str, kill: str) -> None:
    """sparkcnn.fit on a local Connect session into ``run_dir``: killed after round ``kill``,
    or (``kill`` = "resume") resumed; prints the summary as JSON."""
    from pyspark.sql import SparkSession

    import sparkcnn

    spark = SparkSession.builder.remote("local[2]").getOrCreate()
    train_df, test_df = (spark.read.parquet(os.path.join(data, s)) for s in ("train", "test"))
    if kill == "resume":
        from sparkcnn.train import resume_config

        cfg = resume_config(run_dir, ["chaos.kill_driver_round=-1"])
        result = sparkcnn.fit(cfg, data=train_df, test_data=test_df, spark=spark, progress=False,
                              run_dir=run_dir, resume=True)
    else:
        cfg = {"train": {"epochs": 3, "batch_size": 24, "steps_per_round": 1, "lr": 0.05, "lr_warmup_epochs": 0,
                         "lr_schedule": "constant"},
               "data": {"num_blocks": 2, "image_shape": list(SHAPE)}, "engine": {"mode": "async"},
               "compression": {"method": "threshold", "density": 0.05, "density_down": 0.05},
               "checkpoint": {"every_rounds": 10}, "chaos": {"kill_driver_round": int(kill)}}
        result = sparkcnn.fit(cfg, data=train_df, test_data=test_df, spark=spark, progress=False, run_dir=run_dir)
    print(json.dumps(result.summary))
    spark.stop()


if __name__ == "__main__":
    if sys.argv[1] == "--fit":
        _fit_main(*sys.argv[2:5])
    else:
        _connect_main(*sys.argv[1:5])
