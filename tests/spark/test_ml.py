"""Spark ML: the Transformer's predictions, persistence, Pipeline, evaluator, CrossValidator, Estimator."""

from __future__ import annotations

import os

import numpy as np
import pytest

from sparkcnn.errors import BadInput

pytestmark = pytest.mark.spark

SHAPE = (28, 28, 1)


def _keras_file(tmp_path_factory, seed: int) -> str:
    from sparkcnn.models import build_model

    path = str(tmp_path_factory.mktemp(f"model-{seed}") / "m.keras")
    build_model("fmnist_cnn", SHAPE, 10, seed=seed).save(path)
    return path


@pytest.fixture(scope="module")
def keras_path(tmp_path_factory):
    return _keras_file(tmp_path_factory, seed=1)


@pytest.fixture(scope="module")
def test_df(spark, tiny_data):
    """The tiny prepared test split (400 rows, binary 28x28x1 images, int labels)."""
    return spark.read.parquet(os.path.join(tiny_data, "test"))


def _images(rows, col="image") -> np.ndarray:
    return np.stack([np.frombuffer(r[col], np.uint8).reshape(SHAPE) for r in rows])


def _assert_same_as_driver(keras_path, rows, *, prob="probability", raw="rawPrediction", pred="prediction"):
    """Each row's columns equal driver-side ``model.predict`` on the same row's image."""
    import keras

    model = keras.saving.load_model(keras_path, safe_mode=True)
    want = model.predict(_images(rows).astype(np.float32), verbose=0).astype(np.float64)
    raw_got = np.array([r[raw].toArray() for r in rows])
    prob_got = np.array([r[prob].toArray() for r in rows])
    pred_got = np.array([r[pred] for r in rows])
    np.testing.assert_allclose(raw_got, want, rtol=1e-4, atol=1e-5)
    e = np.exp(want - want.max(axis=1, keepdims=True))
    np.testing.assert_allclose(prob_got, e / e.sum(axis=1, keepdims=True), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(prob_got.sum(axis=1), 1.0, atol=1e-9)
    # argmax equal wherever the top two logits are not a float32 rounding apart
    top2 = np.sort(want, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 1e-4
    assert clear.mean() > 0.9
    assert (pred_got[clear] == want[clear].argmax(axis=1)).all()


def test_transform_equals_driver_predict_with_ml_types(spark, keras_path, test_df):
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import types as T

    from sparkcnn.ml import SparkCNNModel

    model = SparkCNNModel.from_keras(keras_path)
    out = model.transform(test_df)
    types = {f.name: f.dataType for f in out.schema.fields}
    assert isinstance(types["prediction"], T.DoubleType)
    assert isinstance(types["probability"], VectorUDT) and isinstance(types["rawPrediction"], VectorUDT)
    assert out.columns == ["image", "label", "rawPrediction", "probability", "prediction"]
    plan = out._jdf.queryExecution().executedPlan().toString()
    assert plan.count("ArrowEvalPython") == 1, plan  # one UDF call per row feeds all three columns
    rows = out.collect()
    assert len(rows) == 400
    _assert_same_as_driver(keras_path, rows)


def test_transform_float_array_images_and_custom_columns(spark, keras_path, test_df):
    """array<float> images in [0, 1] give the same predictions as their uint8 bytes."""
    from sparkcnn.ml import SparkCNNModel

    rows = test_df.limit(64).collect()
    data = [(r["image"], [float(v) / 255.0 for v in np.frombuffer(r["image"], np.uint8)]) for r in rows]
    floats = spark.createDataFrame(data, "image binary, pixels array<float>")
    model = SparkCNNModel.from_keras(keras_path, featuresCol="pixels", predictionCol="p",
                                     probabilityCol="", rawPredictionCol="raw")
    out = model.transform(floats)
    assert out.columns == ["image", "pixels", "raw", "p"]
    got = out.collect()
    want = SparkCNNModel.from_keras(keras_path).transform(floats.select("image")).collect()
    np.testing.assert_allclose([r["raw"].toArray() for r in got], [r["rawPrediction"].toArray() for r in want],
                               rtol=1e-5, atol=1e-6)


def test_one_model_load_per_python_worker(spark, tmp_path_factory, test_df):
    """Many Arrow batches over several tasks, each Python worker loads the model once."""
    from sparkcnn.inference import add_predictions, model_bytes

    data = model_bytes(_keras_file(tmp_path_factory, seed=7))  # a model no other test loaded
    key = "spark.sql.execution.arrow.maxRecordsPerBatch"
    before = spark.conf.get(key)
    spark.conf.set(key, "25")
    try:
        df = test_df.repartition(6)
        rows = add_predictions(df, data, SHAPE, features_col="image", debug=True) \
            .select("worker_pid", "model_loads").collect()
    finally:
        spark.conf.set(key, before)
    assert len(rows) == 400  # the UDF ran once per row
    pids = {r["worker_pid"] for r in rows}
    assert {r["model_loads"] for r in rows} == {1}, "a Python worker loaded the model more than once"
    # 400 rows / 25 per batch over 6 tasks: at least 16 batches, served by fewer workers than tasks
    assert 1 <= len(pids) < 6


def test_model_save_load_and_pipeline_round_trip(spark, keras_path, test_df, tmp_path):
    from pyspark.ml import Pipeline, PipelineModel

    from sparkcnn.ml import MODEL_FILE, SparkCNNModel

    model = SparkCNNModel.from_keras(keras_path, predictionCol="pred", inferenceBatchSize=64)
    model.save(str(tmp_path / "m"))
    assert os.path.isfile(tmp_path / "m" / MODEL_FILE) and os.path.isdir(tmp_path / "m" / "metadata")
    loaded = SparkCNNModel.load(str(tmp_path / "m"))
    assert (loaded.uid, loaded.getPredictionCol(), loaded.getInferenceBatchSize()) == (model.uid, "pred", 64)

    sample = test_df.limit(50)
    fitted = Pipeline(stages=[model]).fit(sample)
    fitted.write().overwrite().save(str(tmp_path / "pipe"))
    again = PipelineModel.load(str(tmp_path / "pipe"))
    assert isinstance(again.stages[0], SparkCNNModel)
    a = fitted.transform(sample).collect()
    b = again.transform(sample).collect()
    assert [r["pred"] for r in a] == [r["pred"] for r in b]
    np.testing.assert_array_equal([r["probability"].toArray() for r in a], [r["probability"].toArray() for r in b])


def test_load_rejects_damaged_model_file(spark, keras_path, tmp_path):
    from sparkcnn.ml import MODEL_FILE, SparkCNNModel

    SparkCNNModel.from_keras(keras_path).save(str(tmp_path / "m"))
    (tmp_path / "m" / MODEL_FILE).write_bytes(b"PK\x03\x04 not a keras archive")
    with pytest.raises(BadInput, match=r"model\.keras: not a loadable Keras model"):
        SparkCNNModel.load(str(tmp_path / "m"))


def test_evaluator_accuracy_matches_numpy(spark, keras_path, test_df):
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator

    from sparkcnn.ml import SparkCNNModel

    out = SparkCNNModel.from_keras(keras_path).transform(test_df)
    acc = MulticlassClassificationEvaluator(metricName="accuracy").evaluate(out)
    rows = out.select("label", "prediction").collect()
    assert acc == pytest.approx(np.mean([r["label"] == r["prediction"] for r in rows]))


def test_transform_bad_columns(spark, keras_path, test_df):
    from sparkcnn.ml import SparkCNNModel

    model = SparkCNNModel.from_keras(keras_path)
    with pytest.raises(BadInput, match=r"image column 'pixels' not found"):
        model.setFeaturesCol("pixels").transform(test_df)
    with pytest.raises(BadInput, match=r"column 'label': type int is not an image column"):
        model.setFeaturesCol("label").transform(test_df)


def test_transform_unequal_images_fail_naming_the_column(spark, keras_path):
    from pyspark.errors import PythonException

    from sparkcnn.inference import bad_input_in
    from sparkcnn.ml import SparkCNNModel

    df = spark.createDataFrame([(bytes(784),), (bytes(700),)], "image binary")
    with pytest.raises(PythonException) as e:
        SparkCNNModel.from_keras(keras_path).transform(df).collect()
    assert "images of unequal size" in str(bad_input_in(e.value))


def test_estimator_params_map_to_config_and_persist(spark, tmp_path):
    from sparkcnn import config
    from sparkcnn.ml import SparkCNNClassifier

    clf = SparkCNNClassifier(epochs=2, lr=0.01, compression="topk", density=0.01, engineMode="async",
                             imageShape=[28, 28, 1], labelCol="y", seed=5)
    clf.setStepsPerRound(7).setBatchSize(16)
    overrides = clf.config_overrides()
    cfg = config.load(None, overrides)
    assert (cfg.train.epochs, cfg.train.lr, cfg.train.steps_per_round, cfg.train.batch_size) == (2, 0.01, 7, 16)
    assert (cfg.compression.method, cfg.compression.density, cfg.engine.mode) == ("topk", 0.01, "async")
    assert (cfg.data.image_shape, cfg.run.seed) == ([28, 28, 1], 5)
    assert not any(o.startswith("train.momentum=") for o in overrides)  # unset: config's value
    clf.save(str(tmp_path / "clf"))
    back = SparkCNNClassifier.load(str(tmp_path / "clf"))
    assert back.config_overrides() == overrides and back.getLabelCol() == "y"


@pytest.fixture(scope="module")
def rows_4000(spark):
    """4,000 rows with the columns the Estimator checks (what it counts; nothing trains on them)."""
    return spark.range(4000).selectExpr("binary(string(id)) AS image", "int(id % 10) AS label")


def test_steps_per_round_follows_the_data_unless_set(spark, rows_4000, tmp_path, caplog):
    import logging

    from sparkcnn import config
    from sparkcnn.ml import SparkCNNClassifier, data_steps_per_round

    defaults = config.load(None)  # batch 64, H 50, 2 blocks
    assert data_steps_per_round(4000, defaults) == 7  # 2,000 rows a block: 31 steps an epoch, a quarter
    assert data_steps_per_round(60000, defaults) == 50  # 468 steps: a quarter is above the default
    assert data_steps_per_round(100, defaults) == 1  # not even one step a block: still 1
    with caplog.at_level(logging.INFO, logger="sparkcnn.ml"):
        cfg = SparkCNNClassifier(batchSize=64).training_config(rows_4000)
    assert cfg.train.steps_per_round == 7
    assert "stepsPerRound unset, using 7: at most a quarter of the 31 steps an epoch takes per block " \
           "(4000 rows in 2 blocks, batch 64)" in caplog.text
    assert SparkCNNClassifier(numBlocks=1, batchSize=64).training_config(rows_4000).train.steps_per_round == 15
    # a value the user set stays, in the Params or in the config file
    assert SparkCNNClassifier(stepsPerRound=50).training_config(rows_4000).train.steps_per_round == 50
    (tmp_path / "h.yaml").write_text("train:\n  steps_per_round: 40\n")
    (tmp_path / "b.yaml").write_text("train:\n  batch_size: 16\n")
    assert SparkCNNClassifier(configFile=str(tmp_path / "h.yaml")).training_config(rows_4000).train.steps_per_round == 40
    assert SparkCNNClassifier(configFile=str(tmp_path / "b.yaml")).training_config(rows_4000).train.steps_per_round == 31


def test_batch_size_follows_the_data_unless_set(spark, rows_4000, tmp_path, caplog):
    import logging

    from sparkcnn import config
    from sparkcnn.ml import SparkCNNClassifier, data_batch_size

    defaults = config.load(None)
    assert data_batch_size(4000, defaults) == 32  # 31 steps a block at 64, 62 at 32
    assert data_batch_size(60000, defaults) == 64  # 468 steps: the default stays
    assert data_batch_size(100, defaults) == 16  # never below 16
    assert data_batch_size(4000, config.load(None, ["data.num_blocks=1"])) == 64  # 62 steps in one block
    with caplog.at_level(logging.INFO, logger="sparkcnn.ml"):
        cfg = SparkCNNClassifier().training_config(rows_4000)
    assert (cfg.train.batch_size, cfg.train.steps_per_round) == (32, 15)  # H follows the chosen batch
    assert "batchSize unset, using 32: 62 steps an epoch per block (4000 rows in 2 blocks)" in caplog.text
    assert "stepsPerRound unset, using 15" in caplog.text
    assert SparkCNNClassifier(stepsPerRound=5).training_config(rows_4000).train.batch_size == 32
    (tmp_path / "b.yaml").write_text("train:\n  batch_size: 64\n")
    assert SparkCNNClassifier(configFile=str(tmp_path / "b.yaml")).training_config(rows_4000).train.batch_size == 64


FASHION_MNIST = "/usr/share/datasets/fashion-mnist"  # Debian package dataset-fashion-mnist (make dataset-package)


@pytest.fixture(scope="module")
def fashion_4000(spark, tmp_path_factory):
    """Real Fashion-MNIST as Parquet: the first 4,000 training images and the 10,000 test images."""
    from sparkcnn.data import idx
    from sparkcnn.data.parquet_io import write_split

    root = tmp_path_factory.mktemp("fashion-4000")
    for split, rows in (("train", 4000), ("test", None)):
        images, labels = idx.read_idx_split(FASHION_MNIST, split)
        write_split(str(root / split), images[:rows], labels[:rows], idx.FASHION_MNIST_CLASSES)
    return spark.read.parquet(str(root / "train")).cache(), spark.read.parquet(str(root / "test"))


@pytest.mark.skipif(not os.path.isdir(FASHION_MNIST), reason="dataset-fashion-mnist not installed")
def test_pipeline_fit_on_4000_fashion_mnist_rows_with_the_data_defaults(spark, fashion_4000, tmp_path):
    """Only epochs set: batchSize and stepsPerRound follow the 4,000 rows (32 and 15, not 64 and
    50, which give one exchange per epoch and about 0.70)."""
    import json

    from pyspark.ml import Pipeline
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator

    from sparkcnn.ml import SparkCNNClassifier

    train, test = fashion_4000
    assert train.count() == 4000
    clf = SparkCNNClassifier(epochs=3, imageShape=[28, 28, 1], outDir=str(tmp_path / "runs"))
    fitted = Pipeline(stages=[clf]).fit(train)
    with open(os.path.join(fitted.stages[0].getRunDir(), "summary.json"), encoding="utf-8") as fh:
        summary = json.load(fh)
    assert (summary["train_rows"], summary["epochs"], summary["steps_per_round"]) == (4000, 3, 15)
    assert summary["rounds"] == 3 * 5  # 62 steps a block: rounds of 15, 15, 15, 15, 2
    acc = MulticlassClassificationEvaluator(metricName="accuracy").evaluate(fitted.transform(test))
    print(f"\n3-epoch Pipeline fit on 4,000 Fashion-MNIST rows: test accuracy {acc:.4f} (10,000 test images)")
    assert acc >= 0.75


# -- training: needs sparkcnn.fit ------------------------------------------------------------------


def _fit_available() -> bool:
    import sparkcnn

    return hasattr(sparkcnn, "fit")


@pytest.fixture(scope="module")
def train_df(spark, tiny_data):
    return spark.read.parquet(os.path.join(tiny_data, "train")).limit(480).cache()


def _classifier(tmp_path, **kw):
    from sparkcnn.ml import SparkCNNClassifier

    return SparkCNNClassifier(epochs=1, batchSize=32, stepsPerRound=5, lr=0.05, lrWarmupEpochs=0.0,
                              lrSchedule="constant", numBlocks=2, imageShape=[28, 28, 1],
                              outDir=str(tmp_path / "runs"), **kw)


@pytest.mark.skipif(not _fit_available(), reason="sparkcnn.fit not available yet")
def test_estimator_fit_in_pipeline_transform_save_load(spark, train_df, test_df, tmp_path):
    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator

    from sparkcnn.ml import SparkCNNModel

    pipeline = Pipeline(stages=[_classifier(tmp_path, predictionCol="pred")])
    pipeline.save(str(tmp_path / "unfitted"))  # the Estimator persists as Params
    fitted = Pipeline.load(str(tmp_path / "unfitted")).fit(train_df)
    model = fitted.stages[0]
    assert isinstance(model, SparkCNNModel) and model.getPredictionCol() == "pred"
    assert os.path.isfile(os.path.join(model.getRunDir(), "model.keras"))
    out = fitted.transform(test_df)
    acc = MulticlassClassificationEvaluator(metricName="accuracy", predictionCol="pred").evaluate(out)
    assert acc > 0.3  # 10 learnable classes after one short epoch; chance is 0.1
    rows = out.limit(40).collect()
    _assert_same_as_driver(os.path.join(model.getRunDir(), "model.keras"), rows, pred="pred")
    fitted.save(str(tmp_path / "fitted"))
    again = PipelineModel.load(str(tmp_path / "fitted")).transform(test_df).limit(40).collect()
    assert [r["pred"] for r in again] == [r["pred"] for r in rows]
    np.testing.assert_array_equal([r["probability"].toArray() for r in again],
                                  [r["probability"].toArray() for r in rows])


@pytest.mark.skipif(not _fit_available(), reason="sparkcnn.fit not available yet")
def test_cross_validator_two_folds(spark, train_df, tmp_path):
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.ml.tuning import CrossValidator, ParamGridBuilder

    from sparkcnn.ml import SparkCNNModel

    clf = _classifier(tmp_path)
    grid = ParamGridBuilder().addGrid(clf.lr, [0.05]).build()
    cv = CrossValidator(estimator=clf, estimatorParamMaps=grid, numFolds=2, seed=3,
                        evaluator=MulticlassClassificationEvaluator(metricName="accuracy"))
    fitted = cv.fit(train_df)
    assert isinstance(fitted.bestModel, SparkCNNModel)
    assert len(fitted.avgMetrics) == 1 and 0.0 <= fitted.avgMetrics[0] <= 1.0


def test_estimator_missing_label_column(spark, test_df, tmp_path):
    with pytest.raises(BadInput, match=r"column 'y' not found"):
        _classifier(tmp_path, labelCol="y").fit(test_df)
