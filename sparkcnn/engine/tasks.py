"""The functions Spark runs for a run, built on the driver from plain values.

Each returns ``fn(block, ctx)`` for :meth:`Backend.map_blocks` /
:meth:`Backend.gather_blocks`; the closure captures the spec, the order or the
weights, and imports the worker module only when it runs on an executor, so
the driver side never imports the executor's modules (nor TensorFlow).
"""

from __future__ import annotations

from sparkcnn.protocol import RoundOrder, TaskSpec


def _on_worker(name: str, spec: TaskSpec, arg):
    """``fn(block, ctx)`` calling ``sparkcnn.worker.round.<name>(spec, arg, block, ctx)`` on the executor."""

    def fn(block, ctx):
        from sparkcnn.worker import round as worker_round

        return getattr(worker_round, name)(spec, arg, block, ctx)

    return fn


def round_task(spec: TaskSpec, order: RoundOrder):
    """One block's share of ``order`` -> :class:`~sparkcnn.protocol.RoundResult`."""
    return _on_worker("run_block_round", spec, order)


def eval_task(spec: TaskSpec, weights: bytes):
    """One test block evaluated at ``weights`` -> :class:`~sparkcnn.protocol.EvalResult`."""
    return _on_worker("run_block_eval", spec, weights)


def state_task(spec: TaskSpec, tags: dict):
    """Checkpoint: each block's state as left by exchange ``tags[block]`` -> (block, state or None)."""
    return _on_worker("load_block_state", spec, tags)
