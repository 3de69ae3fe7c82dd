"""data.normalize: the builder's model on normalised pixels, with the builder's weights, saved and
loaded with its normalisation; a run normalised by its dataset's statistics trains and keeps them."""

import os

import numpy as np


def test_the_normalised_model_is_the_builders_model_on_normalised_pixels(tmp_path):
    import keras

    from sparkcnn.models import build_model

    plain = build_model("fmnist_cnn", (28, 28, 1), 10, seed=5)
    norm = build_model("fmnist_cnn", (28, 28, 1), 10, seed=5, normalize=((0.3,), (0.2,)))
    assert len(norm.weights) == len(plain.weights)  # the normalisation holds none
    for a, b in zip(norm.weights, plain.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    x = np.random.default_rng(0).integers(0, 256, (4, 28, 28, 1)).astype(np.float32)
    got = norm(x).numpy()
    # fmnist_cnn divides its input by 255: it sees (x / 255 - mean) / std
    np.testing.assert_allclose(got, plain((x - 255 * 0.3) / 0.2).numpy(), rtol=1e-4, atol=1e-4)
    path = str(tmp_path / "model.keras")
    norm.save(path)
    again = keras.saving.load_model(path, safe_mode=True)
    np.testing.assert_allclose(again(x).numpy(), got, rtol=1e-6, atol=1e-6)


def test_a_run_normalised_by_its_dataset_trains_and_its_model_keeps_the_statistics(tiny_cfg):
    import keras

    from sparkcnn.backends.inprocess import LocalBackend
    from sparkcnn.data.parquet_io import read_meta
    from sparkcnn.train import train

    cfg = tiny_cfg.replace(data__normalize="dataset")
    run_dir = os.path.join(cfg.run.out_dir, "normalized")
    summary = train(cfg, backend=LocalBackend("normalized"), run_dir=run_dir)
    assert summary["test_accuracy"] > 0.3
    meta = read_meta(os.path.join(cfg.data.path, "train"))
    got = keras.saving.load_model(os.path.join(run_dir, "model.keras")).get_layer("normalize").get_config()
    np.testing.assert_allclose(got["mean"], [255 * m for m in meta.mean], rtol=1e-6)
    np.testing.assert_allclose(got["variance"], [s * s for s in meta.std], rtol=1e-6)
