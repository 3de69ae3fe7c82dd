"""What a stream task trains with through its stage, and one exchange of that training.

``BlockWork`` holds the block's rows, this process's trainer and the block's momentum policy
(which keep the block state through the stage, :func:`.round.hold_state`), the view of the
server's weights and the lookahead (:mod:`.view`), and the shards' ranges of the model. Each
exchange computes from the view (extrapolated by the lookahead)::

    before = the block state (put back if the push is sent back)
    S = compute(V, the next n minibatches);  payload = encode(S)  (a piece per shard with shards)

and each reply's weights part moves the view and, by the view's motion, the lookahead.
Nothing here imports Spark.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sparkcnn.compression import codec
from sparkcnn.compression.delta import SparseDelta
from sparkcnn.protocol import Reply
from sparkcnn.shards import shard_ranges, split_delta
from sparkcnn.worker.jobs import block_batches, compute, held_state, hold_state
from sparkcnn.worker.task import TaskStart
from sparkcnn.worker.view import Lookahead, View


@dataclass(frozen=True, slots=True)
class Trained:
    """One exchange computed, not pushed yet."""

    n: int              # steps it trained
    before: dict        # the block state before them (BlockWork.snapshot)
    base: int           # the view's version it computed from
    lr: float           # the lr and density it computed with (the server offered them)
    density: float
    sent: SparseDelta   # the delta it sends
    payload: object     # sent, encoded: bytes, or a list of one piece per shard
    loss_sum: float
    correct: int
    seen: int           # samples trained on
    compute_s: float    # s of compute and encoding


class BlockWork:
    """The block's training resources through a stage (module docstring)."""

    def __init__(self, task: TaskStart, start: Reply, parts: list | None, shards: int, lookahead: bool):
        """From the server's first reply ``start`` (and its shards' ``parts``); ``shards``: how
        many shards hold the model (0: the coordinator alone)."""
        spec = task.spec
        self.spec, self.block = spec, task.block
        self.trainer, self.policy = task.trainer, task.policy  # the block's, through the stage
        self.images, self.labels = task.images, task.labels
        self.view = View(spec.sparse_downlink, spec.layout)
        self.view.take(start, parts)
        self.ranges = shard_ranges(spec.layout, shards) if shards else None
        self.look = Lookahead() if lookahead else None
        if self.look:
            self.look.observe(self.view.weights, self.view.version, None)

    def hold(self, state: dict) -> None:
        """The block state to continue from: the policy and the trainer keep it."""
        hold_state(self.spec, self.trainer, self.policy, state)

    def state(self) -> dict:
        return held_state(self.spec, self.trainer, self.policy)

    def snapshot(self) -> dict:
        """The block state before an exchange, kept until its reply, as :meth:`state` names it
        (:meth:`hold` puts it back): in the per-step form the policy's references, intact for
        the two exchanges that reply takes (it steps out of place: ``KEEP``), else copies."""
        if self.spec.per_step and self.policy is not None:
            return {f"policy.{k}": v for k, v in self.policy.snapshot().items()}
        return self.state()

    def compute(self, step: int, n: int, lr: float, density: float) -> Trained:
        """The exchange of steps ``step .. step + n - 1``, from the view (extrapolated by the
        lookahead)."""
        spec, view = self.spec, self.view
        before = self.snapshot()  # put back if this push is dropped
        batches, augment = block_batches(spec, self.block, len(self.labels), step, n)
        w = self.look.weights(view.weights) if self.look else view.weights
        t0 = time.perf_counter()
        sent, _, loss_sum, correct, seen = compute(spec, self.trainer, self.policy, None, w, self.images,
                                                   self.labels, batches, lr, density, live=True,
                                                   augment=augment)
        if self.ranges is None:
            payload = codec.encode(sent, spec.layout, value_dtype=spec.value_dtype)
        else:  # a piece per shard; the guard's norm is of the values as they travel
            payload = [codec.encode(p, spec.layout, value_dtype=spec.value_dtype)
                       for p in split_delta(sent, self.ranges)]
        return Trained(n, before, view.version, lr, density, sent, payload, loss_sum, correct, seen,
                        time.perf_counter() - t0)

    def take(self, reply: Reply, parts: list | None) -> int:
        """A reply's weights part (with shards: their ``parts``) into the view and the
        lookahead; returns its bytes."""
        nbytes = self.view.take(reply, parts)
        if self.look:
            self.look.observe(self.view.weights, self.view.version, reply.tau, self.view.changed)
        return nbytes

