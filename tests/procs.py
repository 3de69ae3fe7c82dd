"""The processes of this machine whose command line names a module: the parameter server's own
processes (key-range shards, server processes) must all be gone when a run ends or fails."""

from __future__ import annotations

import glob
import os


def pids_running(module: str) -> list[int]:
    """Process ids whose argv holds ``module`` as one argument (``python -m module ...``)."""
    out = []
    for d in glob.glob("/proc/[0-9]*"):
        try:
            with open(os.path.join(d, "cmdline"), "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        if module.encode() in cmd:
            out.append(int(os.path.basename(d)))
    return out
