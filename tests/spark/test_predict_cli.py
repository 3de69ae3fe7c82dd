"""``sparkcnn predict`` and ``sparkcnn evaluate`` on the executors (the shared local[2] session)."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparkcnn.cli import main
from sparkcnn.data import idx
from tests.spark.test_cli import tree_digest

pytestmark = pytest.mark.spark

SHAPE = (28, 28, 1)


@pytest.fixture(scope="module")
def keras_path(tmp_path_factory):
    from sparkcnn.models import build_model

    path = str(tmp_path_factory.mktemp("pcli-model") / "m.keras")
    build_model("fmnist_cnn", SHAPE, 10, seed=2).save(path)
    return path


@pytest.fixture(scope="module")
def test_xy(tiny_data):
    from sparkcnn.data.parquet_io import read_split_numpy

    return read_split_numpy(os.path.join(tiny_data, "test"))


def driver_logits(keras_path, images):
    import keras

    model = keras.saving.load_model(keras_path, safe_mode=True)
    return model.predict(images.astype(np.float32), verbose=0).astype(np.float64)


def clear_rows(z) -> np.ndarray:
    """Rows whose top two logits are further apart than float32 rounding between batchings."""
    top2 = np.sort(z, axis=1)[:, -2:]
    return (top2[:, 1] - top2[:, 0]) > 1e-4


def write_table(path, columns: dict) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(pa.table(columns), path)
    return str(path)


def binary_images(images) -> pa.Array:
    return pa.array([im.tobytes() for im in images], pa.binary())


def run_json(capsys, argv) -> dict:
    capsys.readouterr()
    assert main([str(a) for a in argv]) == 0
    return json.loads(capsys.readouterr().out)


# -- predict ------------------------------------------------------------------------------------------


def test_predict_unlabelled_keeps_id_columns(spark, capsys, keras_path, test_xy, tmp_path):
    x, _ = test_xy
    n = 60
    names = [f"img-{i:03d}" for i in range(n)]
    ids = np.arange(1000, 1000 + n, dtype=np.int64)
    src = write_table(tmp_path / "unlabelled" / "part-0.parquet",
                      {"name": pa.array(names), "idx": pa.array(ids), "pixels": binary_images(x[:n])})
    out = tmp_path / "preds"
    result = run_json(capsys, ["predict", "--model", keras_path, "--data", os.path.dirname(src),
                               "--image-col", "pixels", "--id-cols", "name,idx", "--out", out])
    assert result == {"rows": n, "out": str(out)}
    table = pq.read_table(out)
    assert table.column_names == ["name", "idx", "prediction", "probability"]
    got = table.to_pydict()
    order = np.argsort(got["idx"])
    assert [got["name"][i] for i in order] == names and [got["idx"][i] for i in order] == ids.tolist()
    z = driver_logits(keras_path, x[:n])
    pred = np.array(got["prediction"])[order]
    clear = clear_rows(z)
    assert clear.mean() > 0.9 and (pred[clear] == z[clear].argmax(axis=1)).all()
    prob = np.array([got["probability"][i] for i in order])
    e = np.exp(z - z.max(axis=1, keepdims=True))
    np.testing.assert_allclose(prob, e / e.sum(axis=1, keepdims=True), rtol=1e-4, atol=1e-6)
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_predict_prepared_split_names_classes(spark, capsys, keras_path, tiny_data, tmp_path):
    out = tmp_path / "p"
    result = run_json(capsys, ["predict", "--model", keras_path, "--data", os.path.join(tiny_data, "test"),
                               "--id-cols", "label", "--out", out])
    assert result["rows"] == 400
    got = pq.read_table(out).to_pydict()
    assert list(got) == ["label", "prediction", "class", "probability"]
    assert all(c == idx.FASHION_MNIST_CLASSES[p] for c, p in zip(got["class"], got["prediction"]))


def test_predict_replaces_earlier_output(spark, capsys, keras_path, tiny_data, tmp_path):
    out = tmp_path / "p"
    out.mkdir()
    (out / "stale.parquet").write_bytes(b"old")
    run_json(capsys, ["predict", "--model", keras_path, "--data", os.path.join(tiny_data, "test"), "--out", out])
    assert not (out / "stale.parquet").exists() and pq.read_table(out).num_rows == 400


# -- evaluate -----------------------------------------------------------------------------------------


def test_evaluate_prints_accuracy_and_writes_confusion_png(spark, capsys, keras_path, tiny_data, test_xy,
                                                            tmp_path):
    x, y = test_xy
    out = tmp_path / "eval"
    result = run_json(capsys, ["evaluate", "--model", keras_path, "--data", os.path.join(tiny_data, "test"),
                               "--out", out])
    z = driver_logits(keras_path, x)
    clear = clear_rows(z)
    assert result["samples"] == 400 and result["out"] == str(out)
    assert abs(result["test_accuracy"] - float((z.argmax(axis=1) == y).mean())) <= (~clear).sum() / 400
    logp = z - z.max(axis=1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(axis=1, keepdims=True))
    assert result["test_loss"] == pytest.approx(float(-logp[np.arange(400), y].mean()), rel=1e-4)
    m = np.array(result["confusion_matrix"])
    assert m.shape == (10, 10) and m.sum() == 400 and (m.sum(axis=1) == np.bincount(y, minlength=10)).all()
    assert result["classes"] == list(idx.FASHION_MNIST_CLASSES)
    with open(out / "confusion_matrix.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "metrics.json").read_text()) == result
    preds = pq.read_table(out / "predictions")
    assert preds.num_rows == 400 and {"label", "prediction", "probability", "loss"} <= set(preds.column_names)


def test_evaluate_without_out_prints_json_only(spark, capsys, keras_path, tiny_data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run_json(capsys, ["evaluate", "--model", keras_path, "--data", tiny_data])  # the test split
    assert result["samples"] == 400 and result["classes"] == list(idx.FASHION_MNIST_CLASSES) and 0.0 <= result["test_accuracy"] <= 1.0 and np.isfinite(result["test_loss"])
    assert os.listdir(tmp_path) == []


# -- bad input: exit 2, one line naming the column or value, nothing written --------------------------


def _imgs(n, size=784):
    return [bytes(size)] * n


def missing_column(tmp, tiny):
    return "predict", ["--data", os.path.join(tiny, "test"), "--image-col", "pixels"], r"no column 'pixels'"


def missing_id_column(tmp, tiny):
    return "predict", ["--data", os.path.join(tiny, "test"), "--id-cols", "label,nope"], r"no column 'nope'"


def missing_label_column(tmp, tiny):
    src = write_table(tmp / "nolabel" / "a.parquet", {"image": pa.array(_imgs(3), pa.binary())})
    return "evaluate", ["--data", os.path.dirname(src)], r"no column 'label' \(--label-col"


def wrong_image_type(tmp, tiny):
    src = write_table(tmp / "strings" / "a.parquet", {"image": pa.array(["x", "y"])})
    return "predict", ["--data", src], r"column 'image': type string is not an image column"


def wrong_label_type(tmp, tiny):
    src = write_table(tmp / "strlabel" / "a.parquet",
                      {"image": pa.array(_imgs(2), pa.binary()), "label": pa.array(["a", "b"])})
    return "evaluate", ["--data", src], r"column 'label' has type string, expected an integer type"


def unequal_sizes(tmp, tiny):
    src = write_table(tmp / "unequal" / "a.parquet",
                      {"image": pa.array([bytes(784), bytes(700), bytes(784)], pa.binary())})
    return "predict", ["--data", src], r"column 'image': images of unequal size \(700 to 784 bytes\)"


def wrong_size(tmp, tiny):
    src = write_table(tmp / "small" / "a.parquet", {"image": pa.array(_imgs(2, 64), pa.binary())})
    return "predict", ["--data", src], r"images have 64 bytes, the model expects 28x28x1 \(784 bytes\)"


def label_out_of_range(tmp, tiny):
    src = write_table(tmp / "labels" / "a.parquet",
                      {"image": pa.array(_imgs(3), pa.binary()), "label": pa.array([1, 12, 3], pa.int32())})
    return "evaluate", ["--data", src], r"column 'label': label 12 outside \[0, 10\)"


def empty_data(tmp, tiny):
    src = write_table(tmp / "empty" / "a.parquet", {"image": pa.array([], pa.binary())})
    return "predict", ["--data", src], r"a\.parquet: no rows"


def missing_table(tmp, tiny):
    return "evaluate", ["--table", "no_such_table_here"], r"--table no_such_table_here: no such table"


def undecodable_image(tmp, tiny):
    from PIL import Image

    folder = tmp / "pngs" / "cat"
    folder.mkdir(parents=True)
    Image.fromarray(np.zeros((28, 28), np.uint8)).save(folder / "ok.png")
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not a png")
    return "predict", ["--data", tmp / "pngs"], r"broken\.png: image file does not decode \(column 'image'\)"


BAD = [missing_column, missing_id_column, missing_label_column, wrong_image_type, wrong_label_type,
       unequal_sizes, wrong_size, label_out_of_range, empty_data, missing_table, undecodable_image]


@pytest.mark.parametrize("case", BAD, ids=[c.__name__ for c in BAD])
def test_bad_input_exits_2_and_writes_nothing(spark, capsys, keras_path, tiny_data, tmp_path, case):
    command, args, pattern = case(tmp_path / "in", tiny_data)
    outputs = tmp_path / "outputs"
    (outputs / "old").mkdir(parents=True)
    (outputs / "old" / "part-0.parquet").write_bytes(b"earlier output")
    before = tree_digest(outputs)
    capsys.readouterr()
    rc = main([command, "--model", keras_path, *map(str, args), "--out", str(outputs / "old")])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith(f"sparkcnn {command}: error: ") and err.count("\n") == 1, err
    assert re.search(pattern, err), err
    assert tree_digest(outputs) == before


def test_image_folder_predict_passes_file_names(spark, capsys, keras_path, tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(3, 28, 28), dtype=np.uint8)
    for i, im in enumerate(images):
        (tmp_path / "imgs" / "any").mkdir(parents=True, exist_ok=True)
        Image.fromarray(im).save(tmp_path / "imgs" / "any" / f"{i}.png")
    out = tmp_path / "p"
    run_json(capsys, ["predict", "--model", keras_path, "--data", tmp_path / "imgs", "--id-cols", "origin",
                      "--out", out])
    got = pq.read_table(out).to_pydict()
    order = np.argsort([os.path.basename(o) for o in got["origin"]])
    z = driver_logits(keras_path, images[..., None])
    prob = np.array(got["probability"])[order]
    e = np.exp(z - z.max(axis=1, keepdims=True))
    np.testing.assert_allclose(prob, e / e.sum(axis=1, keepdims=True), rtol=1e-4, atol=1e-6)
