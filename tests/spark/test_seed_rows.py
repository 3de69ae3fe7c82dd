"""Every seed-table row file in conf/seed/ runs, by the command a rendered row names, at a tiny size.

The command is the one ``bench/rows.py`` records for the row (``sparkcnn train --config
conf/seed/X.yaml``, or ``python bench/keras_fit.py --config conf/seed/X_keras.yaml`` for the
Keras reference), with ``--set`` overrides that only make it small: a tiny generated dataset of
the same shape, one epoch, no warm-ups longer than it, and (CIFAR-10) a smaller batch and 2
blocks. Each run must train, write its summary, and have trained the file's settings (its
``config.yaml`` is the file's config with the small-size overrides and nothing else). One
local[2] session for all.
"""

from __future__ import annotations

import glob
import importlib
import json
import math
import os
import shlex

import pytest

from sparkcnn import cli, config

rows = importlib.import_module("bench.rows")
keras_fit = importlib.import_module("bench.keras_fit")

FILES = sorted(os.path.relpath(p, rows.ROOT)
               for p in glob.glob(os.path.join(rows.ROOT, rows.SEED_DIR, "*.yaml")))
# what makes a run tiny, per dataset: every other setting is the file's
# (CIFAR-10's rows run 4 blocks on local[4]: on the tests' local[2] session 2, since a stream row's
# barrier stage needs a task slot per block)
SMALL = {"fmnist": ["train.epochs=1", "train.lr_warmup_epochs=0.2"],
         "cifar10": ["train.epochs=1", "train.lr_warmup_epochs=0.2", "train.batch_size=8",
                     "data.num_blocks=2"]}


def write_tiny_cifar_bin(out: str, train_rows: int, test_rows: int, seed: int = 0) -> str:
    """A CIFAR-10 binary directory: ``train_rows`` seeded random images over the five
    ``data_batch_*.bin``, ``test_rows`` in ``test_batch.bin``, labels cycling 0..9, and
    ``batches.meta.txt`` (the bench that generated such data now reads the real CIFAR-10)."""
    import numpy as np

    from sparkcnn.data.cifar import CIFAR10_CLASSES
    from sparkcnn.data.synthetic import write_cifar_bin

    rng = np.random.default_rng(seed)
    os.makedirs(out, exist_ok=True)
    x = rng.integers(0, 256, (train_rows + test_rows, 32, 32, 3), dtype=np.uint8)
    y = (np.arange(train_rows + test_rows) % 10).astype(np.uint8)
    for k, idx in enumerate(np.array_split(np.arange(train_rows), 5), start=1):
        write_cifar_bin(os.path.join(out, f"data_batch_{k}.bin"), x[idx], y[idx])
    write_cifar_bin(os.path.join(out, "test_batch.bin"), x[train_rows:], y[train_rows:])
    with open(os.path.join(out, "batches.meta.txt"), "w", encoding="utf-8") as fh:
        fh.write("".join(name + "\n" for name in CIFAR10_CLASSES))
    return out


@pytest.fixture(scope="module")
def tiny_cifar(tmp_path_factory, spark):
    """A prepared CIFAR-10-format dataset of 64 training and 16 test images, through the
    project's cifar10-bin reader and prepare step."""
    from sparkcnn.data.prepare import prepare

    root = tmp_path_factory.mktemp("cifar")
    out = str(root / "prepared")
    prepare("cifar10-bin", write_tiny_cifar_bin(str(root / "bin"), 64, 16), out, spark=spark)
    return out


def test_every_seed_row_has_its_file_for_both_tables():
    assert FILES == sorted(rows.seed_file(d, v) for d in ("cifar10", "fmnist") for v in rows.ROWS)


@pytest.mark.parametrize("config_file", FILES)
def test_a_rows_command_trains_at_a_tiny_size(config_file, spark, tiny_data, tiny_cifar, tmp_path, capsys,
                                              monkeypatch):
    dataset = os.path.basename(config_file).split("_", 1)[0]
    data = {"fmnist": tiny_data, "cifar10": tiny_cifar}[dataset]
    small = [f"data.path={data}", f"run.out_dir={tmp_path / 'runs'}", *SMALL[dataset]]
    argv = shlex.split(rows.reproduction(config_file)["command"])
    for s in small:
        argv += ["--set", s]
    monkeypatch.chdir(rows.ROOT)  # the command names the file relative to the repository
    if rows.is_keras(config_file):
        assert argv[:2] == ["python", "bench/keras_fit.py"]
        assert keras_fit.main(argv[2:]) == 0
        summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        cfg = config.load(config_file)
        assert json.loads((tmp_path / "runs" / cfg.run.name / "summary.json").read_text()) == summary
        assert len(summary["accuracy_per_epoch"]) == 1 and summary["model"] == cfg.model.name
    else:
        assert argv[:2] == ["sparkcnn", "train"]
        assert cli.main([*argv[1:], "--no-progress"]) == 0
        summary = json.loads(capsys.readouterr().out)
        run_dir = summary["run_dir"]
        assert json.loads(open(os.path.join(run_dir, "summary.json"), encoding="utf-8").read())["epochs"] == 1
        # it trained the file's settings, changed by the small-size overrides alone
        assert config.load(os.path.join(run_dir, "config.yaml")) == config.load(config_file, small)
        assert summary["rounds"] >= 1
    assert math.isfinite(summary["test_accuracy"]) and 0 <= summary["test_accuracy"] <= 1
