"""A run's start-up on the in-process backend: the first step's time in the records."""

import time

import numpy as np
import pytest

from sparkcnn.backends.inprocess import LocalBackend
from sparkcnn.clock import process_started
from sparkcnn.train import build_engine, resolve_frames


def _engine(cfg, run_id):
    return build_engine(cfg, LocalBackend(run_id), run_id)[0]


def test_the_first_round_records_when_its_first_step_ended_after_the_process_started(tiny_cfg):
    engine = _engine(tiny_cfg.replace(run__deterministic=True), "t-first-step")
    before = time.time() - process_started()  # the process's age before the round: its steps come later
    first, second = engine.run_round(0), engine.run_round(1)
    assert before < first["first_step_s"] <= time.time() - process_started()
    assert "first_step_s" not in second  # the start-up is the engine's first exchange only
    assert engine.server.summary(1.0)["first_step_s"] == first["first_step_s"]


def _spec(seed=0, per_step=False):
    from sparkcnn.protocol import TaskSpec

    return TaskSpec(run_id="t-warm", num_blocks=1, test_blocks=1,
                    model_name="tests.spark.test_trainer:tiny_bn", input_shape=(8, 8, 1), num_classes=3,
                    seed=seed, batch_size=4, momentum=0.9, weight_decay=1e-4, layout=(), per_step=per_step)


@pytest.mark.parametrize("per_step", [False, True])
def test_a_warmed_up_trainer_steps_bit_identically_to_a_cold_one(per_step):
    from sparkcnn.worker.trainer import Trainer

    rng = np.random.default_rng(4)
    x, y = rng.integers(0, 255, (16, 8, 8, 1)).astype(np.uint8), rng.integers(0, 3, 16).astype(np.int32)
    cold, warm = Trainer(_spec(per_step=per_step)), Trainer(_spec(per_step=per_step))
    w = rng.standard_normal(cold.offsets[-1]).astype(np.float32) * 0.1
    m = rng.standard_normal(cold.offsets[-1]).astype(np.float32) * 0.01
    for tr in (cold, warm):
        tr.set_flat(w)
        tr.set_momentum(m)
    warm.warm_up(x[8:], y[8:], per_step)  # other rows than the steps': nothing of them may stay
    assert warm.warmed and not cold.warmed
    np.testing.assert_array_equal(warm.get_flat(), w)
    batches = [np.arange(0, 4), np.arange(4, 8)]
    if per_step:
        got = [tr.gradient(x, y, batches[0], at=w) for tr in (cold, warm)]
        np.testing.assert_array_equal(got[0][0], got[1][0])
        assert got[0][1:] == got[1][1:]
    else:
        assert cold.train(x, y, batches, 0.05) == warm.train(x, y, batches, 0.05)
    for read in ("get_flat", "get_momentum"):
        np.testing.assert_array_equal(getattr(cold, read)(), getattr(warm, read)())
    assert int(cold.opt.iterations.numpy()) == int(warm.opt.iterations.numpy())


def test_placing_a_training_block_warms_the_worker_up_and_a_test_block_does_not(tmp_path):
    from sparkcnn.protocol import TaskContextInfo
    from sparkcnn.worker import blocks, blockstore
    from sparkcnn.worker.trainer import get_trainer

    rng = np.random.default_rng(5)
    x, y = rng.integers(0, 255, (6, 8, 8, 1)).astype(np.uint8), rng.integers(0, 3, 6).astype(np.int32)
    ctx = TaskContextInfo(local_dir=str(tmp_path))
    chunk = [(0, 0, x.tobytes(), y.tobytes())]
    spec = _spec(seed=11)  # a trainer of its own in this process
    assert blocks.store(spec, "test", 1, 0, chunk, ctx, (8, 8, 1)) == (0, 6)
    trainer = get_trainer(spec, ctx)
    assert not trainer.warmed
    assert blocks.store(spec, "train", 1, 0, chunk, ctx, (8, 8, 1)) == (0, 6)
    assert trainer.warmed
    images, labels = blockstore.get_block(str(tmp_path), spec.run_id, "train", 1, 0)
    np.testing.assert_array_equal(images, x)
    np.testing.assert_array_equal(labels, y)


