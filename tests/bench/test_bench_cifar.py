"""bench/cifar.py's data: a seeded random sample of a prepared CIFAR-10 whose splits hold the
images class by class, as make data-cifar10 prepares them (the benchmark's Spark training is not
run here)."""

import importlib
import json
import os

import numpy as np
import pytest

from sparkcnn.data.parquet_io import META_MEAN, META_STD, read_meta, read_split_numpy, write_split

bc = importlib.import_module("bench.cifar")
CLASSES = [f"c{k}" for k in range(10)]


@pytest.fixture(scope="module")
def by_class(tmp_path_factory):
    """A prepared CIFAR-10-shaped dataset ordered by class, each image marked with its row."""
    root = tmp_path_factory.mktemp("cifar") / "prepared"
    for split, per in (("train", 30), ("test", 10)):
        y = np.repeat(np.arange(10), per)
        x = np.zeros((len(y), 32, 32, 3), np.uint8)
        x[:, 0, 0, 0], x[:, 0, 0, 1], x[:, 0, 0, 2] = np.arange(len(y)) % 256, y, np.arange(len(y)) // 256
        stats = {META_MEAN: json.dumps([0.5, 0.4, 0.3]), META_STD: json.dumps([0.2, 0.2, 0.2])}
        extra = stats if split == "train" else {}
        write_split(str(root / split), x, y, CLASSES, extra=extra)
    return str(root)


def test_the_sample_mixes_every_class_and_keeps_the_pixel_statistics(by_class):
    out = bc.sample_cifar(by_class, 50, 20, seed=3)
    x, y = read_split_numpy(os.path.join(out, "train"))
    assert len(y) == 50 and set(y) == set(range(10))  # the first 50 rows would be classes 0 and 1
    np.testing.assert_array_equal(x[:, 0, 0, 1], y)  # each image kept with its own label
    rows = x[:, 0, 0, 0].astype(int) + 256 * x[:, 0, 0, 2].astype(int)
    assert np.all(np.diff(rows) > 0)  # rows in their order in the source
    meta = read_meta(os.path.join(out, "train"))
    assert meta.mean == pytest.approx((0.5, 0.4, 0.3)) and meta.std == pytest.approx((0.2, 0.2, 0.2))
    assert len(read_split_numpy(os.path.join(out, "test"))[1]) == 20
    assert out.endswith("-sample-50-20") and bc.sample_cifar(by_class, 50, 20, seed=3) == out


def test_the_same_seed_gives_the_same_rows(by_class, tmp_path):
    a = bc.sample_cifar(by_class, 40, 10, seed=5)
    copy = tmp_path / "again"
    os.makedirs(copy)
    for split in ("train", "test"):
        x, y = read_split_numpy(os.path.join(by_class, split))
        write_split(str(copy / split), x, y, CLASSES)
    b = bc.sample_cifar(str(copy), 40, 10, seed=5)
    np.testing.assert_array_equal(read_split_numpy(os.path.join(a, "train"))[0],
                                  read_split_numpy(os.path.join(b, "train"))[0])


def test_no_prepared_data_or_not_cifar_exits_2_with_one_line(tmp_path, capsys, by_class):
    assert bc.main(["--data", str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run `make data-cifar10`" in err[0] and "absent" in err[0]
    small = tmp_path / "mnistlike"
    for split in ("train", "test"):
        write_split(str(small / split), np.zeros((4, 28, 28, 1), np.uint8), np.arange(4) % 2, ["a", "b"])
    assert bc.main(["--data", str(small)]) == 2
    assert "not CIFAR-10: 28x28x1 images, 2 classes" in capsys.readouterr().err
