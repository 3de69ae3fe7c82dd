"""One stream stage (an epoch): each block's plan, its streams, and the block states it starts
from and ends with.

    plan:   from each block's cursor, its first seq and step and the steps left in the pass;
            a block that finished this pass before a mid-epoch checkpoint (a resumed run)
            has no steps: its cursor is already at the next pass, which the next stage trains
    open:   a task's stream gets its block's plan, with the stage's rerun count (a rerun barrier
            stage starts its tasks at Spark attempt 0 again, so the opens are counted)
    states: what each block starts the stage from (the previous stage's end, or a checkpoint),
            and the state its last applied push, or its end-of-stage message, carried
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sparkcnn.protocol import StreamPlan


class Stage:
    """The current stage's plans and streams, and the block states between stages."""

    def __init__(self, h: int, lookahead: bool, overlap: bool):
        self.h, self.lookahead, self.overlap = h, lookahead, overlap
        self.epoch = 0                       # the stage (epoch) being trained, or next
        self.plans: dict[int, StreamPlan] = {}
        self.opens: dict[int, int] = {}      # streams opened per block in this stage (its attempt + 1)
        self.streams = 0                     # streams opened in the run (each one's number on the shards)
        self.initial: dict = {}              # block -> state from a checkpoint, for the next stage
        self.final: dict = {}                # block -> state its last push of the stage carried
        self.start: dict = {}                # block -> state it started this stage from (when known)
        self.pushes: dict[int, dict] = {}    # BSP: seq -> block -> (session, push) to answer

    def plan(self, cursors, pass_end: dict[int, int]) -> None:
        """Each block's share of the stage, from its cursor (module docstring)."""
        self.start = {**self.final, **self.initial}
        left = {k: 0 if cursors.block_epoch[k] > self.epoch else pass_end[k] - cursors.block_step[k]
                for k in pass_end}
        # a block with no steps ends the stage where it starts it
        self.final = {k: s for k, s in self.start.items() if not left[k]}
        self.opens, self.pushes = {}, {}
        self.plans = {k: StreamPlan(seq0=cursors.last_seq[k] + 1, first_step=cursors.cursor(k), steps=left[k],
                                    h=self.h, expect_state=cursors.last_seq[k], lookahead=self.lookahead,
                                    overlap=self.overlap, attempt=0)
                      for k in pass_end}

    def task_states(self, resident: bool) -> dict:
        """States the stage's tasks start from, given to them by the driver: a checkpoint's;
        and every block's when no executor keeps them (``resident`` false)."""
        initial, self.initial = self.initial, {}
        return initial if resident else {**self.final, **initial}

    def open(self, block: int) -> tuple[StreamPlan, int] | None:
        """The plan of a new stream of ``block`` and the stream's number; None: no plan."""
        plan = self.plans.get(block)
        if plan is None:
            return None
        self.opens[block] = self.opens.get(block, 0) + 1
        self.streams += 1
        return dataclasses.replace(plan, attempt=self.opens[block] - 1, stream=self.streams), self.streams

    def keep_push(self, session, push) -> None:
        """BSP: a push held until its round is complete (its sender's reply waits)."""
        self.pushes.setdefault(push.seq, {})[session.block] = (session, push)

    def take_pushes(self, seq: int, blocks: tuple, session, push) -> list:
        """BSP: whom to answer for round ``seq``, which the run applied with ``blocks`` (the run
        decides who is in a round; the stage only keeps how to answer them); ``session``'s
        ``push`` completed it."""
        held = self.pushes.pop(seq, {})
        held[session.block] = (session, push)
        return [held[b] for b in blocks]

    def done(self, cursors, block: int) -> bool:
        """Whether ``block``'s pass of this stage is applied."""
        return cursors.block_epoch[block] > self.epoch

    def keep_final(self, cursors, block: int, state) -> None:
        """An applied push's or end-of-stage message's state: the stage's last, once its pass is done."""
        if self.done(cursors, block):
            self.final[block] = arrays(state)

    def ended(self) -> None:
        self.epoch += 1

    def restore(self, epoch: int, blocks: dict) -> None:
        self.epoch = epoch
        self.initial = {int(k): v for k, v in blocks.items()}


def arrays(state) -> dict:
    """A message's state arrays (checked float32 of P entries) by name."""
    return {a.name: np.frombuffer(a.data, np.float32) for a in state}
