"""Whether a rendered document's results still describe what would run now.

A result is fresh when everything that decides what it measured is unchanged since the commit
its provenance names, and its tree was clean (no modified and no untracked file) when it started:

- ``sparkcnn/``, ``conf/`` and ``pyproject.toml`` (``MEASURED``);
- the bench script that produced it (``bench/<name>.py`` of its provenance command) and every
  ``bench`` module that script imports, directly or through another (``bench/render.py`` and
  ``bench/results/`` aside: they show results, they do not make them);
- the installed versions its provenance records (python, tensorflow, keras, pyspark, numpy,
  pyarrow), against this environment's.

"Unchanged" is against the working tree, untracked files included: a change not committed yet
makes a result stale as much as a committed one. Only the files the render reads (``READ``) are
judged, and each must be on the folder's manifest (``manifest.json``, written by
``bench/run_all.py``: file -> sha256) with the same digest: a file put there or edited by hand
is refused.

    python bench/render.py --check-fresh [--out BENCHMARKS.md]

reads the results folder the document names (its ``<!-- results: DIR -->`` line) and exits 1,
one line per stale result, when any is stale; 2 when the document names no folder or the folder
holds no result.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEASURED = ("sparkcnn", "conf", "pyproject.toml")
NOT_MEASURED = ("bench/render.py",)  # shows results; bench/results/ is never a dependency either
VERSIONS = ("python", "tensorflow", "keras", "pyspark", "numpy", "pyarrow")
MANIFEST = "manifest.json"
# the results a render reads, as bench/run_all.py saves them (<name>.json)
READ = ("accuracy", "accuracy-cifar10", "links-cifar10", "throughput", "jobcost", "scale", "balance", "cifar", "costmodel",
        "links", "linkmodel", "psload", "shardmodel", "servermodel", "momentum", "run_all")
RESULTS_LINE = re.compile(r"^<!-- results: (.+?) -->$", re.M)


def results_dir_of(doc_text: str) -> str | None:
    """The results folder a rendered document names, or None."""
    m = RESULTS_LINE.search(doc_text)
    return m.group(1).strip() if m else None


def sha256_of(path: str) -> str:
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def read_manifest(results_dir: str) -> dict[str, str] | None:
    """file name -> sha256 of the folder's manifest; None when there is none (or it is unreadable)."""
    try:
        with open(os.path.join(results_dir, MANIFEST), encoding="utf-8") as fh:
            files = json.load(fh).get("files")
    except (OSError, ValueError, AttributeError):
        return None
    return files if isinstance(files, dict) else None


def write_manifest(results_dir: str, written: list[str]) -> dict[str, str]:
    """Put the files this invocation ``written`` on the folder's manifest with their sha256; an
    earlier invocation's entries stay while their file is unchanged."""
    before = read_manifest(results_dir) or {}
    files = {n: h for n, h in before.items() if n not in written
             and os.path.isfile(os.path.join(results_dir, n)) and sha256_of(os.path.join(results_dir, n)) == h}
    files.update({n: sha256_of(os.path.join(results_dir, n)) for n in written
                  if os.path.isfile(os.path.join(results_dir, n))})
    tmp = os.path.join(results_dir, f"{MANIFEST}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump({"files": dict(sorted(files.items()))}, fh, indent=2)
        fh.write("\n")
    os.replace(tmp, os.path.join(results_dir, MANIFEST))
    return files


def off_manifest(results_dir: str, name: str, manifest: dict[str, str] | None) -> str | None:
    """Why ``name`` (a file of ``results_dir``) is not to be read, or None when its digest is on the manifest."""
    if manifest is None:
        return f"the folder has no {MANIFEST} (bench/run_all.py writes it)"
    if name not in manifest:
        return f"not on the folder's {MANIFEST}"
    if sha256_of(os.path.join(results_dir, name)) != manifest[name]:
        return f"changed since bench/run_all.py wrote it (sha256 differs from {MANIFEST})"
    return None


def _git(root: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=60)


def bench_script(prov: dict) -> str | None:
    """``bench/<name>.py`` of a provenance's command, or None."""
    for arg in prov.get("command") or []:
        if re.fullmatch(r"bench/\w+\.py", str(arg)):
            return str(arg)
    return None


def bench_imports(script: str, root: str = ROOT) -> list[str]:
    """``script`` and the ``bench/*.py`` modules it imports, directly or through one another
    (read from the working tree), ``NOT_MEASURED`` left out."""
    seen, todo = [], [script]
    while todo:
        rel = todo.pop()
        if rel in seen or rel in NOT_MEASURED:
            continue
        seen.append(rel)
        try:
            with open(os.path.join(root, rel), encoding="utf-8") as fh:
                tree = ast.parse(fh.read())
        except (OSError, SyntaxError):
            continue
        for node in ast.walk(tree):
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module] + ([f"{node.module}.{a.name}" for a in node.names] if node.module == "bench"
                                        else [])
            todo += [f"bench/{m.split('.')[1]}.py" for m in mods
                     if m.startswith("bench.") and os.path.isfile(os.path.join(root, f"bench/{m.split('.')[1]}.py"))]
    return sorted(seen)


