"""The functions Spark runs for a run, built on the driver from plain values.

Each returns ``fn(block, ctx)`` for :meth:`Backend.map_blocks` /
:meth:`Backend.gather_blocks`; the closure captures the spec, the order or the
weights, and imports the worker module only when it runs on an executor, so
the driver side never imports the executor's modules (nor TensorFlow).
"""

from __future__ import annotations

from sparkcnn.protocol import RoundOrder, TaskSpec


def round_task(spec: TaskSpec, order: RoundOrder):
    """One block's share of ``order`` -> :class:`~sparkcnn.protocol.RoundResult`."""

    def fn(block, ctx):
        from sparkcnn.worker.round import run_block_round

        return run_block_round(spec, order, block, ctx)

    return fn


def eval_task(spec: TaskSpec, weights: bytes):
    """One test block evaluated at ``weights`` -> :class:`~sparkcnn.protocol.EvalResult`."""

    def fn(block, ctx):
        from sparkcnn.worker.round import run_block_eval

        return run_block_eval(spec, weights, block, ctx)

    return fn


def load_task(spec: TaskSpec, split: str):
    """Warm-up: load a block of ``split`` and build the model in the worker -> the block id."""

    def fn(block, ctx):
        from sparkcnn.worker.round import load_block

        return load_block(spec, split, block, ctx)

    return fn


def state_task(spec: TaskSpec, tags: dict):
    """Checkpoint: each block's state as left by exchange ``tags[block]`` -> (block, state or None)."""

    def fn(block, ctx):
        from sparkcnn.worker.round import load_block_state

        return load_block_state(spec, block, tags[block], ctx)

    return fn
