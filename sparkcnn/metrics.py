"""Per-round and per-epoch records: JSONL sink and progress (tqdm).

Library code never prints; the CLI passes a :class:`ProgressBar` in.
"""

from __future__ import annotations

import json
import sys
import time

from sparkcnn import runfs


class JsonlSink:
    """Appends one JSON object per line.

    A local file is flushed per record, so a crash loses nothing written. An object
    store cannot append: the lines are kept here and the whole object is rewritten at
    :meth:`flush` (the driver calls it before each checkpoint, so a checkpoint never
    covers a record that is not stored), every ``FLUSH_S`` seconds, and at close.
    """

    FLUSH_S = 30.0  # longest time a record waits in memory before an object store sees it

    def __init__(self, path: str, mode: str = "a"):
        self.path = path
        self._fh = self._lines = None
        if runfs.is_uri(path):
            kept = runfs.read_text(path) if mode == "a" and runfs.isfile(path) else ""
            self._lines = [kept] if kept else []
            self._dirty, self._flushed_at = False, time.monotonic()
        else:
            self._fh = open(path, mode, encoding="utf-8")

    def write(self, record: dict) -> None:
        self.write_encoded(record, encode_line(record))

    def write_encoded(self, record: dict, line: str) -> None:
        """``record`` as ``line``, its :func:`encode_line` (a server process's, ``ps.servers`` > 1),
        written as it is."""
        if self._fh is not None:
            self._fh.write(line)
            self._fh.flush()
            return
        self._lines.append(line)
        self._dirty = True
        if time.monotonic() - self._flushed_at >= self.FLUSH_S:
            self.flush()

    def flush(self) -> None:
        """Make every record written so far durable (local files already are)."""
        if self._fh is None and self._dirty:
            runfs.write_text(self.path, "".join(self._lines))
            self._dirty, self._flushed_at = False, time.monotonic()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
        else:
            self.flush()


def encode_line(record: dict) -> str:
    """A record's line in ``metrics.jsonl``, newline included: the one encoding, whichever process
    makes it (a server process encodes its records once, and the driver writes them as they are)."""
    return json.dumps(record, sort_keys=False, default=_jsonable) + "\n"


def _jsonable(x):
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, (set, tuple)):
        return list(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def read_jsonl(path: str) -> list[dict]:
    """The records of a JSONL file (a local path or a URI)."""
    return [json.loads(line) for line in runfs.read_text(path).split("\n") if line.strip()]


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


class ProgressBar:
    """Progress of a run through ``tqdm.auto``: a widget in notebooks, a bar on a terminal,
    and on any other stream (a log file, a pipe) plain lines: one each time another
    ``1/lines`` of the run's rounds is done, plus one per epoch, so a whole run prints at
    most ``lines`` round lines and ``epochs`` epoch lines.

    The engine calls ``round(record, total_rounds)`` after every round (async: every job,
    with ``round`` scaled to ``total_rounds`` = 1000) and ``epoch(record)`` after every epoch.
    """

    def __init__(self, stream=None, lines: int = 20, notebook: bool | None = None):
        from tqdm.auto import tqdm

        self.stream = stream  # None: sys.stderr when written (a notebook's, a test's capture)
        self.lines = max(1, lines)
        self._tqdm = tqdm
        if notebook is None:  # tqdm.auto picked its widget class: an IPython kernel with ipywidgets
            notebook = any(c.__module__ == "tqdm.notebook" for c in tqdm.__mro__)
        out = self._out()
        self.mode = "notebook" if notebook else "tty" if hasattr(out, "isatty") and out.isatty() else "lines"
        self._bar = None
        self._first = None      # rounds done when the first round is seen (a resumed run starts late)
        self._t0 = None
        self._printed = 0       # lines mode: the last 1/lines step printed

    def _out(self):
        return self.stream or sys.stderr

    def round(self, rec: dict, total_rounds: int) -> None:
        done, total = rec["round"] + 1, max(1, total_rounds)
        if self._t0 is None:  # the rate counts from the first round seen (not from a resume's start)
            self._t0, self._first = time.monotonic(), done
            self._printed = (done - 1) * self.lines // total
        postfix = (f"loss={rec['loss']:.4f}, acc={rec['accuracy']:.3f}, "
                   f"{rec['images_per_s']:.0f} img/s, up={fmt_bytes(rec['bytes_up'])}")
        desc = f"epoch {rec['epoch'] + 1}"
        if self.mode == "lines":
            step = done * self.lines // total
            if step > self._printed:
                self._printed = step
                line = self._tqdm.format_meter(
                    done, total, time.monotonic() - self._t0, initial=self._first, unit="round", prefix=desc,
                    postfix=postfix, bar_format="{desc}: {n_fmt}/{total_fmt} rounds ({percentage:.0f}%) "
                                                "[{elapsed}<{remaining}, {rate_fmt}{postfix}]")
                self._out().write(line + "\n")
                self._out().flush()
            return
        if self._bar is None:
            self._bar = self._open(total)
            if self._bar is None:  # no widget after all (ipywidgets missing): lines
                self.mode = "lines"
                return self.round(rec, total_rounds)
        self._bar.set_description(desc, refresh=False)
        self._bar.set_postfix_str(postfix, refresh=False)
        self._bar.update(max(0, done - self._bar.n))
        if done >= total:
            self.close()

    def _open(self, total: int):
        kw = {} if self.mode == "notebook" else {"file": self._out(), "dynamic_ncols": True}
        try:
            return self._tqdm(total=total, initial=self._first, unit="round", leave=True, mininterval=0.2,
                              **kw)
        except ImportError:
            return None

    def epoch(self, rec: dict) -> None:
        line = (f"epoch {rec['epoch'] + 1}: test loss {rec['test_loss']:.4f} "
                f"test accuracy {rec['test_accuracy']:.4f} ({rec['wall_s']:.1f}s)")
        if self.mode == "lines" or self._bar is None and self.mode == "tty":
            self._out().write(line + "\n")
            self._out().flush()
        else:  # above the bar, which is drawn again below it
            self._tqdm.write(line, file=None if self.mode == "notebook" else self._out())

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def atomic_write_text(path: str, text: str) -> None:
    """Replace ``path`` (a local path or a URI) with ``text`` whole (see :mod:`sparkcnn.runfs`)."""
    runfs.write_text(path, text)
