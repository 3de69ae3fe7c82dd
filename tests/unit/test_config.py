import dataclasses

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
    for name in ("conf/fashion_mnist.yaml", "conf/cifar10_resnet20.yaml"):
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
])
def test_bad_overrides_name_the_field(override, message):
    with pytest.raises(BadInput, match=message):
        config.load(None, override)


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
