"""Checkpoints of the streaming transport: consistent cuts inside a stage, and at its end.

When the run's cadence says a checkpoint is due (``Decision.checkpoint``, server/checkpoints.py),
the replies ask every block still training for its state; a block's next push carries it, and
its reply is held until all have arrived, so the server state written holds exactly the pushes
up to each block's state push. With ``ps.shards`` > 1 the server state is a cut of every shard
taken after every log entry sent so far. The checkpoint itself is the Run's
(:meth:`sparkcnn.server.run.Run.checkpoint`); this module only gathers the block states.
"""

from __future__ import annotations

import logging
import time

from sparkcnn.transport import tasks
from sparkcnn.transport.stage import arrays

log = logging.getLogger(__name__)


class Cut:
    """The block states of a checkpoint being gathered inside a stage (None: none is)."""

    def __init__(self, server, stage, backend, spec, blocks, timeout_s: float):
        self.server, self.stage, self.backend, self.spec = server, stage, backend, spec
        self.blocks, self.timeout_s = tuple(blocks), timeout_s
        self.states: dict | None = None  # block -> its state, while a cut is gathered

    @property
    def open(self) -> bool:
        return self.states is not None

    def wants(self, block: int) -> bool:
        """Whether ``block``'s next push should carry its state."""
        return self.states is not None and block not in self.states

    def begin(self) -> None:
        if self.states is None:
            self.states = {}

    def reset(self) -> None:
        self.states = None

    def take(self, block: int, state) -> None:
        """An applied push's state, for the cut being gathered."""
        if self.states is not None and state:
            self.states[block] = arrays(state)

    def _settled(self, block: int) -> bool:
        """Whether ``block``'s state for the cut is known: it sent it, its stage is done, or it
        has not pushed in this stage yet (it is where the stage started it)."""
        c = self.server.cursors
        return (block in self.states or self.stage.done(c, block)
                or c.last_seq[block] < self.stage.plans[block].seq0)

    def wait_written(self, cond, failed) -> None:
        """Before a push is taken: nothing to wait for here (this process writes its cuts at once;
        a server process of ``ps.servers`` > 1 waits for the driver's)."""

    def complete(self) -> bool:
        return self.states is not None and len(self.states) == len(self.blocks)

    def gather(self, cond, failed) -> None:
        """Async: hold this block until every block still training has sent its state, then
        write (``cond``: the handler's condition, its lock held; ``failed()``: the run failed)."""
        if all(self._settled(k) for k in self.blocks):
            self.write()
            cond.notify_all()
            return
        states = self.states
        if not cond.wait_for(lambda: self.states is not states or failed(), timeout=self.timeout_s):
            log.warning("checkpoint at exchange %s: blocks %s sent no state in time; skipped",
                        self.server.exchange.exchanges, sorted(set(self.blocks) - set(states)))
            self.states = None
            cond.notify_all()

    def write(self) -> None:
        st = self.stage
        blocks = {k: self.states.get(k, st.final.get(k, st.start.get(k))) for k in self.blocks}
        self.states = None
        # no job can run beside the stage: a block whose state did not come restarts from zero (counted)
        self.save(time.perf_counter(), {k: s for k, s in blocks.items() if s is not None}, read=False)

    def save(self, t0: float, states: dict, read: bool = True) -> str:
        """The run's state, the stage's position and each block's state (``read``: a state the
        pushes did not carry is read where the task spilled it, by one small job)."""
        run = self.server
        if run.shards is not None:  # a cut of the shards, after every step sent so far
            run.shards.refresh(run.ps)
        missing = {k: run.cursors.last_seq[k] for k in self.blocks if k not in states}
        blocks = {**states, **(tasks.block_states(self.backend, self.spec, missing, len(self.blocks))
                               if read and self.backend.resident else {})}
        return run.checkpoint(run.exchange.exchanges, {"next_epoch": self.stage.epoch}, blocks, t0=t0)
