"""Training data through Spark: every accepted input kind, placement into blocks, bad input."""

import os

import numpy as np
import pytest

from sparkcnn import config
from sparkcnn.data.parquet_io import read_split_numpy
from sparkcnn.errors import BadInput

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def arrays(tiny_data):
    """(images uint8 NHWC, labels) of the tiny prepared training split."""
    return read_split_numpy(os.path.join(tiny_data, "train"))


def _dcfg(**kw):
    return config.load(None, [f"data.{k}={v}" for k, v in kw.items()]).data


def _binary_df(spark, x, y):
    return spark.createDataFrame([(bytearray(a.tobytes()), int(b)) for a, b in zip(x, y)],
                                 "image binary, label int")


def _floats_df(spark, x, y):
    return spark.createDataFrame([((a.reshape(-1) / 255.0).tolist(), int(b)) for a, b in zip(x, y)],
                                 "image array<double>, label int")


def _struct_df(spark, x, y):
    from pyspark.ml.image import ImageSchema

    h, w, c = x.shape[1:]
    rows = [((f"mem://{i}", h, w, c, 16 if c == 3 else 0, bytearray(a[..., ::-1].tobytes())), int(b))
            for i, (a, b) in enumerate(zip(x, y))]
    from pyspark.sql.types import IntegerType, StructField, StructType

    schema = StructType([StructField("image", ImageSchema.imageSchema["image"].dataType),
                         StructField("label", IntegerType())])
    return spark.createDataFrame(rows, schema)


def _placed(spark, frame, blocks, run_id):
    """Place ``frame`` in ``blocks`` blocks; each block's (rows, pixel sum, label counts) read back."""
    from sparkcnn.backends.spark import SparkBackend
    from sparkcnn.models import build_model
    from sparkcnn.train import build_spec

    cfg = config.load(None, [f"data.num_blocks={blocks}"])
    model = build_model(cfg.model.name, frame.shape, len(frame.classes), 0)
    spec = build_spec(cfg, run_id, frame, None, model)
    backend = SparkBackend(spark, run_id)
    sizes = backend.place("train", frame, blocks, spec)

    def probe(block, ctx):
        from sparkcnn.worker import blockstore
        from sparkcnn.worker.task import local_root

        x, y = blockstore.get_block(local_root(spec, ctx), spec.run_id, "train", blocks, block)
        return block, len(y), int(np.asarray(x, np.int64).sum()), np.bincount(y, minlength=10).tolist()

    try:
        return sizes, sorted(backend.map_blocks(probe, list(range(blocks)), "probe", universe=blocks))
    finally:
        backend.close()


def test_every_image_kind_places_the_same_pixels(spark, arrays):
    from sparkcnn.data.source import frame

    x, y = arrays
    x, y = x[:300], y[:300]
    dcfg = _dcfg(image_shape=list(x.shape[1:]))
    seen = {}
    for name, make in (("binary", _binary_df), ("floats", _floats_df), ("struct", _struct_df)):
        fr = frame(spark, dcfg, make(spark, x, y).repartition(3))
        assert (fr.kind, fr.shape, fr.num_rows) == (name, tuple(x.shape[1:]), 300)
        sizes, probes = _placed(spark, fr, 4, f"t-kinds-{name}")
        assert sorted(sizes) == [0, 1, 2, 3] and sum(sizes.values()) == 300
        assert max(sizes.values()) - min(sizes.values()) <= 3  # round-robin: within the partition count
        assert [p[1] for p in probes] == [sizes[k] for k in range(4)]
        seen[name] = (sum(p[2] for p in probes), np.sum([p[3] for p in probes], axis=0).tolist())
    assert seen["binary"] == seen["floats"] == seen["struct"] == (int(x.astype(np.int64).sum()),
                                                                  np.bincount(y, minlength=10).tolist())


def test_image_folder_table_and_uri(spark, tiny_data, tmp_path, arrays):
    from PIL import Image

    from sparkcnn.data.source import frame, training_frames

    x, y = arrays
    rgb = np.repeat(x[:6], 3, axis=3)
    rgb[..., 0] = 255 - rgb[..., 0]  # channels differ, so BGR/RGB order matters
    for i, img in enumerate(rgb):
        d = tmp_path / "imgs" / ("boot" if i % 2 else "shirt")
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(img).save(d / f"{i}.png")
    fr = frame(spark, _dcfg(), str(tmp_path / "imgs"))
    assert (fr.kind, fr.classes, fr.num_rows, fr.shape) == ("binary", ("boot", "shirt"), 6, (28, 28, 3))
    from sparkcnn.data.frames import images_from_arrow

    got = fr.df.toArrow()  # in the folder's order: boot/1, 3, 5, then shirt/0, 2, 4
    pix = images_from_arrow(got.column("image"), fr.shape, "image", kind="binary")
    for img, i, label in zip(pix, (1, 3, 5, 0, 2, 4), got.column("label").to_pylist()):
        np.testing.assert_array_equal(img, rgb[i])
        assert label == (0 if i % 2 else 1)

    _binary_df(spark, x[:50], y[:50]).createOrReplaceTempView("sparkcnn_t_table")
    fr = frame(spark, _dcfg(image_shape=[28, 28, 1]), "sparkcnn_t_table")
    assert (fr.kind, fr.num_rows, fr.classes) == ("binary", 50, tuple(str(i) for i in range(int(y[:50].max()) + 1)))

    train, test = training_frames(spark, _dcfg(), "file://" + os.path.abspath(tiny_data))
    assert (train.num_rows, test.num_rows, train.shape, len(train.classes)) == (1200, 400, (28, 28, 1), 10)


