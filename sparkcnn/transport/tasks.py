"""The functions Spark runs for a run, built on the driver from plain values.

Each ``*_task`` returns ``fn(block, ctx)`` for :meth:`Backend.map_blocks` (with
``tree_depth`` for a sync round); the closure captures the spec, the order or the
weights, and imports the worker module only when it runs on an executor, so
the driver side never imports the executor's modules (nor TensorFlow).
:func:`evaluate` and :func:`block_states` are the two small jobs every
transport runs besides its exchanges.
"""

from __future__ import annotations

from sparkcnn.protocol import ExchangeOrder, TaskSpec


def _on_worker(name: str, spec: TaskSpec, arg):
    """``fn(block, ctx)`` calling ``sparkcnn.worker.jobs.<name>(spec, arg, block, ctx)`` on the executor."""

    def fn(block, ctx):
        from sparkcnn.worker import jobs as worker_jobs

        return getattr(worker_jobs, name)(spec, arg, block, ctx)

    return fn


def round_task(spec: TaskSpec, order: ExchangeOrder):
    """One block's share of ``order`` -> :class:`~sparkcnn.protocol.ExchangeResult`."""
    return _on_worker("run_block_exchange", spec, order)


def eval_task(spec: TaskSpec, weights: bytes):
    """One test block evaluated at ``weights`` -> :class:`~sparkcnn.protocol.EvalResult`."""
    return _on_worker("run_block_eval", spec, weights)


def state_task(spec: TaskSpec, tags: dict):
    """Checkpoint: each block's state as left by exchange ``tags[block]`` -> (block, state or None)."""
    return _on_worker("load_block_state", spec, tags)


def evaluate(backend, spec: TaskSpec, weights, epoch: int) -> dict:
    """Test loss and accuracy of ``weights`` (float32) over the test blocks: one job."""
    if not spec.test_blocks:  # no test data given
        return {"test_loss": None, "test_accuracy": None, "test_samples": 0}
    desc = f"sparkcnn {spec.run_id} epoch {epoch + 1} evaluate"
    res = backend.map_blocks(eval_task(spec, weights.tobytes()), list(range(spec.test_blocks)), desc,
                             universe=spec.test_blocks, split="test")
    n = sum(r.samples for r in res)
    return {"test_loss": sum(r.loss_sum for r in res) / max(1, n),
            "test_accuracy": sum(r.correct for r in res) / max(1, n), "test_samples": n}


def block_states(backend, spec: TaskSpec, tags: dict[int, int], universe: int) -> dict:
    """Each block's state as left by exchange ``tags[block]`` (blocks at -1 have none yet), read
    where it lives by one small job; a state that is gone is left out."""
    tags = {k: v for k, v in tags.items() if v >= 0}
    if not tags:
        return {}
    desc = f"sparkcnn {spec.run_id} checkpoint block states"
    got = backend.map_blocks(state_task(spec, tags), sorted(tags), desc, universe=universe)
    return {block: state for block, state in got if state is not None}
