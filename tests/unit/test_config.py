import dataclasses
import glob
import logging

import pytest

from sparkcnn import config
from sparkcnn.errors import BadInput


def test_defaults_validate_and_round_trip(tmp_path):
    cfg = config.load(None, ["train.epochs=5", "compression.density=0.01", "engine.pipeline=true"])
    assert cfg.train.epochs == 5 and cfg.compression.density == 0.01 and cfg.engine.pipeline is True
    path = tmp_path / "c.yaml"
    path.write_text(config.dump(cfg))
    again = config.load(str(path))
    assert again == cfg
    assert dataclasses.asdict(again) == dataclasses.asdict(cfg)


def test_repo_configs_load():
    names = ["conf/fashion_mnist.yaml", "conf/cifar10_resnet20.yaml", *sorted(glob.glob("conf/seed/*.yaml"))]
    assert len(names) == 14  # the two above and one file per seed-table row, two tables of six
    for name in names:
        cfg = config.load(name)
        assert cfg.train.epochs >= 1


def test_int_widens_to_float():
    assert config.load(None, ["train.lr=1"]).train.lr == 1.0


def test_exponent_numbers_that_yaml_reads_as_strings_are_numbers(tmp_path):
    """YAML 1.1 (PyYAML) reads 1e-4 and 5E3 as strings; a number field takes them as numbers."""
    cfg = config.load(None, ["train.lr=1e-4", "guard.loss_spike_factor=5E3", "compression.density=2.5e-3"])
    assert (cfg.train.lr, cfg.guard.loss_spike_factor, cfg.compression.density) == (1e-4, 5e3, 2.5e-3)
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 3e-2\n")
    assert config.load(str(path)).train.lr == 0.03
    with pytest.raises(BadInput, match=r"train\.lr must be a number, got '1e-4x'"):
        config.load(None, ["train.lr=1e-4x"])
    with pytest.raises(BadInput, match=r"train\.epochs must be an integer, got '1e3'"):
        config.load(None, ["train.epochs=1e3"])  # an integer field stays strict


@pytest.mark.parametrize("override, message", [
    (["train.epochz=3"], r"unknown config key 'train\.epochz'"),
    (["trainer.epochs=3"], r"unknown config key 'trainer'"),
    (["compression.density=1.5"], r"compression\.density must be in \(0, 1\], got 1\.5"),
    (["compression.initial_density_down=-0.1"], r"compression\.initial_density_down must be in \[0, 1\], got -0\.1"),
    (["train.epochs=three"], r"train\.epochs must be an integer, got 'three'"),
    (["train.epochs=2.5"], r"train\.epochs must be an integer"),
    (["engine.mode=turbo"], r"engine\.mode must be one of sync, async, got 'turbo'"),
    (["engine.pipeline=maybe"], r"engine\.pipeline must be true or false"),
    (["train.momentum=1"], r"train\.momentum must be in \[0, 1\)"),
    (["data.num_blocks=0"], r"data\.num_blocks must be in \[1, 4096\]"),
    (["trainepochs"], r"expected section\.key=value"),
    (["ps.downlink_every=-1"], r"ps\.downlink_every must be >= 0, got -1"),
    (["data.augment=mixup"], r"data\.augment must be one of none, crop_flip, got 'mixup'"),
    (["data.normalize=imagenet"], r"data\.normalize must be one of none, dataset, got 'imagenet'"),
])
def test_bad_overrides_name_the_field(override, message):
    with pytest.raises(BadInput, match=message):
        config.load(None, override)


@pytest.mark.parametrize("override, message", [
    ("data.augment=mixup", "data.augment must be one of none, crop_flip, got 'mixup'"),
    ("data.normalize=imagenet", "data.normalize must be one of none, dataset, got 'imagenet'"),
])
def test_a_bad_choice_is_one_line_and_exit_2_from_the_cli(capsys, override, message):
    from sparkcnn.cli import main

    assert main(["train", "--no-progress", "--set", override]) == 2
    assert capsys.readouterr().err == f"sparkcnn train: error: {message}\n"


def test_bad_yaml_and_missing_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("train: [1, 2\n")
    with pytest.raises(BadInput, match=r"bad\.yaml.*not valid YAML"):
        config.load(str(p))
    with pytest.raises(BadInput, match="config file not found"):
        config.load(str(tmp_path / "missing.yaml"))
    p.write_text("- a\n- b\n")
    with pytest.raises(BadInput, match="top level must be a mapping"):
        config.load(str(p))


STREAM_FLOOR_LOG = "ps.max_staleness 2 raised to 12 on the stream: its own overlap makes pushes that stale"


def test_the_async_stream_raises_max_staleness_to_four_per_block(caplog):
    """engine.transport=stream and engine.mode=async: ps.max_staleness is at least 4 x data.num_blocks,
    with one log line; on a transport resolved later from auto (replace) as well."""
    with caplog.at_level(logging.INFO, logger="sparkcnn.config_sections"):
        cfg = config.load(None, ["engine.transport=stream", "engine.mode=async", "data.num_blocks=3",
                                 "ps.max_staleness=2"])
    assert cfg.ps.max_staleness == 12
    assert [r.getMessage() for r in caplog.records] == [STREAM_FLOOR_LOG]

    auto = config.load(None, ["engine.mode=async", "data.num_blocks=3", "ps.max_staleness=2"])
    assert auto.ps.max_staleness == 2  # not the stream yet
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="sparkcnn.config_sections"):
        resolved = auto.replace(engine__transport="stream")
        again = resolved.replace(train__epochs=1)  # already at the floor: no second line
    assert resolved.ps.max_staleness == again.ps.max_staleness == 12
    assert [r.getMessage() for r in caplog.records] == [STREAM_FLOOR_LOG]


@pytest.mark.parametrize("overrides, bound", [
    (["engine.transport=stream", "engine.mode=sync", "ps.max_staleness=2"], 2),   # sync: no staleness
    (["engine.transport=jobs", "engine.mode=async", "ps.max_staleness=2"], 2),    # the jobs transport
    (["engine.transport=stream", "engine.mode=async", "ps.max_staleness=20"], 20),  # above the floor
    (["engine.transport=stream", "engine.mode=async"], 8),  # the default 8 is the floor at 2 blocks
])
def test_the_staleness_floor_leaves_other_configs_alone(overrides, bound):
    assert config.load(None, overrides).ps.max_staleness == bound


def test_a_bad_max_staleness_is_named_on_the_stream_too():
    with pytest.raises(BadInput, match=r"ps\.max_staleness must be >= 1, got 0"):
        config.load(None, ["engine.transport=stream", "engine.mode=async", "ps.max_staleness=0"])


def test_ps_downlink_every_sets_the_async_downlink_cadence():
    """0: a downlink per ceil(N / 2) applied results; else that many."""
    from sparkcnn.server.exchange import downlink_cadence

    assert config.load(None, []).ps.downlink_every == 0
    assert [downlink_cadence(0, n) for n in (1, 2, 3, 8)] == [1, 1, 2, 4]
    assert downlink_cadence(1, 8) == 1 and downlink_cadence(3, 2) == 3