def _bad_cases(spark, x, y, tmp_path):
    from pyspark.sql import functions as F

    df = _binary_df(spark, x[:20], y[:20])
    ragged = spark.createDataFrame([(bytearray(3), 0), (bytearray(4), 1)], "image binary, label int")
    bad_dir = tmp_path / "broken" / "cls"
    bad_dir.mkdir(parents=True)
    (bad_dir / "bad.png").write_bytes(b"\x89PNG not really")
    shape = {"image_shape": [28, 28, 1]}
    return {
        "no image column": (df.withColumnRenamed("image", "pixels"), shape, r"no column 'image'"),
        "no label column": (df.drop("label"), shape, r"no column 'label'"),
        "wrong image type": (df.withColumn("image", F.lit("x")), shape, r"column 'image': type string"),
        "wrong label type": (df.withColumn("label", F.lit("cat")), shape, r"column 'label' has type string"),
        "unequal sizes": (ragged, {"image_shape": [1, 3, 1]}, r"images of unequal size \(3 to 4 bytes\)"),
        "label out of range": (df, {**shape, "classes": ["a", "b"]}, r"column 'label': label \d+ outside \[0, 2\)"),
        "negative label": (df.withColumn("label", F.lit(-1)), shape, r"label -1 outside \[0, 0\)"),
        "empty": (df.limit(0), shape, r"no rows"),
        "no such table": ("no_such_table_xyz", {}, r"'no_such_table_xyz': no such path, and no table"),
        "undecodable image": (str(tmp_path / "broken"), {}, r"bad\.png: image file does not decode"),
    }


def test_bad_input_names_the_column_or_value(spark, arrays, tmp_path):
    from sparkcnn.data.source import frame

    x, y = arrays
    for case, (src, kw, pattern) in _bad_cases(spark, x, y, tmp_path).items():
        with pytest.raises(BadInput, match=pattern) as e:
            frame(spark, _dcfg(**kw), src)
        assert "\n" not in str(e.value), case


def test_cli_bad_data_exits_2_and_writes_nothing(spark, tmp_path, capsys):
    from sparkcnn.cli import main

    out = tmp_path / "runs"
    rc = main(["train", "--no-progress", "--set", "data.path=no_such_table_xyz", "--set", f"run.out_dir={out}"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["sparkcnn train: error: data 'no_such_table_xyz': no such path, and no table of that name"]
    assert not out.exists()


def test_fit_from_a_dataframe_in_memory(spark, arrays, tiny_data, tmp_path):
    import sparkcnn

    x, y = arrays
    xt, yt = read_split_numpy(os.path.join(tiny_data, "test"))
    df = _binary_df(spark, x, y)
    cfg = {"data": {"image_shape": [28, 28, 1], "classes": [f"c{i}" for i in range(10)], "num_blocks": 2},
           "run": {"out_dir": str(tmp_path / "runs")},
           "train": {"epochs": 2, "batch_size": 32, "steps_per_round": 5, "lr": 0.05, "lr_warmup_epochs": 0,
                     "lr_schedule": "constant"}}
    result = sparkcnn.fit(cfg, data=df, test_data=_binary_df(spark, xt, yt), spark=spark, progress=False)
    assert [e["epoch"] for e in result.history] == [0, 1]
    assert result.history[-1]["test_accuracy"] > 0.6 and result.history[-1]["test_samples"] == 400
    assert result.summary["train_rows"] == 1200 and result.summary["classes"][0] == "c0"
    assert result.summary["data"] == "data DataFrame"
    pred = np.argmax(result.model.predict(xt[:100], verbose=0), axis=-1)
    assert (pred == yt[:100]).mean() > 0.6
    fig = result.plot()
    assert len(fig.axes) == 2 and len(fig.axes[1].lines[0].get_xdata()) == 2
    assert os.path.isfile(os.path.join(result.run_dir, "model.keras"))


def test_fit_interrupted_cancels_and_keeps_a_checkpoint(spark, tiny_cfg):
    """Ctrl-C during fit: the run's Spark jobs are cancelled, a checkpoint is kept, resume finishes."""
    import sparkcnn
    from sparkcnn.metrics import read_jsonl

    class Interrupt:
        def round(self, rec, total):
            if rec["round"] == 1:  # mid-epoch (4 rounds per epoch)
                raise KeyboardInterrupt

        def epoch(self, rec):
            pass

    cfg = tiny_cfg.replace(engine__pipeline=True)
    run_dir = os.path.join(cfg.run.out_dir, "interrupted")
    with pytest.raises(KeyboardInterrupt):
        sparkcnn.fit(cfg, spark=spark, progress=Interrupt(), run_dir=run_dir)
    tracker = spark.sparkContext.statusTracker()
    assert tracker.getActiveJobsIds() == [] or all(
        tracker.getJobInfo(j).status != "RUNNING" for j in tracker.getActiveJobsIds())
    assert os.path.isdir(os.path.join(run_dir, "checkpoints"))
    result = sparkcnn.fit(None, spark=spark, progress=False, run_dir=run_dir, resume=True)
    rounds = [r["round"] for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if r["kind"] == "round"]
    assert rounds == list(range(result.summary["rounds"]))
    assert [e["epoch"] for e in result.history] == [0, 1]
