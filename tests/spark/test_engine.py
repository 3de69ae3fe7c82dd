"""The synchronous engine on a real local[2] Spark session, on a tiny prepared dataset."""

import json
import os

import numpy as np
import pytest

from sparkcnn.compression import codec
from sparkcnn.backends.spark import SparkBackend
from sparkcnn.metrics import read_jsonl

pytestmark = pytest.mark.spark


def test_sync_training_loss_falls_and_run_dir_complete(spark, tiny_cfg):
    from sparkcnn.train import train

    summary = train(tiny_cfg, backend=SparkBackend(spark, "t-sync"))
    run_dir = summary["run_dir"]
    for name in ("config.yaml", "metrics.jsonl", "model.keras", "summary.json", "report.md"):
        assert os.path.isfile(os.path.join(run_dir, name)), name
    records = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    rounds = [r for r in records if r["kind"] == "round"]
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert [e["epoch"] for e in epochs] == [0, 1]
    assert [r["round"] for r in rounds] == list(range(len(rounds)))
    k = max(1, len(rounds) // 4)
    assert np.mean([r["loss"] for r in rounds[-k:]]) < 0.7 * np.mean([r["loss"] for r in rounds[:k]])
    assert epochs[-1]["test_accuracy"] > 0.6
    for r in rounds:
        assert r["bytes_up"] > 0 and r["bytes_down"] > 0 and r["images_per_s"] > 0
        assert r["compute_s"] > 0 and r["wall_s"] >= r["compute_s"]
        # local mode assigns no GPU: every block trained with TensorFlow on the CPU
        assert r["task_gpus"] == r["task_devices"] == {"0": "", "1": ""}
        assert set(r["task_executors"]) == {"0", "1"}
    with open(os.path.join(run_dir, "summary.json")) as fh:
        assert json.load(fh)["test_accuracy"] == epochs[-1]["test_accuracy"]


class RecordingBackend(SparkBackend):
    """Spark backend that keeps the raw task results of the last gather job (a sync round)."""

    def map_blocks(self, fn, blocks, description="", universe=None, split="train", tree_depth=None):
        out = super().map_blocks(fn, blocks, description, universe, split, tree_depth)
        if tree_depth is not None:
            self.last = list(out)
        return out


def _engine(cfg, backend):
    from sparkcnn.train import build_engine

    engine, _ = build_engine(cfg, backend, backend.run_id)
    return engine, engine.spec


def test_aggregated_delta_equals_numpy_reference(spark, tiny_cfg):
    cfg = tiny_cfg.replace(data__num_blocks=3)
    backend = RecordingBackend(spark, "t-agg")
    engine, spec = _engine(cfg, backend)
    before = engine.W.copy()
    engine.run_round(0)
    results = backend.last
    assert sorted(r.block for r in results) == [0, 1, 2]
    total = sum(r.samples for r in results)
    reference = np.zeros_like(before, dtype=np.float64)
    for r in results:
        dense = codec.decode(r.payload, spec.layout).to_dense().astype(np.float64)
        reference += (r.samples / total) * dense
    np.testing.assert_allclose(before - engine.W, reference, rtol=1e-5, atol=1e-7)
    assert np.abs(reference).max() > 0


def test_one_block_on_spark_equals_plain_keras(spark, tiny_cfg):
    import keras

    from sparkcnn.data.parquet_io import read_split_numpy
    from sparkcnn.models import build_model
    from sparkcnn.worker.trainer import batch_indices

    H = 6
    cfg = tiny_cfg.replace(data__num_blocks=1, train__steps_per_round=H)
    engine, spec = _engine(cfg, SparkBackend(spark, "t-keras"))
    w0 = engine.W.copy()
    engine.run_round(0)

    x, y = read_split_numpy(os.path.join(cfg.data.path, "train"))
    model = build_model(cfg.model.name, x.shape[1:], 10, cfg.run.seed)
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=cfg.train.lr, momentum=cfg.train.momentum),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    np.testing.assert_array_equal(np.concatenate([w.numpy().ravel() for w in model.weights]), w0)
    for step in range(H):
        idx = batch_indices(len(y), cfg.train.batch_size, cfg.run.seed, 0, 0, step)
        model.train_on_batch(x[idx], y[idx])
    keras_w = np.concatenate([w.numpy().ravel() for w in model.weights])
    assert np.abs(keras_w - w0).max() > 1e-3  # the steps really moved the weights
    np.testing.assert_allclose(engine.W, keras_w, rtol=1e-4, atol=2e-5)


