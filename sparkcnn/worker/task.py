"""The start every training task shares, whatever its transport (DESIGN §5, §9).

A job's round (:mod:`.round`) and a stream's stage (:mod:`.stream`) begin the same way::

    root      the spec's override, else the executor's local directory, else a per-user temp dir
    block     its images and labels, resident in this process or the executor's spill
    trainer   this process's model, its TensorFlow bound to the task's GPUs (trainer.get_trainer)
    policy    make_policy(spec's method, momentum mode, ...): the block's momentum and
              sparsification rule (None: dense)
    executor  "host:realpath(root)", the same for every task and Python worker of an executor
    state     the checkpoint's (a resumed run), else what exchange ``expect`` left in the
              executor's store, else zero momentum and residual (a reset, counted)

and both turn the server's downlinks into what a replica applies with :func:`downlinks`.
Nothing here imports Spark.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from sparkcnn.compression import codec
from sparkcnn.compression.feedback import make_policy
from sparkcnn.protocol import TaskContextInfo, TaskSpec
from sparkcnn.worker import blockstore
from sparkcnn.worker.trainer import Trainer, get_trainer

log = logging.getLogger(__name__)


def local_root(spec: TaskSpec, ctx: TaskContextInfo) -> str:
    """Where this executor keeps block data and state: the spec's override, the executor's
    local directory, or a per-user temp dir (in-process runs)."""
    return spec.local_root or ctx.local_dir or os.path.join(tempfile.gettempdir(), f"sparkcnn-{os.getuid()}")


@dataclass(frozen=True, eq=False)
class TaskStart:
    """What a training task holds before its first step (module docstring)."""

    spec: TaskSpec
    block: int
    root: str                # the executor's directory for block data and state
    executor: str            # "host:local dir": names the executor across its tasks and Python workers
    images: np.ndarray       # the block's rows, uint8 N x H x W x C
    labels: np.ndarray       # int32 N
    trainer: Trainer
    policy: object           # the block's momentum policy (compression.feedback), None when dense
    t0: float                # time.perf_counter() when the task began

    def state(self, initial: dict, expect: int, wait_s: float = 0.0) -> tuple[dict, bool, bool]:
        """(state, reset, stale): the block state the task continues from.

        ``initial`` (block -> arrays) is a checkpoint's, taken as it is; else the state exchange
        ``expect`` (>= 0) left here, polled for ``wait_s`` seconds. Pipelined (``wait_s`` > 0):
        when exchange ``expect``'s task on this block is still queued behind this one, the state
        of the exchange before it (bounded staleness 1, as for the weights; ``stale``). A state
        that is gone restarts from zero momentum and residual (``reset``)."""
        spec, block = self.spec, self.block
        if block in initial:  # resumed run: the checkpoint carries the block's state
            return dict(initial[block]), False, False
        state = (blockstore.load_state(self.root, spec.run_id, block, expect, wait_s=wait_s)
                 if expect >= 0 else None)
        stale = False
        if state is None and expect >= 1 and wait_s > 0:  # pipelined: take the one before (counted)
            state = blockstore.load_state(self.root, spec.run_id, block, expect - 1)
            stale = state is not None
        if expect >= 0 and state is None:
            log.warning("block %s: state of exchange %s gone; restarting from zero momentum and residual",
                        block, expect)
            return {}, True, False
        return state or {}, False, stale


def start_task(spec: TaskSpec, ctx: TaskContextInfo, block: int, name: str) -> TaskStart:
    """Begin a task on ``block``: its data, this process's trainer and a fresh policy (module
    docstring). ``name`` says which task, for the trainer's errors (``"<name> attempt <n>"``)."""
    t0 = time.perf_counter()
    root = local_root(spec, ctx)
    images, labels = blockstore.get_block(root, spec.run_id, "train", spec.num_blocks, block)
    trainer = get_trainer(spec, ctx, f"{name} attempt {ctx.attempt}")
    policy = make_policy(spec.method, spec.momentum_mode, spec.per_step, spec.layout, spec.value_dtype,
                         spec.dense_below, spec.momentum, masking=spec.factor_masking)
    executor = f"{socket.gethostname()}:{os.path.realpath(root)}"
    return TaskStart(spec, block, root, executor, images, labels, trainer, policy, t0)


def downlinks(msgs, layout) -> list:
    """The server's :class:`~sparkcnn.protocol.DownlinkMsg` s, oldest first, as the replica of
    ``U`` applies them (:class:`sparkcnn.replica.Downlink`, the delta decoded)."""
    from sparkcnn.replica import Downlink

    return [Downlink(m.version, codec.decode(m.payload, layout), m.checksum_after, m.base_version, m.assign)
            for m in msgs]


_HEAP_FROZEN = False


def freeze_heap_once() -> None:
    """After the first round in this process (TF loaded, model built and traced), or before a
    stream task opens its stream: collect, then freeze the survivors, so the full GC PySpark runs
    after every task of a reused worker, and the ones Python runs during a long stream task, no
    longer walk TF/Keras objects (measured 0.25-0.5 s per round at H=10 before, ~0.07 s after;
    in a stream task at H = 1, one 0.33 s collection per stage before)."""
    global _HEAP_FROZEN
    if not _HEAP_FROZEN:
        gc.collect()
        gc.freeze()
        _HEAP_FROZEN = True
