"""data.normalize's pure parts: the statistics a prepared split carries, the choice of them, and
the config key."""

import json

import numpy as np
import pytest

from sparkcnn import config
from sparkcnn.data import parquet_io
from sparkcnn.data.normalize import normalization
from sparkcnn.errors import BadInput


def test_normalization_takes_the_dataset_statistics_or_refuses():
    stats = ((0.5, 0.4, 0.3), (0.25, 0.2, 0.1))
    assert normalization("none", stats, "data/x/train", 3) is None
    assert normalization("none", None, "data/x/train", 3) is None
    assert normalization("dataset", stats, "data/x/train", 3) == stats
    with pytest.raises(BadInput, match=r"^data\.normalize=dataset: my_table stores no per-channel mean"):
        normalization("dataset", None, "my_table", 3)
    with pytest.raises(BadInput, match=r"channel 1 has standard deviation 0"):
        normalization("dataset", ((0.5, 0.5), (0.2, 0.0)), "d", 2)
    with pytest.raises(BadInput, match=r"bad per-channel statistics"):
        normalization("dataset", stats, "d", 1)
    with pytest.raises(BadInput, match=r"data\.normalize must be one of none, dataset, got 'z'"):
        normalization("z", stats, "d", 3)


def test_a_prepared_split_reads_its_mean_and_std(tmp_path):
    x = np.zeros((4, 3, 3, 3), np.uint8)
    extra = {parquet_io.META_MEAN: json.dumps([0.1, 0.2, 0.3]),
             parquet_io.META_STD: json.dumps([0.4, 0.5, 0.6])}
    parquet_io.write_split(str(tmp_path / "train"), x, np.zeros(4, np.int32), ["a"], extra=extra)
    meta = parquet_io.read_meta(str(tmp_path / "train"))
    assert (meta.mean, meta.std) == ((0.1, 0.2, 0.3), (0.4, 0.5, 0.6))
    parquet_io.write_split(str(tmp_path / "test"), x, np.zeros(4, np.int32), ["a"])
    assert parquet_io.read_meta(str(tmp_path / "test")).mean is None
    bad = {**extra, parquet_io.META_MEAN: json.dumps([0.1])}  # one value for three channels
    parquet_io.write_split(str(tmp_path / "bad"), x, np.zeros(4, np.int32), ["a"], extra=bad)
    with pytest.raises(BadInput, match=r"metadata sparkcnn\.mean must be a JSON list of one number per"):
        parquet_io.read_meta(str(tmp_path / "bad"))


def test_the_default_leaves_the_model_as_it_was():
    assert config.load(None).data.normalize == "none"