def test_pipelined_sync_on_spark(spark, tiny_cfg):
    """Two rounds in flight: state is handed over between rounds, nothing reset or dropped."""
    from sparkcnn.train import train

    cfg = tiny_cfg.replace(engine__pipeline=True, compression__method="threshold", compression__density=0.01)
    summary = train(cfg, backend=SparkBackend(spark, "t-pipe"))
    records = read_jsonl(os.path.join(summary["run_dir"], "metrics.jsonl"))
    rounds = [r for r in records if r["kind"] == "round"]
    assert [r["round"] for r in rounds] == list(range(summary["rounds"]))
    # round t+1 is submitted once round t is registered, so its tasks never run first:
    # every block state is handed over (none restarted, none taken from an older round)
    assert summary["duplicates_dropped"] == 0
    assert summary["state_resets"] == 0 and summary["stale_states"] == 0
    assert all(0.0 <= r["idle_fraction"] <= 1.0 for r in rounds)
    k = max(1, len(rounds) // 4)
    assert np.mean([r["loss"] for r in rounds[-k:]]) < 0.7 * np.mean([r["loss"] for r in rounds[:k]])
    assert summary["test_accuracy"] > 0.6


def test_balanced_sync_sizes_steps_per_executor(tiny_cfg):
    """scheduler.balance: a block on a 3x slower executor gets about a third of the steps."""
    from sparkcnn.backends.inprocess import LocalBackend
    from sparkcnn.train import build_engine

    cfg = tiny_cfg.replace(scheduler__balance=True, train__steps_per_round=6)
    backend = LocalBackend("t-balance")
    engine, _ = build_engine(cfg, backend, backend.run_id)
    engine.run_round(0)
    (key,) = engine.balancer.speed  # one in-process executor
    engine.balancer.speed.update({key: 100.0, "slow-executor": 100.0 / 3})
    sized = engine.balancer.sized_steps(6)
    assert sized[key] > 6 > sized["slow-executor"]
    assert sized[key] == pytest.approx(3 * sized["slow-executor"], abs=1)
    cursor = dict(engine.balancer.cursor)
    rec = engine.run_round(1)
    assert rec["samples"] == sized[key] * cfg.train.batch_size * cfg.data.num_blocks
    assert all(engine.balancer.cursor[k] == cursor[k] + sized[key] for k in cursor)


class _CountingBackend:
    """Wraps a backend, counting broadcasts made and destroyed."""

    def __init__(self, inner):
        self.inner, self.made, self.destroyed = inner, [], []

    def broadcast(self, value):
        b = self.inner.broadcast(value)
        self.made.append(b)
        return b

    def unpersist(self, bcast):
        self.destroyed.append(bcast)
        self.inner.unpersist(bcast)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("pipeline", [False, True])
def test_dense_weights_travel_as_one_broadcast_per_version_and_old_ones_are_destroyed(tiny_cfg, pipeline):
    """Dense downlink: W reaches the tasks as a broadcast (not inline in the job's closure),
    made once per version; sync keeps only what the rounds in flight can read."""
    from sparkcnn.backends.inprocess import LocalBackend
    from sparkcnn.train import build_engine

    cfg = tiny_cfg.replace(engine__pipeline=pipeline, train__steps_per_round=2)
    backend = _CountingBackend(LocalBackend("t-bcast"))
    engine, _ = build_engine(cfg, backend, backend.run_id)
    order = engine.order_for(0)
    assert order.weights in backend.made  # a broadcast, not bytes inline in the job's closure
    assert np.array_equal(np.frombuffer(order.weights.value, np.float32), engine.W)
    assert engine.order_for(0).weights is order.weights  # same version: no new broadcast
    rounds = [engine.run_round(t) for t in range(6)]
    assert all(r["bytes_down"] == engine.W.nbytes * r["blocks"] for r in rounds)
    live = [b for b in backend.made if b not in backend.destroyed]
    assert len(backend.made) == 6  # versions 0..5, one broadcast each
    assert engine.server.downlink.keep_broadcasts == (3 if pipeline else 2)  # rounds in flight + a spare
    assert len(live) == engine.server.downlink.keep_broadcasts + 1  # and the current one
    assert backend.destroyed == backend.made[:len(backend.destroyed)]  # oldest first