def test_the_test_blocks_are_placed_by_the_first_evaluation_not_before_the_first_round(spark, tiny_cfg):
    from sparkcnn.backends.spark import SparkBackend
    from sparkcnn.transport import tasks

    placed = []

    class Recording(SparkBackend):
        def place(self, split, *args, **kwargs):
            placed.append(split)
            return super().place(split, *args, **kwargs)

    cfg = tiny_cfg.replace(run__deterministic=True)
    backend = Recording(spark, "t-later")
    engine = build_engine(cfg, backend, "t-later")[0]
    engine.run_round(0)
    assert placed == ["train"]
    got = tasks.evaluate(backend, engine.spec, engine.W, 0)
    assert placed == ["train", "test"]
    tasks.evaluate(backend, engine.spec, engine.W, 0)
    assert placed == ["train", "test"]  # once
    # the same weights on blocks placed at once, in this process: the same test set, evaluated alike
    local = LocalBackend("t-later-local")
    local.place("test", engine_frames(cfg)[1], engine.spec.test_blocks, engine.spec)
    want = tasks.evaluate(local, engine.spec, engine.W, 0)
    assert got["test_samples"] == want["test_samples"] == 400
    assert got["test_accuracy"] == want["test_accuracy"]
    assert abs(got["test_loss"] - want["test_loss"]) < 1e-5
    backend.close()


def engine_frames(cfg):
    from sparkcnn.data.source import local_prepared

    return local_prepared(cfg.data)


def _block_rows(spec, split: str, num_blocks: int):
    """A task function: (block, sorted (image digest, label) of its rows) as the block store holds it."""

    def rows(block, ctx):
        import hashlib

        from sparkcnn.worker import blockstore
        from sparkcnn.worker.task import local_root

        images, labels = blockstore.get_block(local_root(spec, ctx), spec.run_id, split, num_blocks, block)
        return block, sorted((hashlib.sha1(x.tobytes()).hexdigest(), int(y)) for x, y in zip(images, labels))

    return rows


def test_a_local_prepared_split_is_placed_from_its_files_every_row_in_one_block(spark, tiny_cfg, monkeypatch):
    import hashlib

    from sparkcnn.backends.placement import local_files
    from sparkcnn.backends.spark import SparkBackend
    from sparkcnn.data.parquet_io import read_split_numpy
    from sparkcnn.data.source import attach

    train = attach(spark, engine_frames(tiny_cfg)[0])
    assert local_files(train, "local[2]") and not local_files(train, "spark://127.0.0.1:7077")
    cfg = tiny_cfg.replace(data__num_blocks=3)

    def through_the_jvm(*args):
        raise AssertionError("a local prepared split went through the DataFrame")

    monkeypatch.setattr("sparkcnn.backends.placement.packed_chunks", through_the_jvm)
    backend = SparkBackend(spark, "t-files")
    frames = resolve_frames(cfg, backend)
    assert all(isinstance(f.df, str) for f in frames)  # never read as a DataFrame
    engine = build_engine(cfg, backend, "t-files", frames=frames)[0]
    got = dict(backend.map_blocks(_block_rows(engine.spec, "train", 3), [0, 1, 2], universe=3))
    x, y = read_split_numpy(train.origin)
    want = sorted((hashlib.sha1(im.tobytes()).hexdigest(), int(lb)) for im, lb in zip(x, y))
    assert sorted(r for rows in got.values() for r in rows) == want  # every row, once
    sizes = [len(got[k]) for k in range(3)]
    assert max(sizes) - min(sizes) <= len(local_files(train, "local[2]"))  # round-robin per file
    backend.close()
