"""The command line's bad-input contract, in process and without Spark.

Every bad input makes ``main(argv)`` return 2 with exactly one stderr line that
names the file, field or value at fault, and leaves earlier outputs (a prepared
dataset at ``--out``, a predictions CSV, a run directory) byte for byte as they
were. An autouse fixture replaces the one Spark entry point with a test
failure, so a command that would start Spark fails loudly instead.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import pickle
import re
import shlex
import types

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparkcnn.cli import main
from sparkcnn.data import idx
from sparkcnn.data.parquet_io import write_split
from sparkcnn.data.prepare import prepare
from sparkcnn.data.synthetic import make_fake_fashion, write_cifar_bin, write_cifar_py, write_idx
from sparkcnn.errors import BadInput

RNG = np.random.default_rng(11)
N_TRAIN, N_TEST = 20, 10  # rows of the tiny fake Fashion-MNIST used throughout


# ---------------------------------------------------------------- helpers


def tree_digest(root) -> dict:
    """{relative path: sha256, or None for a directory} of everything under `root`."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs:
            out[os.path.relpath(os.path.join(dirpath, name), root)] = None
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def assert_bad(capsys, argv, pattern: str, keep=()) -> str:
    """`main(argv)` returns 2, prints one stderr line matching `pattern`, and
    leaves every file and directory under each path in `keep` unchanged."""
    before = {str(p): tree_digest(p) for p in keep}
    capsys.readouterr()
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # argparse rejects a bad command line by raising SystemExit(2)
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, f"exit {rc}, stderr: {err!r}"
    assert err.endswith("\n") and err.count("\n") == 1, f"not exactly one line: {err!r}"
    assert re.search(pattern, err), f"{pattern!r} not in {err!r}"
    for p in keep:
        assert tree_digest(p) == before[str(p)], f"{p} changed"
    return err


def rand_images(n, h=28, w=28, c=1):
    return RNG.integers(0, 256, size=(n, h, w, c), dtype=np.uint8)


def split_file(src, split, which) -> str:
    """Path of the images (which=0) or labels (which=1) .gz file of `split` in `src`."""
    return os.path.join(src, idx.SPLIT_FILES[split][which] + ".gz")


def q(path) -> str:
    return re.escape(str(path))


# ---------------------------------------------------------------- fixtures


@pytest.fixture(autouse=True)
def no_spark(monkeypatch):
    """Fail the test if anything tries to start Spark (engine/ is the only way in)."""

    def refuse(*args, **kwargs):
        pytest.fail("a bad-input command tried to start Spark")

    monkeypatch.setattr("sparkcnn.backends.session.get_or_create_spark", refuse)


@pytest.fixture()
def old_dataset(tmp_path):
    """A previously prepared dataset at outputs/ds; returns (outputs dir, ds)."""
    outputs = tmp_path / "outputs"
    prepare("idx", make_fake_fashion(str(tmp_path / "old-raw"), N_TRAIN, N_TEST, seed=5), outputs / "ds")
    return outputs, outputs / "ds"


@pytest.fixture(scope="module")
def tiny_prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-data")
    out = root / "prepared"
    prepare("idx", make_fake_fashion(str(root / "raw"), N_TRAIN, N_TEST, seed=2), out)
    return out


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    from sparkcnn.models import build_model

    path = tmp_path_factory.mktemp("cli-model") / "m.keras"
    build_model("fmnist_cnn", (28, 28, 1), 10).save(path)
    return path


@pytest.fixture(scope="module")
def small_images(tmp_path_factory):
    """A prepared split of 8x8x1 images (the CNN expects 28x28x1)."""
    split = tmp_path_factory.mktemp("cli-small") / "test"
    write_split(str(split), rand_images(5, 8, 8, 1), np.arange(5, dtype=np.int32), idx.FASHION_MNIST_CLASSES)
    return split


