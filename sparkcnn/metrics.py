"""Per-round and per-epoch records: JSONL sink and a console progress bar.

Library code never prints; the CLI passes a :class:`ProgressBar` in.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time


class JsonlSink:
    """Appends one JSON object per line; flushed per record so a crash loses nothing written."""

    def __init__(self, path: str, mode: str = "a"):
        self.path = path
        self._fh = open(path, mode, encoding="utf-8")

    def write(self, record: dict) -> None:
        self._fh.write(json.dumps(record, sort_keys=False, default=_jsonable) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def _jsonable(x):
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, (set, tuple)):
        return list(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


class ProgressBar:
    """One self-overwriting line on a TTY, a line every ``every`` rounds otherwise."""

    def __init__(self, stream=None, width: int = 24, every: int = 10):
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.width = width
        self.every = every
        self.t0 = time.time()

    def round(self, rec: dict, total_rounds: int) -> None:
        done = rec["round"] + 1
        frac = done / max(1, total_rounds)
        bar = "#" * int(frac * self.width) + "-" * (self.width - int(frac * self.width))
        eta = (time.time() - self.t0) / frac * (1 - frac) if frac > 0 else math.nan
        line = (f"epoch {rec['epoch'] + 1} round {done}/{total_rounds} [{bar}] "
                f"loss {rec['loss']:.4f} acc {rec['accuracy']:.3f} {rec['images_per_s']:.0f} img/s "
                f"up {fmt_bytes(rec['bytes_up'])} eta {eta:.0f}s")
        if self.tty:
            self.stream.write("\r" + line[:160].ljust(160))
        elif done % self.every == 0 or done == total_rounds:
            self.stream.write(line + "\n")
        self.stream.flush()

    def epoch(self, rec: dict) -> None:
        if self.tty:
            self.stream.write("\n")
        self.stream.write(f"epoch {rec['epoch'] + 1}: test loss {rec['test_loss']:.4f} "
                          f"test accuracy {rec['test_accuracy']:.4f} ({rec['wall_s']:.1f}s)\n")
        self.stream.flush()


def atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)
