"""Whether a rendered document's results still describe the code: each result's commit against HEAD.

A result is fresh when the library it measured is the library at HEAD: ``git diff <commit> HEAD
-- sparkcnn/`` is empty for the commit its provenance names, and its tree was clean when it
started. Changes elsewhere (tests, docs, the benchmarks' own scripts) leave it fresh; a
benchmark whose script changed since measures what its JSON says it measured.

    python bench/render.py --check-fresh [--out BENCHMARKS.md]

reads the results folder the document names (its ``<!-- results: DIR -->`` line) and exits 1,
one line per stale result, when any is stale; 2 when the document names no folder or the folder
holds no result.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBRARY = "sparkcnn"
RESULTS_LINE = re.compile(r"^<!-- results: (.+?) -->$", re.M)


def results_dir_of(doc_text: str) -> str | None:
    """The results folder a rendered document names, or None."""
    m = RESULTS_LINE.search(doc_text)
    return m.group(1).strip() if m else None


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, timeout=60)


def library_changed(commit: str, head: str = "HEAD") -> str | None:
    """None when ``sparkcnn/`` is the same at ``commit`` and ``head``, else why not (one phrase)."""
    if _git("cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
        return f"commit {commit[:12]} is not in this repository"
    diff = _git("diff", "--name-only", commit, head, "--", LIBRARY)
    if diff.returncode != 0:
        return f"git diff {commit[:12]} {head} failed: {diff.stderr.strip()[:200]}"
    files = [ln for ln in diff.stdout.splitlines() if ln]
    if files:
        return f"{LIBRARY}/ differs from {head} in {len(files)} file(s) since {commit[:7]} (e.g. {files[0]})"
    return None


def stale(results_dir: str, head: str = "HEAD") -> tuple[list[str], int]:
    """(one line per stale result, results checked) for the ``*.json`` directly in ``results_dir``."""
    lines, checked = [], 0
    for name in sorted(os.listdir(results_dir)):
        if not name.endswith(".json"):
            continue
        path = os.path.join(results_dir, name)
        try:
            with open(path, encoding="utf-8") as fh:
                prov = json.load(fh).get("provenance") or {}
        except (OSError, ValueError, AttributeError) as e:
            lines.append(f"{name}: unreadable ({e})")
            continue
        checked += 1
        commit = prov.get("git_commit")
        if not isinstance(commit, str) or not commit:
            lines.append(f"{name}: no provenance.git_commit")
            continue
        if prov.get("git_dirty"):
            lines.append(f"{name}: run at {commit[:7]} from a tree with uncommitted changes")
            continue
        why = library_changed(commit, head)
        if why:
            lines.append(f"{name}: {why}")
    return lines, checked
