"""bench/cifar.py's generated data: byte-exact CIFAR-10 binary, deterministic, read back by the
project's reader and its prepare step (the benchmark's Spark training is not run here)."""

import importlib
import os

import numpy as np
import pytest

from sparkcnn.data.cifar import CIFAR10_CLASSES, RECORD_BYTES, read_cifar_bin_file, read_cifar_split

bc = importlib.import_module("bench.cifar")

FILES = [f"data_batch_{k}.bin" for k in range(1, 6)] + ["test_batch.bin"]


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    return bc.write_generated_cifar(str(tmp_path_factory.mktemp("cifar") / "bin"), 103, 21, seed=7)


def test_files_are_3073_byte_records_with_label_bytes(generated):
    rows = []
    for name in FILES:
        raw = np.fromfile(os.path.join(generated, name), dtype=np.uint8)
        assert raw.size > 0 and raw.size % RECORD_BYTES == 0, name
        records = raw.reshape(-1, RECORD_BYTES)
        assert records[:, 0].max() <= 9, name  # the first byte of each record is a label 0..9
        rows.append(len(records))
    assert sum(rows[:5]) == 103 and rows[5] == 21
    assert max(rows[:5]) - min(rows[:5]) <= 1  # the train rows spread over the five batches
    with open(os.path.join(generated, "batches.meta.txt"), encoding="utf-8") as f:
        assert tuple(f.read().split()) == CIFAR10_CLASSES


def test_records_decode_to_the_images_and_labels(generated):
    x, y = read_cifar_bin_file(os.path.join(generated, "data_batch_1.bin"))
    raw = np.fromfile(os.path.join(generated, "data_batch_1.bin"), dtype=np.uint8).reshape(-1, RECORD_BYTES)
    # record = label byte, then the R, G, B planes, each 32 x 32 row-major
    np.testing.assert_array_equal(y, raw[:, 0])
    np.testing.assert_array_equal(x[:, :, :, 0].reshape(len(x), -1), raw[:, 1:1025])
    np.testing.assert_array_equal(x[:, :, :, 2].reshape(len(x), -1), raw[:, 2049:])
    # the whole train split equals what the generator draws for the same seed
    rng = np.random.default_rng(7)
    labels = [(np.arange(n) % 10).astype(np.uint8) for n in (103, 21)]
    for lab in labels:
        rng.shuffle(lab)
    images = bc.generated_images(np.concatenate(labels), rng)
    xs, ys, classes = read_cifar_split(generated, "bin", "train")
    np.testing.assert_array_equal(ys, labels[0])
    np.testing.assert_array_equal(xs, images[:103])
    assert classes == CIFAR10_CLASSES
    assert np.bincount(ys, minlength=10).min() == 10  # 103 rows: every class 10 or 11 times


def test_images_depend_on_the_class(generated):
    x, y, _ = read_cifar_split(generated, "bin", "train")
    means = np.stack([x[y == c].mean(axis=0) for c in range(10)]).astype(np.float64)
    # within a class only the noise (uniform 0..65, sd ~19) varies; the per-class means differ far more
    within = np.mean([np.abs(x[y == c] - means[c]).mean() for c in range(10)])
    between = np.abs(means[:, None] - means[None, :]).mean(axis=(2, 3, 4))
    assert between[~np.eye(10, dtype=bool)].min() > 2 * within


def test_same_seed_same_bytes_other_seed_other_bytes(generated, tmp_path):
    again = bc.write_generated_cifar(str(tmp_path / "again"), 103, 21, seed=7)
    other = bc.write_generated_cifar(str(tmp_path / "other"), 103, 21, seed=8)
    for name in FILES + ["batches.meta.txt"]:
        with open(os.path.join(generated, name), "rb") as f:
            first = f.read()
        with open(os.path.join(again, name), "rb") as f:
            assert f.read() == first, name
    with open(os.path.join(other, "test_batch.bin"), "rb") as f:
        with open(os.path.join(generated, "test_batch.bin"), "rb") as g:
            assert f.read() != g.read()


def test_prepare_reads_the_generated_batches(generated, tmp_path):
    from sparkcnn.data.parquet_io import read_split_numpy
    from sparkcnn.data.prepare import prepare

    summary = prepare("cifar10-bin", generated, str(tmp_path / "prepared"))
    assert summary["splits"]["train"]["rows"] == 103 and summary["splits"]["test"]["rows"] == 21
    assert (summary["height"], summary["width"], summary["channels"]) == (32, 32, 3)
    x, y = read_split_numpy(str(tmp_path / "prepared" / "train"))
    xs, ys, _ = read_cifar_split(generated, "bin", "train")
    np.testing.assert_array_equal(x, xs)
    np.testing.assert_array_equal(y, ys)


def test_sizes_are_checked(tmp_path):
    with pytest.raises(ValueError, match="train_rows must be >= 5"):
        bc.write_generated_cifar(str(tmp_path / "x"), 4, 10)
    with pytest.raises(ValueError, match="test_rows must be >= 1"):
        bc.write_generated_cifar(str(tmp_path / "x"), 10, 0)
