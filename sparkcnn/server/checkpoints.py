"""When a run checkpoints, and the one place its state is written and read back.

Cadence (``checkpoint.every_rounds`` = ``every``)::

    aligned (sync rounds):  due when exchanges % every == 0     (positions fixed by the round
                            count, so a resumed deterministic run repeats an uninterrupted one)
    else (async, stream):   due when exchanges - last >= every and the time since the last
                            checkpoint is at least 50 times its cost (so they take under 2 %)

The state written (``sparkcnn.checkpoint``'s format: atomic, checksummed, pickle-free):
the parameter server's arrays and counters, the run's counters, schedule and guard, the
records it covers, the transport's own position, the config, and each block's state.
"""

from __future__ import annotations

import time

import numpy as np

from sparkcnn.checkpoint import save_checkpoint

COST_FACTOR = 50  # at most one checkpoint per 50 times the last one's cost: under 2 % of the run


def checkpoint_due(exchanges: int, every: int, *, last_at: int, since_last_s: float, last_cost_s: float,
                   aligned: bool) -> bool:
    """Whether a checkpoint is due after ``exchanges`` applied exchanges (module docstring)."""
    if every <= 0:
        return False
    if aligned:
        return exchanges % every == 0
    return exchanges - last_at >= every and since_last_s >= COST_FACTOR * last_cost_s


class Checkpoints:
    """A run's checkpoints in ``run_dir`` (None: the run keeps none) and their cadence."""

    def __init__(self, run_dir: str | None, every: int):
        self.run_dir, self.every = run_dir, every
        self.written_at: int | None = None   # the position of the latest checkpoint written
        self._last_at = 0                    # applied exchanges at it
        self._last_t = 0.0                   # perf_counter when it was written
        self._cost_s = 0.0                   # what writing it cost

    @property
    def enabled(self) -> bool:
        return self.run_dir is not None

    def due(self, exchanges: int, *, aligned: bool = False) -> bool:
        return self.enabled and checkpoint_due(
            exchanges, self.every, last_at=self._last_at, since_last_s=time.perf_counter() - self._last_t,
            last_cost_s=self._cost_s, aligned=aligned)

    def write(self, position: int, exchanges: int, ps_state: dict, state: dict, blocks: dict,
              t0: float | None = None) -> str:
        """Checkpoint ``r<position>``: ``ps_state``'s arrays as arrays, the rest in the state.
        ``t0``: when the work of this checkpoint began (its cost includes gathering the blocks)."""
        t0 = time.perf_counter() if t0 is None else t0
        state = {"position": position,
                 "ps": {k: int(v) for k, v in ps_state.items() if not isinstance(v, np.ndarray)}, **state}
        path = save_checkpoint(self.run_dir, f"r{position:07d}",
                               arrays={k: v for k, v in ps_state.items() if isinstance(v, np.ndarray)},
                               state=state, blocks=blocks)
        self.noted(position, exchanges, time.perf_counter() - t0)
        return path

    def noted(self, position: int, exchanges: int, cost_s: float) -> None:
        """Checkpoint ``position`` was written at ``exchanges`` and cost ``cost_s`` (by this
        process, or by the driver for the server processes of ``ps.servers`` > 1, whose cadence
        it sets)."""
        self.written_at, self._last_at = position, exchanges
        self._last_t = time.perf_counter()
        self._cost_s = cost_s

    def restored(self, position: int) -> None:
        """A resumed run's latest checkpoint is ``position`` (its mid-epoch cadence starts afresh)."""
        self.written_at = position
