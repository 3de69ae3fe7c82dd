"""``data.augment`` through a run, on the in-process backend: a crashed and resumed deterministic
run with crop_flip (and data.normalize=dataset) ends bit-identical to an uninterrupted one, and
evaluation never augments."""

import dataclasses
import os

import numpy as np
import pytest

from sparkcnn.backends.inprocess import LocalBackend
from sparkcnn.data import augment


@pytest.fixture()
def augmented(monkeypatch) -> list[int]:
    """The batch size of every crop_flip call the in-process tasks make."""
    calls, real = [], augment.AUGMENTERS["crop_flip"]

    def counting(images, rng, **kw):
        calls.append(len(images))
        return real(images, rng, **kw)

    monkeypatch.setitem(augment.AUGMENTERS, "crop_flip", counting)
    return calls


class CrashAt:
    """A progress bar through which the driver dies at round ``n``'s record: after the checkpoint
    that followed round ``n - 1``, as a driver SIGKILLed after round ``n`` (tests/spark/test_resume.py)."""

    def __init__(self, n: int):
        self.n = n

    def round(self, rec, total):
        if rec["round"] == self.n:
            raise RuntimeError("driver lost")

    def epoch(self, *a, **k):
        pass

    def close(self):
        pass


def _weights(run_dir):
    import keras

    return [w.numpy() for w in keras.saving.load_model(os.path.join(run_dir, "model.keras")).weights]


def test_crop_flip_crashed_and_resumed_deterministic_run_is_bit_identical(tiny_cfg, augmented):
    from sparkcnn.train import train

    cfg = tiny_cfg.replace(run__deterministic=True, data__augment="crop_flip", data__normalize="dataset",
                           checkpoint__every_rounds=2, compression__method="threshold",
                           compression__density=0.05)
    out = cfg.run.out_dir
    clean = train(cfg, backend=LocalBackend("aug-clean"), run_dir=os.path.join(out, "aug-clean"))
    assert augmented and set(augmented) == {cfg.train.batch_size}
    run_dir = os.path.join(out, "aug-crash")
    with pytest.raises(RuntimeError, match="driver lost"):
        train(cfg, backend=LocalBackend("aug-crash"), progress=CrashAt(2), run_dir=run_dir)
    with open(os.path.join(run_dir, "checkpoints", "LATEST")) as fh:
        assert fh.read().strip() == "r0000002"  # the resume trains round 2 again
    resumed = train(cfg, backend=LocalBackend("aug-crash"), run_dir=run_dir, resume=True)
    assert resumed["rounds"] == clean["rounds"]
    for a, b in zip(_weights(clean["run_dir"]), _weights(run_dir), strict=True):
        assert np.array_equal(a, b)


def test_evaluation_never_augments(tiny_cfg, augmented):
    from sparkcnn.train import build_engine
    from sparkcnn.transport import tasks

    cfg = tiny_cfg.replace(data__augment="crop_flip")
    engine, _ = build_engine(cfg, LocalBackend("aug-eval"), "aug-eval")
    engine.run_round(0)
    steps = cfg.data.num_blocks * cfg.train.steps_per_round
    assert augmented == [cfg.train.batch_size] * steps  # each training batch once
    augmented.clear()
    got = tasks.evaluate(engine.backend, engine.spec, engine.W, 0)
    assert not augmented and got["test_samples"] == 400
    plain = dataclasses.replace(engine.spec, augment="none")
    assert got == tasks.evaluate(engine.backend, plain, engine.W, 0)