@pytest.fixture()
def runs(tmp_path):
    """run.out_dir holding one earlier run directory."""
    old = tmp_path / "runs" / "old-run"
    old.mkdir(parents=True)
    (old / "config.yaml").write_text("train:\n  epochs: 1\n")
    (old / "metrics.jsonl").write_text('{"round": 1, "loss": 2.3}\n')
    (old / "model.keras").write_bytes(b"stand-in for a saved model")
    return tmp_path / "runs"


# ---------------------------------------------------------------- prepare: raw files


def _fake(src):
    make_fake_fashion(str(src), N_TRAIN, N_TEST, seed=1)


def idx_wrong_magic(src):
    _fake(src)
    p = split_file(src, "train", 0)
    write_idx(p, np.zeros(N_TRAIN, np.uint8))  # a labels file where the images belong
    return q(p) + r": bad IDX magic 0x00000801, expected 0x00000803"


def idx_truncated(src):
    _fake(src)
    p = split_file(src, "train", 0)
    write_idx(p, rand_images(N_TRAIN))
    os.truncate(p, os.path.getsize(p) - 100)
    return q(p) + r": IDX data truncated: \d+ bytes, header dims \(20, 28, 28\)"


def idx_trailing_bytes(src):
    _fake(src)
    p = split_file(src, "test", 1)
    write_idx(p, np.arange(N_TEST, dtype=np.uint8) % 10)
    with open(p, "ab") as f:
        f.write(b"\0\0\0")
    return q(p) + r": 3 trailing bytes after IDX data"


def idx_label_out_of_range(src):
    _fake(src)
    p = split_file(src, "train", 1)
    labels = np.arange(N_TRAIN, dtype=np.uint8) % 10
    labels[7] = 10
    write_idx(p, labels, gz=True)
    return q(p) + r": label 10 at record 7 out of range \[0, 10\)"


def idx_count_mismatch(src):
    _fake(src)
    write_idx(split_file(src, "train", 1), np.zeros(N_TRAIN - 1, np.uint8), gz=True)
    return q(split_file(src, "train", 0)) + r": 20 images but .*train-labels.* has 19 labels"