def changed_since(commit: str, paths: list[str], root: str = ROOT) -> str | None:
    """None when ``paths`` in the working tree (untracked files included) are as at ``commit``,
    else why not (one phrase)."""
    if _git(root, "cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
        return f"commit {commit[:12]} is not in this repository"
    diff = _git(root, "diff", "--name-only", commit, "--", *paths)
    if diff.returncode != 0:
        return f"git diff {commit[:12]} failed: {diff.stderr.strip()[:200]}"
    untracked = _git(root, "ls-files", "--others", "--exclude-standard", "--", *paths)
    files = [ln for ln in diff.stdout.splitlines() if ln]
    new = [ln for ln in untracked.stdout.splitlines() if ln]
    if files or new:
        first = (files or new)[0]
        return (f"{len(files) + len(new)} file(s) the result depends on changed since {commit[:7]} "
                f"(e.g. {first}{', untracked' if not files else ''})")
    return None


def installed_versions() -> dict:
    """This environment's versions of ``VERSIONS`` (as a result's provenance records them)."""
    import platform
    from importlib import metadata

    def version(pkg):
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    return {"python": platform.python_version(), "tensorflow": version("tensorflow") or version("tensorflow-cpu"),
            **{pkg: version(pkg) for pkg in VERSIONS[2:]}}


def why_stale(results_dir: str, name: str, manifest, versions: dict, root: str = ROOT) -> str | None:
    """Why the result ``name`` of ``results_dir`` is stale (every reason, "; " between them), or
    None when it is fresh."""
    reasons = [off_manifest(results_dir, name, manifest)]
    try:
        with open(os.path.join(results_dir, name), encoding="utf-8") as fh:
            prov = json.load(fh).get("provenance") or {}
    except (OSError, ValueError, AttributeError) as e:
        return "; ".join(filter(None, [*reasons, f"unreadable ({e})"]))
    commit, script = prov.get("git_commit"), bench_script(prov)
    if not isinstance(commit, str) or not commit:
        reasons.append("no provenance.git_commit")
    elif prov.get("git_dirty"):
        reasons.append(f"run at {commit[:7]} from a tree with uncommitted changes")
    if script is None:
        reasons.append("no bench script in provenance.command")
    elif isinstance(commit, str) and commit:
        reasons.append(changed_since(commit, [*MEASURED, *bench_imports(script, root)], root))
    differ = [k for k in VERSIONS if prov.get(k) != versions.get(k)]
    if differ:
        reasons.append(f"{differ[0]} {prov.get(differ[0])} when run, {versions.get(differ[0])} installed"
                       + (f" (and {len(differ) - 1} more)" if len(differ) > 1 else ""))
    return "; ".join(r for r in reasons if r) or None


def stale(results_dir: str, versions: dict | None = None, root: str = ROOT) -> tuple[list[str], int]:
    """(one line per stale result, results checked) for the files of ``READ`` in ``results_dir``."""
    manifest = read_manifest(results_dir)
    versions = installed_versions() if versions is None else versions
    lines, checked = [], 0
    for name in (f"{n}.json" for n in READ):
        if not os.path.isfile(os.path.join(results_dir, name)):
            continue
        checked += 1
        why = why_stale(results_dir, name, manifest, versions, root)
        if why:
            lines.append(f"{name}: {why}")
    return lines, checked
