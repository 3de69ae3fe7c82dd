"""Checkpoints of the streaming transport: consistent cuts inside a stage, and at its end.

A cut inside a stage (``checkpoint.every_rounds`` applied exchanges, at most one per 50
times the last one's cost): the replies ask every block still training for its state; a
block's next push carries it, and its reply is held until all have arrived, so the server
state written holds exactly the pushes up to each block's state push. With ``ps.shards`` > 1
the server state is a cut of every shard taken after every log entry sent so far.

A mixin of :class:`sparkcnn.transport.stream.StreamEngine`, whose state it reads and writes.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from sparkcnn.transport import tasks
from sparkcnn.protocol import Push, Reply, StageState

log = logging.getLogger(__name__)


class StageCheckpoints:
    def _take_state(self, block: int, p: Push) -> None:
        """Keep the state an applied push carried: the cut's, or its stage's last."""
        if not p.state:
            return
        state = _arrays(p.state)
        if self.cut is not None:
            self.cut[block] = state
        if self.core.block_epoch[block] > self.next_epoch:  # its pass of this stage is done
            self.final_states[block] = state

    def stage_state(self, session, m: StageState | None, refused: str = "") -> Reply:
        """Keep a block's end-of-stage state when ``m.seq`` is its last applied exchange and its
        pass of this stage is done; a state of any other exchange (a push dropped after it was
        sent, a stale rerun) changes nothing. Answered with the block's lr, density and tau, and
        ``refused`` (then ``m`` is None) for a state the service or the check refused."""
        with self.lock:
            if self.failure is not None:
                raise self.failure
            block = session.block
            if m is not None:
                self._check_state(m.state)  # WireError: refused by the service, back here with None
                if m.seq == self.core.last_seq[block] and self.core.block_epoch[block] > self.next_epoch:
                    self.final_states[block] = _arrays(m.state)
            lr, density = self.driver.schedule(min(self.core.epoch_float, self.cfg.train.epochs))
            return Reply(lr=lr, density=density, tau=self.tau.get(block, 0), retrain=False, send_state=False,
                         refused=refused, dense=b"", dense_version=-1)

    def _checkpoint_due(self) -> bool:
        every = self.cfg.checkpoint.every_rounds
        return (self.driver.run_dir is not None and every > 0 and self.core.exchanges - self.ckpt_at >= every
                and time.perf_counter() - self.ckpt_t >= 50 * self.ckpt_cost_s)  # under 2 % of the run

    def _settled(self, block: int) -> bool:
        """Whether ``block``'s state for the cut is known: it sent it, its stage is done, or it
        has not pushed in this stage yet (it is where the stage started it)."""
        c = self.core
        return block in self.cut or c.block_epoch[block] > self.next_epoch or c.last_seq[block] < self.plans[block].seq0

    def _gather_cut(self) -> None:
        """Async: hold this block until every block still training has sent its state, then write."""
        if all(self._settled(k) for k in self.block_rows):
            self._write_cut()
            self.cond.notify_all()
            return
        cut = self.cut
        if not self.cond.wait_for(lambda: self.cut is not cut or self.failure is not None,
                                  timeout=self.cfg.engine.stream_timeout_s):
            log.warning("checkpoint at exchange %s: blocks %s sent no state in time; skipped",
                        self.core.exchanges, sorted(set(self.block_rows) - set(cut)))
            self.cut = None
            self.cond.notify_all()

    def _write_cut(self) -> None:
        blocks = {k: self.cut.get(k, self.final_states.get(k, self.stage_states.get(k))) for k in self.block_rows}
        self.cut = None
        t0 = time.perf_counter()
        # no job can run beside the stage: a block whose state did not come restarts from zero (counted)
        self.save_checkpoint(self.next_epoch, {k: s for k, s in blocks.items() if s is not None}, read=False)
        self.ckpt_at, self.ckpt_t = self.core.exchanges, time.perf_counter()
        self.ckpt_cost_s = self.ckpt_t - t0

    def save_checkpoint(self, next_epoch: int, states: dict, read: bool = True) -> str:
        """The server, the cursors and each block's state (``read``: a state the pushes did not
        carry is read where the task spilled it, by one small job)."""
        if self.driver.shards is not None:  # a cut of the shards, after every step sent so far
            self.driver.shards.refresh(self.driver.ps)
        missing = {k: self.core.last_seq[k] for k in self.block_rows if k not in states}
        blocks = {**states, **(tasks.block_states(self.backend, self.spec, missing, self.num_blocks)
                                if read and self.backend.resident else {})}
        st = {"next_epoch": next_epoch, **self.core.state_dict()}
        return self.driver.save_checkpoint(self.core.exchanges, st, blocks)

    def restore(self, ckpt) -> int:
        st = self.driver.restore(ckpt)
        self.next_epoch = int(st["next_epoch"])
        self.core.load_state_dict(st)
        self.initial_states = {int(k): v for k, v in ckpt.blocks.items()}
        return self.next_epoch


def _arrays(arrays) -> dict:
    """A message's state arrays (checked float32 of P entries) by name."""
    return {a.name: np.frombuffer(a.data, np.float32) for a in arrays}
