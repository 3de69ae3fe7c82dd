"""Fault injection in the executors' tasks (``chaos.*``; tests and drills only), one rule each,
for every transport.

Each rule strikes a first try only, so that the retry (Spark's next attempt, the stage's rerun,
the exchange trained again) goes through and the run completes::

    fails     fail_task_probability:   strikes(FAIL) on attempt 0: the task raises, its state saved
    kills     kill_worker_probability: strikes(KILL) on attempt 0: the Python worker exits (os._exit)
    holds     hold_every = n, hold_s:  block 0's result of its own exchange e, e mod n = n - 1, on the
                                       exchange's first try, leaves hold_s seconds late (lands stale)
    poisoned  nan_round:               NaN in 1 % of block 0's delta in that exchange
    slowed    slow_executor (block 0), SPARKCNN_CHAOS_SLOW (an executor): compute stretched by it

    strikes(seed, seq, block, stream, p):  uniform draw per (seed, exchange, block, stream) < p

The jobs transport applies every rule; the stream task applies ``kills`` and ``holds``. The
decisions are pure; :func:`fail`, :func:`kill_worker` and :func:`hold` act on them. The
driver's own faults (``chaos.kill_driver_round``, ``chaos.kill_shard_round``) are the server's.
"""

from __future__ import annotations

import logging
import os
import time
from typing import NoReturn

import numpy as np

from sparkcnn.compression.delta import SparseDelta
from sparkcnn.protocol import TaskSpec

log = logging.getLogger(__name__)

FAIL, KILL = 0, 1  # the draw's stream of each probabilistic rule


def strikes(seed: int, seq: int, block: int, stream: int, p: float) -> bool:
    """Whether a fault of probability ``p`` strikes: a reproducible uniform draw per (seed,
    exchange, block, stream), so the same attempts fail on rerun. With ``p = 0`` (chaos off)
    nothing is drawn: a generator costs ~40 µs per exchange, at one step per exchange too."""
    return p > 0 and float(np.random.default_rng([seed, seq, block, stream, 7]).random()) < p


def fails(spec: TaskSpec, seq: int, block: int, attempt: int) -> bool:
    """``chaos.fail_task_probability``: whether the first attempt at exchange ``seq`` of
    ``block`` fails."""
    return attempt == 0 and strikes(spec.seed, seq, block, FAIL, spec.chaos_fail_p)


def fail(block: int, seq: int) -> NoReturn:
    raise RuntimeError(f"chaos: injected failure of block {block} exchange {seq} attempt 0")


def kills(spec: TaskSpec, seq: int, block: int, attempt: int) -> bool:
    """``chaos.kill_worker_probability``: whether the first attempt at exchange ``seq`` of
    ``block`` kills its Python worker."""
    return attempt == 0 and strikes(spec.seed, seq, block, KILL, spec.chaos_kill_p)


def kill_worker(block: int, seq: int) -> NoReturn:
    log.warning("chaos: killing the Python worker (block %s exchange %s)", block, seq)
    os._exit(17)


def holds(spec: TaskSpec, block: int, exchange: int, first_try: bool) -> bool:
    """``chaos.hold_every`` = n: whether block 0's result of its exchange number ``exchange``
    waits ``chaos.hold_s`` before it leaves: every n-th, on that exchange's first try only.

    ``exchange`` is 0-based and counted in the block's own exchanges as its transport numbers
    them: the round (sync jobs), the block's own job count (async jobs: a retrained job is a
    new exchange), the push's seq (stream: a retrain reuses it and is no first try)."""
    n = spec.chaos_hold_every
    return n > 0 and block == 0 and first_try and exchange % n == n - 1


def hold(spec: TaskSpec) -> None:
    time.sleep(spec.chaos_hold_s)


def poisoned(spec: TaskSpec, seq: int, block: int, sent: SparseDelta) -> tuple[SparseDelta, bool]:
    """``chaos.nan_round``: (the delta to send, whether its values travel unchecked). In that
    exchange block 0's first 1 % of values (one at least) become NaN, and every block encodes
    unchecked, so that the server's decoder and guard are what stop it."""
    drill = seq == spec.chaos_nan_seq
    if drill and block == 0 and sent.nnz:
        vals = sent.values.copy()
        vals[: max(1, len(vals) // 100)] = np.nan
        sent = SparseDelta(sent.size, sent.indices, vals)
    return sent, drill


def slowed(spec: TaskSpec, block: int, t1: float, t2: float) -> float:
    """Compute that ran from ``t1`` to ``t2``, stretched by the slowdown factor: the larger of
    SPARKCNN_CHAOS_SLOW in the executor's environment and, on block 0, ``chaos.slow_executor``.
    Returns when it ends."""
    factor = float(os.environ.get("SPARKCNN_CHAOS_SLOW", "1") or 1)
    if block == 0:
        factor = max(factor, spec.chaos_slow)
    if factor > 1:
        time.sleep((factor - 1) * (t2 - t1))
        return time.perf_counter()
    return t2