def idx_corrupt_gzip(src):
    _fake(src)
    p = split_file(src, "test", 0)
    os.truncate(p, os.path.getsize(p) // 2)
    return q(p) + r": corrupt or truncated gzip data"


def idx_missing_file(src):
    _fake(src)
    os.remove(split_file(src, "test", 1))
    return q(src) + r": no t10k-labels-idx1-ubyte or t10k-labels-idx1-ubyte\.gz found"


def idx_empty(src):
    _fake(src)
    write_idx(split_file(src, "train", 0), np.zeros((0, 28, 28), np.uint8), gz=True)
    write_idx(split_file(src, "train", 1), np.zeros(0, np.uint8), gz=True)
    return q(src) + r": empty dataset: split 'train' has no records"


def idx_missing_source(src):
    return q(src) + r": source directory not found"


def idx_height_contradicts(src):  # run with --height 30
    _fake(src)
    return q(src) + r": height=30 given but the images have height 28"


def _cifar_bin(src, train_labels=(0, 1, 2, 3)):
    os.makedirs(src)
    write_cifar_bin(os.path.join(src, "data_batch_1.bin"), rand_images(len(train_labels), 32, 32, 3), train_labels)
    write_cifar_bin(os.path.join(src, "test_batch.bin"), rand_images(2, 32, 32, 3), [4, 5])


def cifar_bin_length(src):
    _cifar_bin(src)
    p = os.path.join(src, "data_batch_1.bin")
    with open(p, "ab") as f:
        f.write(b"12345")
    return q(p) + r": length 12297 bytes is not a multiple of the 3073-byte CIFAR-10 record"


def cifar_bin_label_out_of_range(src):
    _cifar_bin(src, train_labels=(0, 1, 10, 3))
    return q(os.path.join(src, "data_batch_1.bin")) + r": label 10 at record 2 out of range \[0, 10\)"


def cifar_bin_batch_gap(src):
    _cifar_bin(src)
    os.rename(os.path.join(src, "data_batch_1.bin"), os.path.join(src, "data_batch_2.bin"))
    return q(src) + r": data_batch_1\.bin is missing \(found batches \[2\]\)"


PARQUET_DIMS = ["--height", "2", "--width", "2", "--channels", "1"]  # 2x2 grey: 4 bytes an image


def _parquet(src, **columns) -> str:
    """Write `columns` as src/input.parquet; returns its path as a regex."""
    os.makedirs(src)
    pq.write_table(pa.table(columns), os.path.join(src, "input.parquet"))
    return q(os.path.join(src, "input.parquet"))


def parquet_missing_label(src):
    return _parquet(src, image=pa.array([b"\0" * 4] * 3)) + r": missing column 'label' \(columns: image\)"


def parquet_image_dtype(src):
    return (_parquet(src, image=pa.array([1, 2, 3], pa.int64()), label=pa.array([0, 1, 2], pa.int32()))
            + r": column 'image' has type int64, expected binary or list<uint8>")


def parquet_label_dtype(src):
    return (_parquet(src, image=pa.array([b"\0" * 4] * 3), label=pa.array(["a", "b", "c"]))
            + r": column 'label' has type string, expected an integer type")


def parquet_image_lengths(src):
    return (_parquet(src, image=pa.array([b"\0" * 4, b"\0" * 4, b"\0" * 3]), label=pa.array([0, 1, 2], pa.int32()))
            + r": row 2: column 'image' has 3 bytes, expected 4")


def parquet_shape_unknown(src):  # run without PARQUET_DIMS and no sparkcnn.* metadata
    _parquet(src, image=pa.array([b"\0" * 4] * 3), label=pa.array([0, 1, 2], pa.int32()))
    return q(src) + r": image height/width/channels unknown"


PREPARE_SOURCE_CASES = [  # (format, writes a bad source and returns the expected message, extra args)
    ("idx", idx_wrong_magic, []), ("idx", idx_truncated, []), ("idx", idx_trailing_bytes, []),
    ("idx", idx_label_out_of_range, []), ("idx", idx_count_mismatch, []), ("idx", idx_corrupt_gzip, []),
    ("idx", idx_missing_file, []), ("idx", idx_empty, []), ("idx", idx_missing_source, []),
    ("idx", idx_height_contradicts, ["--height", "30"]),
    ("cifar10-bin", cifar_bin_length, []), ("cifar10-bin", cifar_bin_label_out_of_range, []),
    ("cifar10-bin", cifar_bin_batch_gap, []),
    ("parquet", parquet_missing_label, PARQUET_DIMS), ("parquet", parquet_image_dtype, PARQUET_DIMS),
    ("parquet", parquet_label_dtype, PARQUET_DIMS), ("parquet", parquet_image_lengths, PARQUET_DIMS),
    ("parquet", parquet_shape_unknown, []),
]


@pytest.mark.parametrize("fmt,make,extra", PREPARE_SOURCE_CASES, ids=[c[1].__name__ for c in PREPARE_SOURCE_CASES])
def test_prepare_rejects_bad_source_and_keeps_old_dataset(capsys, tmp_path, old_dataset, fmt, make, extra):
    outputs, ds = old_dataset
    src = str(tmp_path / "src")
    pattern = make(src)
    # Hashing all of outputs/ also catches a left-over ds.tmp-* or ds.old-* beside ds.
    assert_bad(capsys, ["prepare", "--format", fmt, "--source", src, "--out", ds, *extra], pattern,
               keep=[outputs])


class _RunsShell:
    """Unpickles to ``os.system("touch <marker>")``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(self.marker)}",)


@pytest.mark.parametrize("where", ["data_batch_1", "batches.meta"])
def test_prepare_refuses_malicious_cifar_pickle(capsys, tmp_path, old_dataset, where):
    outputs, ds = old_dataset
    src = tmp_path / "src"
    src.mkdir()
    write_cifar_py(str(src / "data_batch_1"), rand_images(3, 32, 32, 3), [0, 1, 2])
    write_cifar_py(str(src / "test_batch"), rand_images(2, 32, 32, 3), [3, 4])
    (src / where).write_bytes(pickle.dumps({b"data": _RunsShell(tmp_path / "pwned")}, protocol=2))

    # Control: under plain pickle the same payload does run its command.
    pickle.loads(pickle.dumps(_RunsShell(tmp_path / "control"), protocol=2))
    assert (tmp_path / "control").exists()

    assert_bad(capsys, ["prepare", "--format", "cifar10-py", "--source", src, "--out", ds],
               q(src / where) + r": refused to unpickle global (posix|nt|os)\.system", keep=[outputs])
    assert not (tmp_path / "pwned").exists()


def _blocked_by_file(tmp_path):
    (tmp_path / "blocker").write_text("a regular file\n")
    return tmp_path / "blocker" / "ds", r": output directory is not writable", tmp_path / "blocker"


def _out_is_file(tmp_path):
    (tmp_path / "ds").write_text("not a dataset\n")
    return tmp_path / "ds", r": output exists and is not a directory", tmp_path / "ds"


def _out_is_foreign_dir(tmp_path):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "notes.txt").write_text("someone's work\n")
    return tmp_path / "ds", r": refusing to replace a directory that is not a prepared dataset", tmp_path / "ds"


@pytest.mark.parametrize("setup", [_blocked_by_file, _out_is_file, _out_is_foreign_dir],
                         ids=["out_under_regular_file", "out_is_regular_file", "out_is_foreign_dir"])
def test_prepare_rejects_unusable_out(capsys, tmp_path, setup):
    src = make_fake_fashion(str(tmp_path / "raw"), N_TRAIN, N_TEST)
    out, message, blocker = setup(tmp_path)
    assert_bad(capsys, ["prepare", "--format", "idx", "--source", src, "--out", out], q(out) + message,
               keep=[blocker])
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n or ".old-" in n]


def test_prepare_rejects_unknown_format(capsys, tmp_path, old_dataset):
    outputs, ds = old_dataset
    assert_bad(capsys, ["prepare", "--format", "mnist", "--source", tmp_path, "--out", ds],
               r"argument --format: invalid choice: 'mnist'", keep=[outputs])


# ---------------------------------------------------------------- train: config and data


def _write(path, text):
    path.write_text(text)
    return path


def cfg_set_unknown_key(tmp_path):
    return ["--set", "train.nosuch=1"], r"unknown config key 'train\.nosuch'"


def cfg_set_unknown_section(tmp_path):
    return ["--set", "nosuch.key=1"], r"unknown config key 'nosuch'"


def cfg_yaml_unknown_key(tmp_path):
    p = _write(tmp_path / "c.yaml", "train:\n  epochs: 1\n  nosuch: 2\n")
    return ["--config", p], q(p) + r": unknown config key 'train\.nosuch'"


def cfg_bad_value(tmp_path):
    return ["--set", "compression.density=1.5"], r"compression\.density must be in \(0, 1\], got 1\.5"


def cfg_wrong_type(tmp_path):
    return ["--set", "train.epochs=three"], r"train\.epochs must be an integer, got 'three'"


def cfg_yaml_section_not_mapping(tmp_path):
    p = _write(tmp_path / "c.yaml", "train: 5\n")
    return ["--config", p], q(p) + r": train must be a mapping, got 5"


def cfg_invalid_yaml(tmp_path):
    p = _write(tmp_path / "c.yaml", "train:\n  epochs: [1, 2\n")
    return ["--config", p], q(p) + r" line \d+: not valid YAML"


def cfg_missing_file(tmp_path):
    p = tmp_path / "absent.yaml"
    return ["--config", p], r"config file not found: " + q(p)


def data_path_missing(tmp_path):
    p = tmp_path / "nothing"
    return ["--set", f"data.path={p}"], r"data\.path '" + q(p) + r"': no prepared split at " + q(p / "train")


def data_path_unprepared(tmp_path):
    p = tmp_path / "raw-parquet"
    for split in ("train", "test"):  # Parquet, but without the sparkcnn.* metadata
        (p / split).mkdir(parents=True)
        pq.write_table(pa.table({"image": [b"\0"], "label": [0]}), p / split / "part-00000.parquet")
    return (["--set", f"data.path={p}"],
            q(p / "train" / "part-00000.parquet") + r": not a prepared sparkcnn split \(metadata lacks")


def data_too_many_blocks(tmp_path):
    return ["--set", "data.num_blocks=50"], r"data\.num_blocks=50 exceeds the 20 training rows"


def run_out_dir_unwritable(tmp_path):
    p = tmp_path / "runs" / "old-run" / "config.yaml" / "nested"  # under a regular file
    return ["--set", f"run.out_dir={p}"], r"run\.out_dir '" + q(p) + r"': cannot create run directory"


TRAIN_CASES = [cfg_set_unknown_key, cfg_set_unknown_section, cfg_yaml_unknown_key, cfg_bad_value,
               cfg_wrong_type, cfg_yaml_section_not_mapping, cfg_invalid_yaml, cfg_missing_file,
               data_path_missing, data_path_unprepared, data_too_many_blocks, run_out_dir_unwritable]


@pytest.mark.parametrize("case", TRAIN_CASES, ids=[c.__name__ for c in TRAIN_CASES])
def test_train_rejects_bad_config_before_spark(capsys, tmp_path, runs, tiny_prepared, case):
    extra, pattern = case(tmp_path)
    # --set flags after `extra` win, so each case's own data.path / run.out_dir is applied last.
    assert_bad(capsys, ["train", "--no-progress", "--set", f"data.path={tiny_prepared}",
                        "--set", f"run.out_dir={runs}", *extra], pattern, keep=[runs])
    # the no_spark fixture fails the test if Spark were started before the error


# ---------------------------------------------------------------- model builders

NOT_A_BUILDER = 42


def builder_returns_list(input_shape, num_classes):
    return [input_shape, num_classes]


def builder_three_units(input_shape, num_classes):
    import keras

    return keras.Sequential([keras.Input(shape=input_shape), keras.layers.Flatten(), keras.layers.Dense(3)])


def builder_raises(input_shape, num_classes):
    raise RuntimeError("no GPU here")


def test_tests_is_a_package():
    """Builders below are referenced as ``tests.spark.test_cli:<fn>``."""
    assert importlib.import_module("tests.spark.test_cli").builder_three_units is builder_three_units
    assert os.path.isfile(os.path.join(os.path.dirname(__file__), "__init__.py"))


@pytest.mark.parametrize("name,pattern", [
    ("no_such_net", r"model\.name 'no_such_net': unknown builder \(known: fmnist_cnn, resnet20"),
    ("sparkcnn_no_such_module:build", r"cannot import module 'sparkcnn_no_such_module'"),
    ("tests.spark.test_cli:no_such_builder", r"module 'tests\.spark\.test_cli' has no callable 'no_such_builder'"),
    ("tests.spark.test_cli:NOT_A_BUILDER", r"module 'tests\.spark\.test_cli' has no callable 'NOT_A_BUILDER'"),
    ("tests.spark.test_cli:builder_returns_list", r"builder returned list, not a keras\.Model"),
    ("tests.spark.test_cli:builder_three_units", r"output has 3 units, dataset has 10 classes"),
    ("tests.spark.test_cli:builder_raises", r"builder raised RuntimeError: no GPU here"),
], ids=["unknown_name", "missing_module", "missing_function", "not_callable", "returns_non_model",
        "units_mismatch", "builder_raises"])
def test_build_model_rejects_bad_builder(name, pattern):
    from sparkcnn.models import build_model

    with pytest.raises(BadInput, match=pattern) as info:
        build_model(name, (28, 28, 1), 10)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name,pattern", [
    ("tests.spark.test_cli:builder_three_units", r"model\.name 'tests\.spark\.test_cli:builder_three_units': "
                                                 r"output has 3 units, dataset has 10 classes"),
    ("no_such_net", r"model\.name 'no_such_net': unknown builder"),
])
def test_train_rejects_bad_builder(capsys, runs, tiny_prepared, name, pattern):
    assert_bad(capsys, ["train", "--no-progress", "--set", f"data.path={tiny_prepared}",
                        "--set", f"run.out_dir={runs}", "--set", f"model.name={name}"],
               pattern, keep=[runs / "old-run"])


def test_train_bad_builder_leaves_no_run_dir(capsys, runs, tiny_prepared):
    assert_bad(capsys, ["train", "--no-progress", "--set", f"data.path={tiny_prepared}",
                        "--set", f"run.out_dir={runs}", "--set", "model.name=no_such_net"],
               r"unknown builder", keep=[runs])


# ---------------------------------------------------------------- evaluate / predict


@pytest.fixture()
def old_csv(tmp_path):
    d = tmp_path / "preds"
    d.mkdir()
    (d / "old.csv").write_text("row,label,predicted,class\n0,1,1,Trouser\n")
    return d / "old.csv"


def model_missing(tmp_path, fx):
    p = tmp_path / "absent.keras"
    return ["--model", p, "--data", fx.test_dir], r"--model: no model file at " + q(p)


def model_dir_without_model(tmp_path, fx):
    run_dir = tmp_path / "a-run"
    run_dir.mkdir()
    return ["--model", run_dir, "--data", fx.test_dir], r"no model file at " + q(run_dir / "model.keras")


def model_not_keras(tmp_path, fx):
    p = tmp_path / "junk.keras"
    p.write_bytes(b"PK\x03\x04 this is not a Keras archive")
    return ["--model", p, "--data", fx.test_dir], q(p) + r": not a loadable Keras model"


def data_shape_differs(tmp_path, fx):
    return (["--model", fx.model, "--data", fx.small],
            q(fx.small) + r": images are 8x8x1, the model expects 28x28x1")


def data_missing(tmp_path, fx):
    p = tmp_path / "no-split"
    return ["--model", fx.model, "--data", p], q(p) + r": no such Parquet file or directory"


MODEL_CASES = [model_missing, model_dir_without_model, model_not_keras, data_shape_differs, data_missing]


@pytest.mark.parametrize("command", ["evaluate", "predict"])
@pytest.mark.parametrize("case", MODEL_CASES, ids=[c.__name__ for c in MODEL_CASES])
def test_evaluate_predict_reject_bad_model_or_data(capsys, tmp_path, saved_model, tiny_prepared,
                                                   small_images, old_csv, command, case):
    fx = types.SimpleNamespace(model=saved_model, test_dir=tiny_prepared / "test", small=small_images)
    extra, pattern = case(tmp_path, fx)
    out = ["--out", old_csv] if command == "predict" else []
    assert_bad(capsys, [command, *extra, *out], pattern, keep=[old_csv.parent])


def test_predict_into_missing_dir_keeps_other_csv(capsys, tmp_path, saved_model, tiny_prepared, old_csv):
    out = tmp_path / "no-such-dir" / "p.csv"
    assert_bad(capsys, ["predict", "--model", saved_model, "--data", tiny_prepared / "test", "--out", out],
               r"--out " + q(out) + r": directory " + q(out.parent) + r" is missing or not writable",
               keep=[old_csv.parent])
    assert not out.parent.exists()


# ---------------------------------------------------------------- positive paths


def test_prepare_ok_prints_json(capsys, tmp_path):
    src = make_fake_fashion(str(tmp_path / "raw"), N_TRAIN, N_TEST)
    assert main(["prepare", "--format", "idx", "--source", src, "--out", str(tmp_path / "ds")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["splits"]["train"]["rows"] == N_TRAIN and summary["splits"]["test"]["rows"] == N_TEST
    assert (summary["height"], summary["width"], summary["channels"]) == (28, 28, 1)
    assert sorted(os.listdir(tmp_path / "ds")) == ["sparkcnn.json", "test", "train"]
    with open(tmp_path / "ds" / "sparkcnn.json") as fh:
        meta = json.load(fh)["splits"]
    assert (meta["train"]["rows"], meta["test"]["rows"], meta["train"]["height"]) == (N_TRAIN, N_TEST, 28)
