"""What a stream task keeps between its exchanges, besides the training itself (:mod:`.streamwork`).

    Cursor    the exchange the block trains next: seq, first step, steps left in the stage; the
              highest seq pushed and the highest kept; the stage's rerun count; the refusals in a row
    Offer     what the server's last reply offered: the lr, the density, whether to send the state
    Tally     what the next push reports of the last reply (wait, downlink bytes, a resync, a reset)
              and the stage's totals (exchanges, samples, exposed communication)
    CpuMeter  the task's CPU outside TensorFlow between two pushes
    Pending   the push in flight: its reply's future and what puts the block back if it is dropped

Plain bookkeeping, no arrays: each exchange costs a few attribute writes and one ``Pending``.
Nothing here imports Spark.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass

from sparkcnn.protocol import Push, Reply, StreamPlan


class Cursor:
    """Where the block stands in its stage.

    A push takes the steps ``step .. step + n - 1`` as exchange ``seq`` and moves the cursor
    past them; a reply that sends it back (``Reply.retrain``) rewinds it to that push, so the
    same seq and steps train again. A seq at or below ``pushed_to`` is a retrain, never a first try.
    """

    def __init__(self, plan: StreamPlan, attempt: int):
        self.seq = plan.seq0          # the next push's exchange number
        self.step = plan.first_step   # the block's step (across epochs) the next push starts at
        self.left = plan.steps        # the stage's steps not pushed yet
        self.pushed_to = self.seq - 1  # the highest seq pushed
        self.last_seq = -1            # the highest seq the server kept (-1: none yet this stage)
        self.attempt = attempt        # the stage's rerun count (0: its first run)
        self.refusals = 0             # replies in a row that refused the push they answered

    def first_try(self) -> bool:
        """Whether the push at ``seq`` is neither a rerun nor a retrain; marks it pushed."""
        first = self.attempt == 0 and self.seq > self.pushed_to
        self.pushed_to = max(self.pushed_to, self.seq)
        return first

    def advance(self, n: int) -> None:
        """Past a push of ``n`` steps."""
        self.seq, self.step, self.left = self.seq + 1, self.step + n, self.left - n

    def kept(self, seq: int) -> None:
        """The server kept exchange ``seq``."""
        self.refusals, self.last_seq = 0, seq

    def refused(self, reason: str) -> int:
        """A reply sent a push back, refused (``reason``) or too stale (empty); returns the
        refusals in a row."""
        self.refusals = self.refusals + 1 if reason else 0
        return self.refusals

    def rewind(self, push: Push, left: int) -> None:
        """Back to ``push``, sent back by its reply, with ``left`` steps left as before it."""
        self.seq, self.step, self.left = push.seq, push.first_step, left


class Offer:
    """The server's offer for the next exchange, as of its last reply."""

    def __init__(self, start: Reply):
        self.lr = start.lr                  # the learning rate of the next exchange's steps
        self.density = start.density        # the fraction of entries the next push may send
        self.send_state = start.send_state  # the next push carries the block state (a checkpoint)

    def take(self, reply: Reply) -> None:
        self.lr, self.density, self.send_state = reply.lr, reply.density, reply.send_state


class Tally:
    """What the pushes report beside their delta, and the stage's totals."""

    def __init__(self, reset: bool):
        self.wait_s = 0.0        # s the task waited for the last reply (reported by the next push)
        self.down_bytes = 0      # bytes of the last reply's weights part (reported by the next push)
        self.resyncs_sent = 0    # the view's replica resyncs already reported
        self.reset = reset       # the block state restarted from zero (reported by the first push)
        self.exchanges = 0       # pushes sent this stage
        self.samples = 0         # samples they trained on
        self.exposed = 0.0       # s waited for replies, summed: the communication compute did not hide

    def waited(self, wait_s: float) -> None:
        self.wait_s = wait_s
        self.exposed += wait_s

    def took(self, down_bytes: int) -> None:
        self.down_bytes = down_bytes

    def resynced(self, resyncs: int) -> None:
        """The view's resyncs up to ``resyncs`` are reported."""
        self.resyncs_sent = resyncs

    def pushed(self, samples: int) -> None:
        """A push of ``samples`` samples is on its way; the reset went with the first."""
        self.reset = False
        self.exchanges += 1
        self.samples += samples


class CpuMeter:
    """The task's CPU outside TensorFlow, push by push: this thread outside the trainer's TF
    calls (the view, lookahead, momentum policy, codec, messages), and the link's push thread
    (the socket's reads, writes and MACs). TF's own threads are not in it.

        overhead = Δ thread_time − Δ trainer.tf_thread_s + Δ link.cpu_s   (s, since the last call)
    """

    def __init__(self, trainer, link):
        self.trainer, self.link = trainer, link  # read only: their CPU sums
        self.marks = self._now()  # where the three sums stood at the last call

    def _now(self) -> tuple[float, float, float]:
        return time.thread_time(), self.trainer.tf_thread_s, self.link.cpu_s

    def overhead(self) -> float:
        """The CPU outside TensorFlow since the last call (s); the push thread's share is of the
        pushes landed by now."""
        now, last = self._now(), self.marks
        self.marks = now
        return (now[0] - last[0]) - (now[1] - last[1]) + (now[2] - last[2])


@dataclass(frozen=True, slots=True)
class Pending:
    """The push in flight, until its reply is taken."""

    future: Future   # of (the Reply, the shards' parts or None), from Link.send
    push: Push
    before: dict     # the block state before the push's exchange: put back if it is sent back
    left: int        # the stage's steps left before the push
