"""Runs kept on disk, so that a bench of many hours can be invoked again and go on where it stopped.

A bench whose runs take longer together than one sitting (the CIFAR-10 seed table, its slow
links) keeps each finished run as one JSON file in a folder of its results (``--runs DIR``):
the run's figures, what it ran (``key``: name, overrides, epochs, data, config file) and the
provenance of the invocation that made it. Invoked again with the same folder, the bench reuses
a kept run instead of training it again only when that run is still fresh: made from a clean
tree whose ``sparkcnn/``, ``conf/``, ``pyproject.toml`` and the bench's own modules are as they
are now, with the same installed versions (bench/fresh.py's rule for a result). A stale run is
trained again and replaced. So the bench's last invocation prints the whole table from runs
that all describe the tree it ran at, each naming the invocation it came from (``made``).

``--budget-min M``: no run starts once M minutes of the invocation have passed; the bench then
stops with ``Incomplete`` (exit ``EXIT_INCOMPLETE``: neither a result nor a crash), and the next
invocation goes on.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

from bench import fresh
from bench._common import log, portable_path, provenance

EXIT_INCOMPLETE = 4  # stopped at its budget with runs still to make; invoke it again to go on


class Incomplete(Exception):
    """The budget ran out before every run was made."""


def _key(name: str, overrides: list[str], epochs: int, data: str, config_file: str) -> dict:
    return {"name": name, "overrides": list(overrides), "epochs": epochs, "data": data, "config_file": config_file}


class RunStore:
    """One JSON file per finished run in ``folder``, reused while fresh (see the module)."""

    def __init__(self, folder: str, script: str, budget_min: float | None = None, root: str = fresh.ROOT):
        self.folder, self.script, self.root = folder, script, root
        self.deadline = time.monotonic() + 60 * budget_min if budget_min else None
        self.reused = self.made = 0
        os.makedirs(folder, exist_ok=True)

    def path_of(self, key: dict) -> str:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
        return os.path.join(self.folder, f"{key['name']}-{digest}.json")

    def stale(self, record: dict) -> str | None:
        """Why a kept run cannot be reused (one phrase), or None."""
        made = record.get("made") or {}
        commit = made.get("git_commit")
        if not isinstance(commit, str) or not commit:
            return "no commit recorded"
        if made.get("git_dirty"):
            return f"made at {commit[:7]} from a tree with uncommitted changes"
        versions = fresh.installed_versions()
        differ = [k for k in fresh.VERSIONS if made.get(k) != versions.get(k)]
        if differ:
            return f"{differ[0]} {made.get(differ[0])} when made, {versions.get(differ[0])} installed"
        return fresh.changed_since(commit, [*fresh.MEASURED, *fresh.bench_imports(self.script, self.root)],
                                   self.root)

    def kept(self, key: dict) -> dict | None:
        """The fresh kept run of ``key``, or None (a stale or unreadable one is said and ignored)."""
        path = self.path_of(key)
        try:
            with open(path, encoding="utf-8") as fh:
                record = json.load(fh)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log("runs: %s unreadable (%s): trained again", os.path.basename(path), e)
            return None
        why = self.stale(record) if record.get("key") == key else "another run's key"
        if why:
            log("runs: %s not reused: %s", os.path.basename(path), why)
            return None
        return record

    def runner(self, run):
        """``run`` (``run_variant``'s arguments) reusing kept runs and keeping the ones it makes."""

        def stored(data: str, name: str, overrides: list[str], epochs: int, out_dir: str,
                   config_file: str) -> dict:
            key = _key(name, overrides, epochs, portable_path(data), config_file)
            record = self.kept(key)
            if record is not None:
                self.reused += 1
                log("runs: %s reused (made at %s)", name, str(record["made"].get("git_commit"))[:7])
                return {**record["run"], "made": record["made"]}
            if self.deadline is not None and time.monotonic() > self.deadline:
                raise Incomplete(f"budget spent: {self.made} run(s) made, {self.reused} reused")
            result = run(data, name, overrides, epochs, out_dir, config_file=config_file)
            made = {k: v for k, v in provenance().items() if k != "machine"}
            path = self.path_of(key)
            tmp = f"{path}.tmp-{os.getpid()}"
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump({"key": key, "made": made, "run": result}, fh, indent=1)
            os.replace(tmp, path)
            self.made += 1
            return {**result, "made": made}

        return stored
