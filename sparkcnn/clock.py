"""When this process started, on the wall clock: the origin of a run's start-up figures.

A run's ``first_step_s`` (seconds from the driver process's start to its first training step's
end, in the first exchange's record and the summary) counts the interpreter's own start and its
imports too, which a timer started in ``main`` would miss.
"""

from __future__ import annotations

import os
import time

_IMPORTED = time.time()  # the fallback origin: where /proc is not there to read


def process_started() -> float:
    """Seconds since the epoch at which this process started.

    On Linux, the kernel's start time of the process (``/proc/self/stat`` field 22, in clock ticks
    since boot: 10 ms at the usual 100 Hz) against the boot clock now; elsewhere, or when that reads
    as later than now, the time this module was first imported (later than the start: a lower bound
    of what the figures measure)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        ticks = os.sysconf("SC_CLK_TCK")
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / ticks  # field 22: 3rd is [0]
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED
    started = time.time() - age
    return started if 0 <= age and started <= _IMPORTED else _IMPORTED
