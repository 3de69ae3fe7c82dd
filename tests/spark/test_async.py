"""Asynchronous engine: the same scenario with a synchronous executor and with the real thread pool."""

import os
import threading
from concurrent.futures import Executor, Future, ThreadPoolExecutor

import numpy as np
import pytest

from sparkcnn.backends.inprocess import LocalBackend
from sparkcnn.backends.monitor import LoadMonitor
from sparkcnn.backends.spark import SparkBackend
from sparkcnn.metrics import read_jsonl
from sparkcnn.scheduler import ExecutorSample
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
        engine.inject(pool_factory=factory)
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


def test_lost_executor_shrinks_jobs_in_flight(tiny_cfg):
    """The monitor reports 2 one-core executors, then (after 2 results) only one: jobs
    submitted from then on run alone, and every submitted job is applied once."""

    class Losing(LoadMonitor):
        results = 0
        lost = False

        def record(self, result):
            super().record(result)
            self.results += 1

        def _read(self):
            self.lost = self.lost or self.results >= 2
            return [ExecutorSample("e1", 1, 0, 0)] + ([] if self.lost else [ExecutorSample("e2", 1, 0, 0)])

    class CountingPool(ThreadPoolExecutor):
        """Notes, per job, whether it was submitted after the loss and how many jobs ran with it."""

        def __init__(self, n):
            super().__init__(n)
            self.lock, self.running, self.seen = threading.Lock(), set(), []

        def submit(self, fn, order, block):
            after_loss = monitor.lost  # decided on this sample (same thread, just before)

            def job():
                with self.lock:
                    self.running.add(order.seq)
                    self.seen.append((after_loss, len(self.running)))
                try:
                    return fn(order, block)
                finally:
                    with self.lock:
                        self.running.discard(order.seq)

            return super().submit(job)

    cfg = _async_cfg(tiny_cfg).replace(scheduler__queue_depth=0)  # jobs in flight = live slots
    backend = LocalBackend("t-async-lost")
    engine, _ = build_engine(cfg, backend, backend.run_id)
    monitor = Losing(backend.cluster, min_interval_s=0)
    engine.inject(monitor=monitor)
    pools = []
    engine.inject(pool_factory=lambda n: pools.append(CountingPool(n)) or pools[-1])
    summary = engine.run()

    seen = pools[0].seen
    assert any(n == 2 for lost, n in seen if not lost)  # two at once while both executors lived
    assert [n for lost, n in seen if lost] and all(n == 1 for lost, n in seen if lost)
    assert summary["epochs"] == cfg.train.epochs and engine.samples_done >= engine.total_samples
    assert sorted(r["round"] for r in engine.history) == list(range(engine.orders.next_seq))  # each job applied once
    assert {r["block"] for r in engine.history} == set(range(cfg.data.num_blocks))
    assert all((r["executors"], r["slots"]) == (1, 1) for r in engine.history[2:])
    assert (engine.history[0]["executors"], engine.history[0]["slots"]) == (2, 2)


def test_duplicate_results_are_dropped_and_counted(tiny_cfg):
    """A speculative or retried duplicate of a (round, block) result is applied once."""

    class Duplicating(LocalBackend):
        def map_blocks(self, fn, blocks, description="", universe=None, split="train", tree_depth=None):
            acc = super().map_blocks(fn, blocks, description, universe, split, tree_depth)
            return acc + [acc[0]] if tree_depth is not None else acc  # a sync round's gather

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
    assert all((r["executors"], r["slots"]) == (1, 2) for r in jobs)  # local[2]: the driver, 2 slots
    assert summary["test_accuracy"] > 0.6


def test_queue_depth_keeps_one_job_waiting_beyond_the_slots(tiny_cfg):
    """4 blocks, 2 sampled slots, scheduler.queue_depth=1: 3 jobs in flight at most (one waits in
    the backend's queue for a slot), and the run still applies every job once."""

    class TwoSlots(LoadMonitor):
        def _read(self):
            return [ExecutorSample("e1", 1, 0, 0), ExecutorSample("e2", 1, 0, 0)]

    class PeakPool(ThreadPoolExecutor):
        def __init__(self, n):
            super().__init__(n)
            self.lock, self.running, self.peak = threading.Lock(), 0, 0

        def submit(self, fn, order, block):
            def job():
                with self.lock:
                    self.running += 1
                    self.peak = max(self.peak, self.running)
                try:
                    return fn(order, block)
                finally:
                    with self.lock:
                        self.running -= 1

            return super().submit(job)

    cfg = _async_cfg(tiny_cfg).replace(data__num_blocks=4, scheduler__queue_depth=1)
    backend = LocalBackend("t-async-queue")
    engine, _ = build_engine(cfg, backend, backend.run_id)
    engine.inject(monitor=TwoSlots(backend.cluster, min_interval_s=0))
    pools = []
    engine.inject(pool_factory=lambda n: pools.append(PeakPool(n)) or pools[-1])
    engine.run()
    assert pools[0].peak == 3
    assert sorted(r["round"] for r in engine.history) == list(range(engine.orders.next_seq))
    assert all((r["slots"], r["inflight_limit"]) == (2, 3) for r in engine.history)


def test_result_beyond_the_staleness_bound_is_dropped_counted_and_its_block_resyncs(tiny_cfg):
    """ps.max_staleness = 1: a block-0 result computed at version 0 arriving at version 2 is
    dropped (not applied, counted); block 0 then redoes the same steps from a reloaded view."""
    cfg = _async_cfg(tiny_cfg, ps__max_staleness=1, compression__method="threshold",
                     compression__density=0.05, compression__density_down=0.05)
    backend = LocalBackend("t-stale")
    engine, _ = build_engine(cfg, backend, backend.run_id)
    stale_order = engine.order_for_block(0, 2)
    assert engine.on_result(stale_order, 0, *engine._job(stale_order, 0)) is not None  # tau 0: applied
    stale_order = engine.order_for_block(0, 2)          # computed from version 1
    stale_result = engine._job(stale_order, 0)
    for _ in range(2):                                   # block 1 moves the server to version 3
        order = engine.order_for_block(1, 2)
        assert engine.on_result(order, 1, *engine._job(order, 1)) is not None
    version, done, W = engine.version, engine.samples_done, engine.W.copy()
    assert version - stale_order.base_version == 2
    assert engine.on_result(stale_order, 0, *stale_result) is None
    assert engine.counters["stale_dropped"] == 1
    assert engine.version == version and engine.samples_done == done
    np.testing.assert_array_equal(engine.W, W)
    again = engine.order_for_block(0, 2)
    assert again.resync and again.step_offset == stale_order.step_offset  # the same steps again
    assert again.expect_state == stale_order.expect_state  # from the state before the dropped job
    (result,), _, _ = engine._job(again, 0)
    assert result.replica_resync and result.view_bytes == engine.W.nbytes
    assert engine.on_result(again, 0, [result], 0.0, 0.0) is not None
    assert engine.counters["state_resets"] == 0
