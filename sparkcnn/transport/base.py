"""What every transport shows its callers (train, benchmarks, tests): the run's weights,
version, counters and records, read through its :class:`~sparkcnn.server.run.Run`."""

from __future__ import annotations

import time

import numpy as np

from sparkcnn.clock import process_started
from sparkcnn.server.run import Run


class Transport:
    """Read-only views of ``self.server``, the run a transport carries results to."""

    server: Run

    @property
    def W(self) -> np.ndarray:
        return self.server.W

    @property
    def version(self) -> int:
        return self.server.version

    @property
    def counters(self) -> dict:
        return self.server.counters.as_dict()

    @property
    def history(self) -> list[dict]:
        return self.server.history

    @staticmethod
    def warmed_up(started: float | None) -> float:
        """Seconds since ``started`` (the placement of the blocks began): the run's warm-up."""
        return 0.0 if started is None else time.perf_counter() - started

    @staticmethod
    def first_step_s(results) -> float | None:
        """Seconds from this process's start to the earliest end of a first step among ``results``
        (results of this engine's first exchange: the run's start-up as a user waits for it); None
        when none stepped. The executors' clocks are taken to agree with this one (one machine)."""
        ended = [r.first_step_at for r in results if r.first_step_at > 0]
        return min(ended) - process_started() if ended else None
