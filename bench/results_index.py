"""bench/results/INDEX.md: one row per folder kept under bench/results/, what it holds and why.

    python bench/results_index.py [--check]

Each row names the folder, the benchmarks of its JSON files (the ``bench/<name>.py`` of each
file's provenance command), the commit(s) those files were run at (their provenance's
``git_commit``), what the folder is and why it is kept. What and why come from ``KEPT`` below;
the benchmarks and the commits are read from the folders, so the index cannot drift from them.

A folder is kept when BENCHMARKS.md is rendered from it, when a document or a test names it, or
when later work measures against it; superseded reruns are removed with ``git rm -r`` (git history
keeps them). A new folder goes into ``KEPT`` with its reason, then this script rewrites INDEX.md.

Exit status: 0 written (or, with ``--check``, the same); 1 ``--check`` found INDEX.md different
(a unified diff on stdout); 2 a folder on disk missing from ``KEPT``, or one of ``KEPT`` missing
from disk (nothing is written).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
INDEX = os.path.join(RESULTS, "INDEX.md")

RENDERED = "rendered set: BENCHMARKS.md and the README's figures (`<!-- results: -->` line)"
HISTORY = "named by docs/transports.md (History of the measurements)"
PS_BASELINE = "baseline of the parameter-server work"
OPEN_ISSUE = "named by an open issue"

# folder -> (what it is, why it is kept)
KEPT: dict[str, tuple[str, str]] = {
    "2026-12-02-native": (
        ("the stream after the compiled hot paths: throughput (three runs) and the stream accuracy "
         "of ASGD and GS-ASGD + MS"), HISTORY),
    "2026-12-02-reps": (
        "throughput: stream cases between adjacent limits, 3 repetitions, three runs", HISTORY),
    "2026-12-02-candidates": (
        "throughput and driver CPU with the downlink built from its candidate set, against the scan",
        HISTORY),
    "2026-12-02-compiled": (
        "throughput and driver CPU of the stream before and after the compiled calls", HISTORY),
    "2026-12-02-stream": (
        ("the seed comparison at one step per exchange and its rerun (GS-ASGD, sparsification-aware "
         "momentum), with its throughput"), HISTORY),
    "2026-12-03-links": (
        "links at 100 Mbit/s and its repetitions; `peers.json`: one epoch beside Elephas", HISTORY),
    "2026-12-04-scale": (
        ("`cadence.json`: the downlink's cadence at 4 and 8 blocks; also the convergence matrix, the "
         "parameter-server load and stream accuracy rows of the same day"), HISTORY),
    "2026-12-04-momentum": (
        "sparsification-aware momentum against momentum correction at 2, 4 and 8 blocks",
        HISTORY + "; read by tests/test_bench_stats.py"),
    "2026-12-04-divergence": (
        "the per-step sparse case without warm-up, 12 seeds", HISTORY),
    "2026-12-04-divergence-2": (
        "the per-step sparse case without warm-up, 10 seeds, rerun", HISTORY),
    "2026-12-04-drivercpu": (
        "where the driver's CPU per push goes", HISTORY),
    "2026-12-04-flightfloor": (
        "the bare Flight transport's server CPU per message, back to back", HISTORY),
    "2026-12-06-flightfloor": (
        "the bare transport at paced rates (150, 75, 20 messages/s), without and with both cores busy",
        HISTORY + "; " + PS_BASELINE),
    "2026-12-07-wires": (
        ("`bench/flightfloor.py`: every wire candidate (Flight, ZeroMQ, a socket with a thread per "
         "connection or a selector loop) at 1 to 1,000 messages/s per stream and 64 streams at 16/s"),
        "named by docs/transports.md (The wire): the measurement behind the stream's wire"),
    "2026-12-04-throughput": (
        "the stream's three speed targets, each the median of five repetitions", HISTORY),
    "2026-12-04-throughput-2": (
        "throughput rerun after the per-step copies went (with `2026-12-04-drivercpu-2`)", HISTORY),
    "2026-12-04-throughput-3": (
        "throughput rerun, the tasks' own CPU measured outside TensorFlow from here on", HISTORY),
    "2026-12-04-throughput-4": (
        "throughput rerun: the tasks at 1.95 ms of CPU per step outside TensorFlow", HISTORY),
    "2026-12-04-throughput-5": (
        ("throughput after the compiled selection, the flat gradient call and the clipping folded "
         "into the momentum pass"), HISTORY),
    "2026-12-05-throughput": (
        "throughput with the selection's trim and corrections compiled too", HISTORY),
    "2026-12-04-drivercpu-2": (
        "driver CPU per push after the per-step copies went", HISTORY),
    "2026-12-05-drivercpu": (
        "driver CPU per push after the per-step work of 2026-12-04, unchanged", HISTORY + "; " + OPEN_ISSUE),
    "2026-12-04-tinyasync": (
        "how often async at one step per exchange collapses on the tests' tiny set, by setting",
        HISTORY),
    "2026-12-05-peers": (
        ("`bench/peers.py`: one epoch beside Elephas's per-batch asynchronous training, speed and "
         "test accuracy"), HISTORY),
    "2026-12-06-final-3": (
        "the complete final set: every benchmark of `bench/run_all.py`, with the figures",
        RENDERED + "; " + OPEN_ISSUE),
    "2026-12-06-engine": (
        ("the engine rebuild: `behaviour.json`, jobs and stream variants before (da6e4ea) and after, "
         "3 repetitions each; `pushpath.json`, the modules one stream push runs through, before and after"),
        "the evidence that the rebuild left behaviour unchanged"),
    "2026-12-07-workerstep": (
        ("`bench/workerstep.py`: a stream task's CPU per step outside TensorFlow at one step per "
         "exchange, part by part, before the worker-step changes (at the bench's commit) and after"),
        OPEN_ISSUE),
    "2026-12-07-servers": (
        ("`bench/psload.py --servers 1 2`: one and two parameter-server processes (`ps.servers`) at 16 "
         "and 64 workers, the CPU per push summed over the driver and every server, 5 repetitions each"),
        "the servers' figures before the records' relay and the store's lock were cut; named by an open issue"),
    "2026-12-07-servers-2": (
        ("the same psload run after the servers' records went in batches, encoded once, and a push took the "
         "store's lock once; `servermodel.json`, the speed-up predicted from it with K server processes"),
        "the README's servers block (`<!-- results servers: -->` line); named by an open issue"),
    "2026-12-07-cifar": (
        ("`bench/cifar.py` on the real CIFAR-10 (JPEG copy): ResNet-20's images/s, bytes per exchange and "
         "test accuracy per mode, on a seeded sample of 6,400 training and 1,000 test images"),
        "the first speed figures on the real data, each with the accuracy its run reached; named by an open issue"),
    "2026-12-07-augment": (
        ("`bench/augment.py` on the real CIFAR-10 sample with ResNet-20: `data.augment=crop_flip`'s cost per "
         "minibatch against the step, and the test accuracy of a run without and with it"),
        "the augmentation's cost figure; named by an open issue"),
    "2026-12-07-firststep": (
        ("`bench/firststep.py`: seconds from `sparkcnn train --config conf/cifar10_resnet20.yaml`'s start to "
         "its first step on `make data-cifar10`'s data, 5 runs, each with the machine's load"),
        "the CIFAR-10 start-up target's figure; named by an open issue"),
    "2026-12-07-workerstep-2": (
        ("`bench/workerstep.py --base main`: the same figures with the out-of-place policies' buffers "
         "in one block (head) beside main (base), in one run, each repetition a child process"),
        OPEN_ISSUE),
    "2026-12-07-tails": (
        ("`bench/tails.py`: the 64-worker psload case at 1,000 pushes/s, 5 repetitions on a quiet "
         "machine and 5 beside three spinning processes, taken in turn, each with its late replies, "
         "the server's collections and stalls, and the load"),
        "the cause of the reply tails (the cores taken, not a pause of the server); named by an open issue"),
    "2026-12-07-final": (
        ("the final set at one tree, filled over several sittings by `bench/run_all.py --only ... --out` "
         "invocations: every Fashion-MNIST benchmark, then the test-bed ones and the CIFAR-10 benches, "
         "whose runs `cifar10-runs/` and `links-cifar10-runs/` keep between sittings"),
        "the folder BENCHMARKS.md and the README are rendered from once it is complete; named by an open issue"),
    "archive": (
        ("results from before the dated folders (bench/run_all.py moves older results here): "
         "`accuracy-stream.json`, the seed comparison; `throughput`, `jobcost`, `scale`, `balance`, "
         "the fixtures of the render tests"),
        ("`accuracy-stream.json` named by docs/transports.md; all five read by "
         "tests/test_benchmarks_doc.py")),
}

HEADER = """# Benchmark results kept in this folder

