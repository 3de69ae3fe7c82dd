"""Asynchronous engine: the same scenario with a synchronous executor and with the real thread pool."""

import os
from concurrent.futures import Executor, Future

import numpy as np
import pytest

from sparkcnn.engine.backend import LocalBackend, SparkBackend
from sparkcnn.metrics import read_jsonl
from sparkcnn.train import build_engine


class SyncExecutor(Executor):
    """Runs each submitted job at once in the caller's thread (the 'dummy pool')."""

    def __init__(self, *_):
        pass

    def submit(self, fn, *args, **kwargs):
        fut = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the engine like a pool would
            fut.set_exception(e)
        return fut


def _async_cfg(tiny_cfg, **kw):
    return tiny_cfg.replace(engine__mode="async", scheduler__target_job_seconds=0.2, **kw)


@pytest.mark.parametrize("pool", ["synchronous", "threads"])
def test_async_engine_trains_with_either_pool(tiny_cfg, pool):
    cfg = _async_cfg(tiny_cfg, compression__method="threshold", compression__density=0.02,
                     compression__density_down=0.02)
    backend = LocalBackend(f"t-async-{pool}")
    factory = SyncExecutor if pool == "synchronous" else None
    engine, _ = build_engine(cfg, backend, backend.run_id)
    if factory:
        engine.pool_factory = factory
    summary = engine.run()
    assert summary["epochs"] == cfg.train.epochs
    assert engine.samples_done >= engine.total_samples
    jobs = engine.history
    assert len({(r["round"], r["block"]) for r in jobs}) == len(jobs)  # each job applied once
    assert {r["block"] for r in jobs} == set(range(cfg.data.num_blocks))
    assert all(r["staleness"] >= 0 for r in jobs)
    if pool == "threads":
        assert max(r["staleness"] for r in jobs) <= cfg.ps.max_staleness
    k = max(1, len(jobs) // 4)
    assert np.mean([r["loss"] for r in jobs[-k:]]) < 0.8 * np.mean([r["loss"] for r in jobs[:k]])
    assert summary["test_accuracy"] > 0.6
    assert summary["bytes_up"] < summary["dense_bytes_up"] / 5


def test_duplicate_results_are_dropped_and_counted(tiny_cfg):
    """A speculative or retried duplicate of a (round, block) result is applied once."""

    class Duplicating(LocalBackend):
        def aggregate_blocks(self, fn, blocks, zero, seq, comb, description="", depth=2, universe=None):
            acc = super().aggregate_blocks(fn, blocks, zero, seq, comb, description, depth, universe)
            return acc + [dict(acc[0])]

    backend = Duplicating("t-dup")
    engine, _ = build_engine(tiny_cfg, backend, backend.run_id)
    v0 = engine.version
    engine.run_round(0)
    assert engine.counters["duplicates_dropped"] == 1
    assert engine.version == v0 + 1
    # a reference engine without the duplicate reaches the same weights
    ref_backend = LocalBackend("t-dup-ref")
    ref, _ = build_engine(tiny_cfg, ref_backend, ref_backend.run_id)
    ref.run_round(0)
    np.testing.assert_array_equal(ref.W, engine.W)


@pytest.mark.spark
def test_async_on_local_spark(spark, tiny_cfg):
    from sparkcnn.train import train

    cfg = _async_cfg(tiny_cfg)
    summary = train(cfg, backend=SparkBackend(spark, "t-async-spark", pool="t-async"))
    records = read_jsonl(os.path.join(summary["run_dir"], "metrics.jsonl"))
    jobs = [r for r in records if r["kind"] == "round"]
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert [e["epoch"] for e in epochs] == list(range(cfg.train.epochs))
    assert summary["duplicates_dropped"] == 0 and summary["state_resets"] == 0
    assert {r["block"] for r in jobs} == {0, 1}
    assert summary["test_accuracy"] > 0.6
