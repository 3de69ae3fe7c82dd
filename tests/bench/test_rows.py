"""bench/rows.py: the seed tables' row files as bench variants, and the commands that reproduce them."""

import importlib
import re
import shlex

import pytest

from sparkcnn import config

rows = importlib.import_module("bench.rows")
accuracy = importlib.import_module("bench.accuracy")

# what the rendered Fashion-MNIST rows ran before the row files existed: --set lists on the
# defaults with a 0.3-epoch lr warm-up (the committed results' overrides)
SPARSE = ["compression.method=threshold", "compression.density=0.001", "compression.initial_density=0.25",
          "compression.warmup_epochs=3", "compression.dense_below=1000"]
BIDIR = ["compression.density_down=0.01", "compression.initial_density_down=0.05"]
STREAM = ["engine.transport=stream", "engine.mode=async", "train.steps_per_round=1"]
PER_STEP = ["compression.clip_norm=2.0", "compression.factor_masking=false"]
BEFORE = {
    "sync-dense": ["engine.transport=jobs", "train.steps_per_round=10"],
    "stream-asgd": STREAM,
    "stream-gs-asgd": [*STREAM, *SPARSE, *PER_STEP],
    "stream-gs-asgd-ms": [*STREAM, *SPARSE, *PER_STEP, *BIDIR],
    "stream-gs-asgd-samomentum": [*STREAM, *SPARSE, *PER_STEP, *BIDIR,
                                  "compression.momentum=sparsification_aware"],
}


def _resolved(config_file, sets):
    return config.load(config_file, ["run.name=x", "data.path=d", "train.epochs=10", *sets])


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_a_row_file_trains_what_the_rendered_row_ran(name):
    every = {**accuracy.VARIANTS, **accuracy.STREAM_VARIANTS}
    v = every[name]
    assert v.sets == () and v.config.startswith("conf/seed/fmnist_")
    assert _resolved(v.config, []) == _resolved(None, ["train.lr_warmup_epochs=0.3", *BEFORE[name]])


def test_the_other_benches_borrow_the_same_settings_from_the_files():
    assert (accuracy.SPARSE, accuracy.BIDIR) == (SPARSE, BIDIR)
    assert (accuracy.STREAM, accuracy.PER_STEP) == (STREAM, PER_STEP)
    assert accuracy.STREAM_SPARSE == [*STREAM, *SPARSE, *PER_STEP]


@pytest.mark.parametrize("dataset", ["fmnist", "cifar10"])
def test_every_variant_of_both_tables_loads_and_says_its_transport(dataset):
    jobs, stream = rows.variants(dataset)
    assert set(jobs) == set(accuracy.VARIANTS) and set(stream) == set(accuracy.STREAM_VARIANTS)
    blocks = {"fmnist": 2, "cifar10": 4}[dataset]  # the CIFAR-10 table runs 4 blocks (on local[4])
    for name, v in {**jobs, **stream}.items():
        cfg = config.load(v.config, v.sets)
        assert cfg.engine.transport == ("stream" if name.startswith("stream") else "jobs"), name
        assert cfg.data.num_blocks == (8 if name.endswith("-n8") else blocks), name
        assert cfg.model.name == {"fmnist": "fmnist_cnn", "cifar10": "resnet20"}[dataset]


@pytest.mark.parametrize("config_file", [rows.seed_file(d, r) for d in ("fmnist", "cifar10")
                                         for r in rows.ROWS])
def test_a_files_settings_as_overrides_give_back_its_config(config_file):
    """file_sets writes each value so that --set parses it back to the same value."""
    data = rows._read(config_file)
    keys = [f"{s}.{k}" for s, sec in data.items() for k in sec]
    assert config.load(None, rows.file_sets(config_file, keys)) == config.load(config_file)


def test_a_command_says_what_differs_from_the_file_and_leaves_bookkeeping_out():
    f = rows.seed_file("fmnist", "gs_asgd_ms")
    rep = rows.reproduction(f, ["run.out_dir=/x", "run.name=y", "engine.master=local[8]", "run.seed=43"],
                            data="data/fashion-mnist", epochs=2)
    assert rep == {"config_file": f, "command": f"sparkcnn train --config {f} --set train.epochs=2 "
                                                "--set 'engine.master=local[8]' --set run.seed=43"}
    assert shlex.split(rep["command"])[-1] == "run.seed=43"
    keras = rows.reproduction(rows.seed_file("cifar10", "keras"), data="data/cifar10-small")["command"]
    assert keras == ("python bench/keras_fit.py --config conf/seed/cifar10_keras.yaml "
                     "--set data.path=data/cifar10-small")
    with pytest.raises(ValueError, match=r"conf/seed/fmnist_asgd.yaml: gives no compression.density"):
        rows.file_sets(rows.seed_file("fmnist", "asgd"), ["compression.density"])


@pytest.mark.parametrize("sets, message", [
    (["train.lr=0"], r"train\.lr must be in \(0, 10\], got 0"),
    (["data.path=no/such/data"], r"data\.path 'no/such/data': no prepared split at no/such/data/train"),
])
def test_the_keras_row_refuses_bad_input_in_one_line(sets, message, capsys):
    keras_fit = importlib.import_module("bench.keras_fit")
    argv = ["--config", rows.seed_file("fmnist", "keras"), *(x for s in sets for x in ("--set", s))]
    assert keras_fit.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("bench/keras_fit.py: error: ")
    assert re.search(message, err), err