Generated by `python bench/results_index.py` from the folders and its `KEPT` table; edit that
table, not this file. Each JSON names the commit it was run at in its `provenance`. Superseded
reruns were removed (git history keeps them); BENCHMARKS.md holds one run, the rendered set.

| Folder | Benchmarks | Commit | What it is | Why kept |
|---|---|---|---|---|
"""

ROW = re.compile(r"^\| `([^`/]+)/` \|", re.M)


def folders_on_disk(results: str = RESULTS) -> list[str]:
    return sorted(n for n in os.listdir(results) if os.path.isdir(os.path.join(results, n)))


def folders_in_index(text: str) -> list[str]:
    """The folders an INDEX.md names, one per table row (``| `name/` | ...``)."""
    return ROW.findall(text)


def _results(folder: str) -> list[tuple[str, dict]]:
    """(file stem, provenance or {}) for each ``*.json`` directly in ``folder``."""
    out = []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".json") or name == "manifest.json":  # bench/run_all.py's list of them
            continue
        with open(os.path.join(folder, name), encoding="utf-8") as fh:
            data = json.load(fh)
        prov = data.get("provenance") if isinstance(data, dict) else None
        prov = prov if isinstance(prov, dict) else {}
        head = data.get("checkouts", {}).get("head", {}) if isinstance(data, dict) else {}
        if "git_commit" not in prov and head.get("commit"):  # bench/behaviour.py: the head it measured
            prov = {**prov, "git_commit": head["commit"], "git_dirty": head.get("dirty")}
        out.append((name[:-len(".json")], prov))
    return out


def _bench(stem: str, prov: dict) -> str:
    cmd = prov.get("command")
    if isinstance(cmd, list):
        for arg in cmd:
            m = re.fullmatch(r"bench/(\w+)\.py", str(arg))
            if m:
                return m.group(1)
    return re.sub(r"-.*$", "", stem)


def benchmarks(results: list[tuple[str, dict]]) -> str:
    counts: dict[str, int] = {}
    for stem, prov in results:
        b = _bench(stem, prov)
        counts[b] = counts.get(b, 0) + 1
    return ", ".join(b if n == 1 else f"{b} ×{n}" for b, n in counts.items())


def commits(results: list[tuple[str, dict]]) -> str:
    """The short commits of the files, each with its files when they differ."""
    by: dict[str, list[str]] = {}
    for stem, prov in results:
        c = prov.get("git_commit")
        key = (str(c)[:7] + (" (dirty tree)" if prov.get("git_dirty") else "")) if c else "not recorded"
        by.setdefault(key, []).append(stem)
    if len(by) == 1:
        return next(iter(by))
    return "; ".join(f"{c}: {', '.join(stems)}" for c, stems in by.items())


def render(results: str = RESULTS) -> str:
    rows = []
    for name in folders_on_disk(results):
        what, why = KEPT[name]
        found = _results(os.path.join(results, name))
        rows.append(f"| `{name}/` | {benchmarks(found)} | {commits(found)} | {what} | {why} |")
    return HEADER + "\n".join(rows) + "\n"


def mismatch(results: str = RESULTS) -> list[str]:
    """One line per folder on disk but not in ``KEPT``, or in ``KEPT`` but not on disk."""
    disk = set(folders_on_disk(results))
    return ([f"bench/results/{n}/ is not in KEPT: add it with its reason, or git rm -r it"
             for n in sorted(disk - set(KEPT))]
            + [f"KEPT names bench/results/{n}/, which does not exist" for n in sorted(set(KEPT) - disk)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when INDEX.md differs")
    a = ap.parse_args(argv)
    bad = mismatch()
    if bad:
        for line in bad:
            print(f"bench/results_index.py: {line}", file=sys.stderr)
        return 2
    text = render()
    if a.check:
        try:
            with open(INDEX, encoding="utf-8") as fh:
                old = fh.read()
        except FileNotFoundError:
            old = ""
        if old == text:
            return 0
        sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), text.splitlines(True),
                                                   "bench/results/INDEX.md", "rendered"))
        return 1
    with open(INDEX, "w", encoding="utf-8") as fh:
        fh.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
