"""BENCHMARKS.md and the README's figures, rendered from one folder of benchmark results.

    python bench/render.py RESULTS_DIR [--out BENCHMARKS.md] [--readme README.md] [--check]
    python bench/render.py --check-fresh [--out BENCHMARKS.md] [RESULTS_DIR]

RESULTS_DIR holds what ``bench/run_all.py`` saved: ``<name>.json`` per benchmark (accuracy,
accuracy-cifar10, throughput, jobcost, scale, balance, cifar, costmodel, links) and ``run_all.json``. The text is a pure
function of those JSONs (fixed decimals, no clock, no absolute path of the repository), so
``--check`` can re-render it and diff it against the committed files; the PNG figures, written
into ``RESULTS_DIR/figures/``, are not compared (matplotlib versions draw differently). A missing
file renders as "Not measured in this run.", a missing field as "—".

Every measured figure of the README lives between two marker lines that this script rewrites:
``<!-- benchmarks:begin -->`` ... ``<!-- benchmarks:end -->`` (the headline, required) and
``<!-- benchmarks:begin NAME -->`` ... ``<!-- benchmarks:end NAME -->`` for the named blocks of
``BLOCKS`` (each optional, at most once; the ``servers`` block from the psload.json of the folder a
README line ``<!-- results servers: DIR -->`` names, when it names one, a ``bench/psload.py
--servers`` run of its own). ``--check`` re-renders every block the README holds, and
fails on a measured figure (a number with a unit of time, speed or size, a ratio, a share or an
accuracy) anywhere in the README outside them (``hand_figures``).

Every target the benches judge is shown in its section's table (``bench/targets.py`` judges it
under the project's repetition rule: holds, misses or not judged), and the document opens with the
line that counts them, which the README's glance block repeats.

Exit status: 0 written (or, with ``--check``, the same); 1 ``--check`` found a difference (a
unified diff on stdout) or a hand-written figure; 2 no results, or a README without the headline
block, with a block of an unknown name, twice, or without its end line (nothing is written).

``--check-fresh`` writes nothing: it exits 1, one line per result, when a result behind the
document is stale: what it measured changed since its commit (the library, ``conf/``, its bench
script and the bench modules it imports, ``pyproject.toml``, the installed versions), it ran from
a dirty tree, or it is not on its folder's manifest (``bench/fresh.py``); it is run when
results are published, not by the tests, so that later library changes do not turn the suite red.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
import re
import shlex
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: bench/ is on the path, the repository is not
    sys.path.insert(0, ROOT)
from bench import fresh  # noqa: E402
from bench import targets as tg  # noqa: E402
from bench.targets import _get  # noqa: E402
from bench._common import EXIT_MISSED  # noqa: E402

BEGIN, END = "<!-- benchmarks:begin -->", "<!-- benchmarks:end -->"
# a README marker line: begin or end, and the block's name ("" for the headline)
MARKER = re.compile(r"^<!-- benchmarks:(begin|end)(?: ([a-z][a-z0-9-]*))? -->$")
NOT_MEASURED = "Not measured in this run."
DASH = "—"
log = logging.getLogger(__name__)

# run name -> the paper's name for it, in the seed table's row order
NAMES = {
    "sync-dense": "Sync SGD, dense",
    "sync-sparse": "Sync SGD, sparse uplink (GS)",
    "sync-sparse-bidir": "Sync SGD, sparse both directions (GS + MS)",
    "stream-asgd": "ASGD",
    "stream-gs-asgd": "GS-ASGD",
    "stream-gs-asgd-ms": "GS-ASGD + MS",
    "stream-gs-asgd-ms-round": "GS-ASGD + MS, a downlink per round of N pushes",
    "async-dense": "ASGD",
    "async-sparse": "GS-ASGD",
    "async-sparse-bidir": "GS-ASGD + MS",
    "stream-gs-asgd-samomentum": "GS-ASGD + MS, sparsification-aware momentum",
    "stream-gs-asgd-ms-n8": "GS-ASGD + MS, 8 blocks",
    "stream-gs-asgd-samomentum-n8": "GS-ASGD + MS, sparsification-aware momentum, 8 blocks",
}
# throughput.json's stream cases -> row labels (sparse: uplink 0.001, downlink 0.01)
STREAM_CASES = {"async_h1_sparse": "Stream, async, H = 1, sparse",
                "async_h1_dense": "Stream, async, H = 1, dense",
                "async_h10": "Stream, async, H = 10, sparse", "sync_h10": "Stream, sync, H = 10, sparse"}


# ---- safe access and fixed-decimal formatting --------------------------------------------------

def _list(x) -> list:
    """``x`` when it is a list, else an empty one."""
    return x if isinstance(x, list) else []


def _items(d) -> list:
    """``d.items()`` when ``d`` is a dict, else nothing."""
    return list(d.items()) if isinstance(d, dict) else []


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _f(x, decimals: int = 1, scale: float = 1.0, unit: str = "") -> str:
    return f"{x * scale:.{decimals}f}{unit}" if _num(x) else DASH


def _pm(mean, std, decimals: int = 1, scale: float = 1.0) -> str:
    """``mean ± std`` (std omitted when absent), both at the same fixed decimals."""
    if not _num(mean):
        return DASH
    return _f(mean, decimals, scale) + (f" ± {_f(std, decimals, scale)}" if _num(std) else "")


def _g(x) -> str:
    """A number of unknown scale: integers as they are, floats at 3 significant-ish decimals."""
    if not _num(x):
        return DASH if x is None else _cell(x)
    return str(x) if isinstance(x, int) else (f"{x:.1f}" if abs(x) >= 100 else f"{x:.3f}")


def _order(key) -> tuple:
    """Sort key for numbers written as dict keys ("2" < "10"), anything else after them."""
    try:
        return (0, float(key), "")
    except (TypeError, ValueError):
        return (1, 0.0, str(key))


def _cell(x) -> str:
    return str(x).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(_cell(c) for c in r) + " |" for r in rows])


def _stat(d: dict, key: str):
    """(mean, std) of an over-seeds aggregate (``key_mean``/``key_std``), else (d[key], None).
    Over one seed the std is None: its 0 would read as a spread measured to be nil."""
    if f"{key}_mean" in d:
        return d.get(f"{key}_mean"), None if len(d.get("seeds") or []) == 1 else d.get(f"{key}_std")
    return d.get(key), None


def measured(doc: dict | None, name: str) -> str:
    """The line above every table: machine, exact command, date and commit of ``name``.json."""
    p = _get(doc, "provenance")
    p = p if isinstance(p, dict) else {}
    m = p.get("machine") if isinstance(p.get("machine"), dict) else {}
    cmd = p.get("command")
    cmd = shlex.join(map(str, cmd)) if isinstance(cmd, list) else cmd
    commit = p.get("git_commit")
    commit = f"`{commit[:7]}`" if isinstance(commit, str) and commit else DASH
    return (f"Measured on {_g(m.get('cores'))} cores, {_f(m.get('memory_gib'), 1)} GiB, {m.get('cpu') or DASH}; "
            f"command {f'`{cmd}`' if cmd else DASH}; date {p.get('date') or DASH}; commit {commit}"
            f"{' (dirty tree)' if p.get('git_dirty') is True else ''} ({name}.json).")


def targets_block(doc: dict | None, name: str, ts: list, script: str | None = None) -> str:
    """One section's table of its targets, holding or not: the figure each is judged on, the
    verdict under the project's rule (``bench/targets.py``) and the repetitions behind it.
    ``name``: the results file; ``script``: the bench that printed it, when named otherwise."""
    if not ts:
        return ""
    body = [[t.name, t.figure, f"**{t.verdict}**" if t.verdict == tg.MISSES else t.verdict, t.evidence] for t in ts]
    return "\n".join([
        measured(doc, name), "",
        _table(["Target", "Figure", "Verdict", "Repetitions"], body), "",
        f"Targets of `bench/{script or name}.py`: {tg.summary(ts)}. A speed or latency target is judged on the median of "
        f"at least {tg.MIN_REPS} repetitions, a tail latency on every repetition, an accuracy target on the mean "
        f"of at least {tg.MIN_SEEDS} seeds (± their sd); with fewer it is not judged, whatever the bench printed."])


def run_limit_of(thr: dict | None) -> float | None:
    """The one compute limit every efficiency of a throughput run divides by, or None (an older
    file whose stream cases each divide by limits of their own: no efficiency is shown)."""
    lim = tg.run_limit(thr)
    return lim["images_per_s"] if lim else None


def efficiency(thr: dict | None, m: dict, key: str):
    """images/s of ``m`` over the run's one limit; None without one, or for a run that did not train."""
    limit = run_limit_of(thr)
    return m.get(key) / limit if limit and _num(m.get(key)) and m.get("trained") is not False else None


def _efficiency_cell(thr: dict | None, m: dict, key: str, decimals: int) -> str:
    if run_limit_of(thr) is None:
        return "not judged"
    return "did not train" if m.get("trained") is False else _f(efficiency(thr, m, key), decimals, 100, " %")


def _limit_said(thr: dict | None, decimals: int = 1) -> str:
    lim = tg.run_limit(thr)
    if not lim:
        return ("not judged: no single compute limit was measured for this run (its stream cases divide by "
                "limits of their own), so no efficiency is shown")
    reps = [x for x in lim["repetitions"] if _num(x)]
    return (f"{_f(lim['images_per_s'], decimals)} images/s, the median of {_plural(len(reps), 'repetition')} "
            f"measured once for the run ({_f(min(reps), decimals)} to {_f(max(reps), decimals)})")


def load_results(results_dir: str) -> tuple[dict, list[tuple[str, str]]]:
    """({name: parsed JSON or None} for the files a render reads (``fresh.READ``), [(file, why
    refused)]): with a manifest in the folder, a file not on it or changed since is refused and
    renders as not measured."""
    manifest = fresh.read_manifest(results_dir)
    d, refused = {}, []
    for n in fresh.READ:
        why = None
        if manifest is not None and os.path.isfile(os.path.join(results_dir, f"{n}.json")):
            why = fresh.off_manifest(results_dir, f"{n}.json", manifest)
        if why:
            refused.append((f"{n}.json", why))
        d[n] = None if why else _load(results_dir, n)
    return d, refused


def _load(results_dir: str, name: str) -> dict | None:
    try:
        with open(os.path.join(results_dir, f"{name}.json"), encoding="utf-8") as fh:
            doc = json.load(fh)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


# ---- sections: each returns its markdown; ``fig(name, title, draw, *data)`` gives a figure link ----

def _setting(run: dict, key: str) -> str | None:
    """A row's ``section.key`` as text: the last of its overrides that sets it, else the resolved
    config of the row or of its first run that records one (a row trained from its conf/ file
    overrides only what differs from the file), else None."""
    ov = [o for o in _list(run.get("overrides")) if isinstance(o, str) and o.startswith(f"{key}=")]
    if ov:
        return ov[-1].split("=", 1)[1]
    section, name = key.split(".", 1)
    for r in [run, *_list(run.get("runs"))]:
        cfg = r.get("config") if isinstance(r, dict) else None
        if isinstance(cfg, dict) and isinstance(cfg.get(section), dict) and name in cfg[section]:
            value = cfg[section][name]
            return str(value).lower() if isinstance(value, bool) else str(value)
    return None


def _h(run: dict) -> str:
    """Local steps per exchange from the row's settings; "≈" for async jobs sized by time."""
    h = _setting(run, "train.steps_per_round")
    if h and _setting(run, "engine.mode") == "async" and _setting(run, "engine.transport") != "stream":
        return f"≈ {h}"
    return h or DASH


def _config_file(run: dict | None) -> str:
    """The conf/ file a row trained, as a code span; a dash for results that did not record it."""
    f = run.get("config_file") if isinstance(run, dict) else None
    return f"`{f}`" if isinstance(f, str) and f else DASH


def _command(run: dict | None) -> str:
    """The command that reproduces a row, as a code span, with the seeds it ran (each by
    ``--set run.seed=S``); a dash for results that did not record it."""
    cmd = run.get("command") if isinstance(run, dict) else None
    if not isinstance(cmd, str) or not cmd:
        return DASH
    seeds = [s for s in _list(run.get("seeds")) if isinstance(s, int)]
    said = ", ".join(map(str, seeds))
    return f"`{cmd}`" + (f", seeds {said} (`--set run.seed=S`)" if len(seeds) > 1 else "")


def reproduce_lines(rows: list[tuple[str, dict | None]],
                    head: str = "Reproduce each row (its config file and command") -> list[str]:
    """A table's footnote: for each (label, row) the command that reproduces the row."""
    return [f"{head}; — where the run recorded none):", "", *(f"- {label}: {_command(r)}" for label, r in rows)]


def _reached(run: dict, key: str) -> str:
    """A " (k/n)" suffix when only k of the n seeds that recorded ``key`` reached that accuracy."""
    seeds = [r for r in _list(run.get("runs")) if isinstance(r, dict) and key in r]
    k = sum(_num(r.get(key)) for r in seeds)
    return f" ({k}/{len(seeds)})" if seeds and k < len(seeds) else ""


def _name(run: dict) -> str:
    return run["name"] if isinstance(run.get("name"), str) else DASH


def seed_rows(acc: dict | None) -> list[dict]:
    """The seed table's runs: jobs runs and stream aggregates, in NAMES' order, unknown names last."""
    runs = [r for key in ("runs", "stream") for r in _list(_get(acc, key)) if isinstance(r, dict)]
    order = list(NAMES)
    return sorted(runs, key=lambda r: order.index(_name(r)) if _name(r) in order else len(order))


def seed_table(acc: dict | None, fig) -> str:
    rows = seed_rows(acc)
    blocks = "2 blocks, 8 where the row says so" if any(_name(r).endswith("-n8") for r in rows) else "2 blocks"
    out = [f"## Seed experiment (Fashion-MNIST, {blocks})", ""]
    spread = ("mean ± sample standard deviation" if _get(acc, "std_ddof") == 1
              else "mean ± standard deviation (population, ddof 0)")
    if not rows:
        return "\n".join(out + [NOT_MEASURED])
    body = []
    for r in rows:
        name, seeds = _name(r), r.get("seeds")
        collapsed = r.get("collapsed") if isinstance(r.get("collapsed"), int) else 0
        label = (f"{NAMES.get(name, name)} (`{name}`" + (f", {_plural(len(seeds), 'seed')}" if isinstance(seeds, list) else "")
                 + (f", {collapsed} collapsed" if collapsed else "") + ")")
        body.append([label, _h(r), _pm(*_stat(r, "test_accuracy"), 4), _pm(*_stat(r, "wall_s"), 1),
                     _pm(*_stat(r, "time_to_0_88_s"), 1) + _reached(r, "time_to_0_88_s"),
                     _pm(*_stat(r, "time_to_0_90_s"), 1) + _reached(r, "time_to_0_90_s"),
                     _pm(*_stat(r, "bytes_up"), 1, 1e-6), _pm(*_stat(r, "bytes_down"), 1, 1e-6),
                     _pm(*_stat(r, "steady_uplink_ratio"), 1), _pm(*_stat(r, "steady_downlink_ratio"), 1)])
    out += [measured(acc, "accuracy"), "",
            _table(["Variant", "H", "Final accuracy", "Wall (s)", "To 0.88 (s)", "To 0.90 (s)", "Bytes up (MB)",
                    "Bytes down (MB)", "Uplink ratio", "Downlink ratio"], body), "",
            "H: local steps per exchange with the driver (≈: async jobs sized by time to about that many). "
            f"Final accuracy: test accuracy after the last epoch; rows over seeds give {spread}"
            + (", over the seeds that ran to the end (k collapsed: the divergence guard stopped k of them). "
               if any(r.get("collapsed") for r in rows) else ". ") +
            "Wall: seconds of the whole run, evaluation included. To 0.88 / 0.90: seconds to the first epoch end "
            "at that test accuracy, over the seeds that reached it ((k/n) when only k of n did). Bytes: MB "
            "(10^6 bytes) all blocks sent to (up) and received from (down) the driver. Ratios: dense bytes / "
            "actual bytes per exchange once the density warm-up is over (1.0 = uncompressed).", "",
            *reproduce_lines([(f"{NAMES.get(_name(r), _name(r))} ({_name(r)})", r) for r in rows]), "",
            fig("accuracy.png", "Test accuracy per epoch, one line per variant", _draw_accuracy, rows,
                _get(acc, "reference", "keras"))]
    block = targets_block(acc, "accuracy", tg.of_accuracy(acc))
    return "\n".join(out + (["", block] if block else []))


def reference_table(acc: dict | None, thr: dict | None) -> str:
    out = ["## Reference rows (same run)", ""]
    keras, limit = _get(acc, "reference", "keras"), run_limit_of(thr) or _get(thr, "compute_limit_images_per_s")
    if not isinstance(keras, dict) and limit is None:
        return "\n".join(out + [NOT_MEASURED])
    keras = keras if isinstance(keras, dict) else {}
    rows = [["Single-process Keras `model.fit`", _f(keras.get("test_accuracy"), 4), _f(keras.get("wall_s"), 1),
             _f(keras.get("time_to_0_88_s"), 1), _f(keras.get("time_to_0_90_s"), 1), _f(keras.get("images_per_s"), 1)],
            ["Parallel compute limit (2 single-thread processes, no communication)", DASH, DASH, DASH, DASH,
             _f(limit, 1)]]
    out += [line for doc, name in ((acc, "accuracy"), (thr, "throughput")) if doc for line in (measured(doc, name), "")]
    out += [_table(["Reference", "Final accuracy", "Wall (s)", "To 0.88 (s)", "To 0.90 (s)", "Images/s"], rows), "",
            "Keras: the same model, data, batch size, momentum and learning-rate schedule trained by `model.fit` "
            "in one process with TensorFlow's default threads, evaluated after every epoch as the parallel runs "
            "are. Compute limit: the summed steady images/s of two single-thread processes each training its "
            "own block with no communication at all; efficiency below is measured against it.", "",
            *reproduce_lines([("Keras `model.fit`", keras)])]
    return "\n".join(out)


def throughput_rows(thr: dict | None) -> list[tuple[str, dict, str]]:
    """(label, measurement, its images/s key) for every transport and mode in throughput.json."""
    rows = []
    for h, m in sorted(_items(_get(thr, "by_steps_per_round")), key=lambda kv: _order(kv[0])):
        rows.append((f"Jobs, sync, H = {h}", m, "sparkcnn_images_per_s"))
    if isinstance(_get(thr, "pipelined"), dict):
        rows.append((f"Jobs, sync pipelined, H = {_g(_get(thr, 'pipelined', 'steps_per_round'))}",
                     thr["pipelined"], "images_per_s"))
    if isinstance(_get(thr, "async"), dict):
        rows.append((f"Jobs, async, H ≈ {_f(_get(thr, 'async', 'mean_steps_per_job'), 1)}", thr["async"],
                     "images_per_s"))
    for key, m in _items(_get(thr, "stream")):
        m = m if isinstance(m, dict) else {}
        label = STREAM_CASES.get(key, f"Stream, {m.get('mode', DASH)}, H = {_g(m.get('steps_per_exchange'))}")
        rows.append((label + (f" (error: {m['error']})" if m.get("error") else ""), m, "images_per_s"))
    return [(label, m, k) for label, m, k in rows if isinstance(m, dict)]


def throughput_table(thr: dict | None) -> str:
    out = ["## Throughput and CPU accounting", ""]
    rows = throughput_rows(thr)
    if not rows:
        return "\n".join(out + [NOT_MEASURED])
    one_limit = run_limit_of(thr) is not None
    judged = "not judged"
    body = [[label, _f(m.get(k), 1), tg.accuracy_note(m).replace("test accuracy ", ""),
             _efficiency_cell(thr, m, k, 1),
             *(_f(_get(m, "cpu", "cpu_ms", part), 1) for part in ("driver", "jvm", "workers")),
             _f(_get(m, "cpu", "compute_share"), 1, 100, " %") if one_limit else judged,
             _f(_get(m, "cpu", "cores_busy"), 1, 100, " %"),
             _f(m.get("exposed_comm_ms_per_step"), 3)] for label, m, k in rows]
    out += [measured(thr, "throughput"), "",
            _table(["Transport, mode", "Images/s", "Test accuracy", "Efficiency vs limit", "CPU ms/exchange: driver",
                    "JVM", "workers", "Compute share", "Cores busy", "Exposed comm. per step (ms)"], body), "",
            f"Images/s: steady state, warm-up and drain left out, the median over the repetitions where a case has "
            f"them; test accuracy: of the same run (missing: the run recorded none). Efficiency: images/s over "
            f"the compute limit, {_limit_said(thr)}. CPU ms per exchange (a round, an async "
            "job or a stream exchange) of the driver's Python process, the JVM (Spark's driver and executor) and "
            "Spark's Python workers (training included). Compute share: the limit's CPU for the same images over "
            "all CPU used; cores busy: all CPU over wall x cores; their product is the efficiency. Exposed "
            "communication: ms per local step the tasks waited for the driver's replies (stream transport)."]
    block = targets_block(thr, "throughput", tg.of_throughput(thr))
    return "\n".join(out + (["", block] if block else []))


LINK_NAMES = {"stream-asgd": "ASGD, H = 1", "stream-gs-asgd": "GS-ASGD, H = 1",
              "stream-gs-asgd-ms": "GS-ASGD + MS, H = 1", "jobs-sync-dense": "Sync SGD (jobs), H = 10"}


def links_section(ln: dict | None, fig) -> str:
    """links.json: the variants on a 2-host test bed, per link rate."""
    out = ["## Links: separate hosts behind shaped links", ""]
    rates = [(r, cells) for r, cells in _items(_get(ln, "rates")) if isinstance(cells, dict)]
    if not rates:
        return "\n".join(out + [NOT_MEASURED])
    body = [[r, LINK_NAMES.get(name, name), _f(c.get("images_per_s"), 0), _f(c.get("time_to_0_88_s"), 1),
             _f(c.get("test_accuracy"), 4), _f(c.get("bytes_up_per_step"), 1, 1e-3), _f(c.get("bytes_down_per_step"), 1, 1e-3),
             _f(c.get("exposed_comm_ms_per_step"), 1)]
            for r, cells in rates for name, c in cells.items() if isinstance(c, dict)]
    bed = _get(ln, "testbed") or {}
    n = _get(ln, "reps")
    reps = (f"each cell the median of {n} repetitions, run in turn across the rates" if isinstance(n, int) and n > 1
            else "one repetition")
    out += [measured(ln, "links"), "",
            fig("links.png", "Time to 0.88 test accuracy per link rate", _draw_links, rates), "",
            _table(["Link", "Variant", "Images/s", "Time to 0.88 (s)", "Test accuracy", "kB up per step",
                    "kB down per step", "Exposed comm. per step (ms)"], body), "",
            f"{_g(bed.get('hosts'))} hosts of {_g(bed.get('cores_per_host'))} core each in their own network namespaces, "
            f"each behind its own link (shaped in both directions: {bed.get('shaping') or DASH}); the driver and the "
            f"master on the bridge. {_g(_get(ln, 'epochs'))} epochs per cell, one seed; {reps}; time to 0.88 "
            "is read at epoch ends (— where no epoch reached it). Exposed communication: ms per local step the "
            "tasks waited for the driver's replies (stream).", "",
            *reproduce_lines(list({f"{LINK_NAMES.get(name, name)} ({name})": c for _, cells in reversed(rates)
                                   for name, c in cells.items() if isinstance(c, dict)}.items()),
                             "Reproduce each variant's training (its config file and command; the shaped "
                             "links are the test bed's")]
    block = targets_block(ln, "links", tg.of_links(ln))
    return "\n".join(out + (["", block] if block else []))


def linkmodel_section(lm: dict | None) -> str:
    """linkmodel.json: the cost model fitted at unshaped and 1 Gbit/s, judged at slower links."""
    out = ["### Links: the cost model on held-out rates", ""]
    cells = [c for c in _list(_get(lm, "cells")) if isinstance(c, dict)]
    if not cells:
        return "\n".join(out + [NOT_MEASURED])
    body = [[_g(c.get("rate")), LINK_NAMES.get(c.get("variant"), _g(c.get("variant"))), _g(c.get("role")),
             _f(c.get("measured_images_per_s"), 0), _f(c.get("predicted_images_per_s"), 0),
             _f(c.get("error"), 1, 100, " %"), _g(c.get("bound")), _f(c.get("test_accuracy"), 4)] for c in cells]
    fit = _get(lm, "fit") or {}
    data = _get(lm, "links", "data")
    rows = f"{_g(_get(data, 'train_rows'))} training rows" if isinstance(data, dict) else "the full training set"
    reps = _get(lm, "links", "reps")
    runs = (f"each cell the median of {_g(reps)} repetitions" if isinstance(reps, int) and reps > 1
            else "one seed")
    out += [measured(lm, "linkmodel"), "",
            _table(["Link", "Variant", "Role", "Measured images/s", "Predicted images/s", "Error", "Bound",
                    "Test accuracy"], body), "",
            f"One `bench/links.py` run ({_g(_get(lm, 'links', 'epochs'))} epoch on {rows}, {runs}) at four rates. "
            "The model takes each variant's unshaped time and bytes per exchange and one constant fitted on the "
            f"1 Gbit/s cells, the CPU a shaped byte costs the hosts: {_f(fit.get('beta_ns_per_byte'), 2)} ns per "
            "byte. A stream exchange takes the longer of its compute with that CPU time and its round trip, the "
            "driver's time on the push then its bytes' time on the wire both ways at the link's rate, slice by "
            "slice of the run in time order; a jobs round adds compute and wire. Held out: the 100 and 20 Mbit/s "
            "cells, none of whose "
            f"figures is an input. Largest held-out error: {_f(_get(lm, 'max_abs_held_out_error'), 1, 100, ' %')} "
            f"(target {_f(_get(lm, 'target'), 0, 100, ' %')}); its verdict is in the table below."]
    block = targets_block(lm, "linkmodel", tg.of_linkmodel(lm))
    return "\n".join(out + (["", block] if block else []))


def _reps_note(cases: list[dict]) -> str:
    reps = {c.get("repetitions") for c in cases}
    n = reps.pop() if len(reps) == 1 else None
    return f", each figure the median of {_g(n)} repetitions" if isinstance(n, int) and n > 1 else ""


def psload_section(pl: dict | None) -> str:
    """psload.json: the parameter server under N synthetic workers replaying real deltas."""
    out = ["## Parameter server under load", ""]
    cases = [c for c in _list(_get(pl, "cases")) if isinstance(c, dict) and "workers" in c]
    if not cases:
        return "\n".join(out + [NOT_MEASURED])
    def largest(c):
        xs = [x for key in ("shard_cpu_ms_per_push", "server_process_cpu_ms_per_push")
              for x in _list(c.get(key)) if _num(x)]
        return max(xs) if xs else None

    def one(c):
        return c.get("shards", 1) == 1 and c.get("servers", 1) == 1

    body = [[_g(c.get("workers")), _g(c.get("shards")), _g(c.get("servers", 1)),
             _f(c.get("offered_pushes_per_s"), 0), _f(c.get("pushes_per_s"), 0),
             _f(_get(c, "reply_ms", "p50"), 1), _f(_get(c, "reply_ms", "p99"), 1),
             _f(c.get("server_cpu_ms_per_push"), 3),
             DASH if one(c) else _f(c.get("coordinator_cpu_ms_per_push"), 3),
             _f(largest(c), 3), _f(c.get("client_cpu_ms_per_push"), 3),
             _f(_get(c, "bytes_per_push", "down"), 1, 1e-3), _g(c.get("dropped"))]
            for c in cases]
    t = _get(pl, "target") or {}
    versus = _get(pl, "shards_against_one") or {}
    versus = "; ".join(f"{k}: {_f(_get(v, 'pushes_per_s'), 2)}x the pushes/s, {_f(_get(v, 'p99_ms'), 2)}x the p99"
                       for k, v in versus.items() if isinstance(v, dict))
    out += [measured(pl, "psload"), "",
            _table(["Workers", "Shards", "Servers", "Offered pushes/s", "Pushes/s", "Reply p50 (ms)",
                    "Reply p99 (ms)", "Server CPU per push (ms)", "Coordinator or driver (ms)",
                    "Largest shard or server (ms)",
                    "Load generator CPU per push (ms)", "kB down per push", "Dropped"],
                   body), "",
            *([f"K shards against one, at the same N: {versus}. Server CPU per push counts the coordinator and every "
               "shard process; on this machine they share 2 cores with the load generator.", ""] if versus else []),
            *([servers_sentence(pl), ""] if servers_cases(pl) else []),
            f"Target at {_g(t.get('at_workers'))} workers: {_f(t.get('pushes_per_s'), 0)} pushes/s with a reply p99 "
            f"under {_f(t.get('p99_ms'), 0)} ms (judged below){_reps_note(cases)}. One server process "
            "(the real stream engine and its Flight service) and one load-generator process share this machine's "
            "cores; the workers replay deltas a real run encoded (uplink density "
            f"{_g(_get(pl, 'density'))}), one push in flight each."]
    block = targets_block(pl, "psload", tg.of_psload(pl))
    return "\n".join(out + (["", block] if block else []))


def servers_cases(pl: dict | None) -> list[dict]:
    """psload.json's cases of one server process and of ``ps.servers`` > 1 (shards = 1), by N then K;
    none unless some case has more than one server."""
    cases = [c for c in _list(_get(pl, "cases")) if isinstance(c, dict) and c.get("shards", 1) == 1
             and isinstance(c.get("servers"), int) and isinstance(c.get("workers"), int)]
    if not any(c["servers"] > 1 for c in cases):
        return []
    return sorted(cases, key=lambda c: (c["workers"], c["servers"]))


def servers_sentence(pl: dict | None) -> str:
    """What the servers' figures mean on this machine, and their target's verdict."""
    ts = tg.of_servers(pl)
    verdict = f"**{ts[0].verdict}**" if ts and ts[0].verdict == tg.MISSES else ts[0].verdict if ts else DASH
    ratios = "; ".join(f"N = {n}: {_f(r, 3)}x" for n, r in _items(_get(pl, "servers_target", "cpu_ratio")))
    evidence = f" ({ts[0].evidence})" if ts else ""
    within = _f(_get(pl, "servers_target", "within"), 0, 100, " %")
    return (f"K server processes (`ps.servers`) against one: summed CPU per push (the driver's part and "
            f"every server process) at K = 2 over K = 1's, {ratios or DASH}; target within {within}: "
            f"{verdict}{evidence}. This machine has 2 cores and the load generator needs one, so capacity "
            "beyond K = 1 is shown by the CPU per push and by the pushes/s with a core per process (1000 ms "
            "over the busiest process's ms per push), not by the pushes/s measured here.")


def servers_block(pl: dict | None, label: str = "psload", sv: dict | None = None) -> str:
    """The README's ``servers`` block: K = 1 and K > 1 server processes at each N measured, from a
    psload.json (``label``: where it is, for the line naming the run), and the K the model
    (servermodel.json of the same folder, ``sv``) picks for each N."""
    cases = servers_cases(pl)
    if not cases:
        return "\n".join(["", NOT_MEASURED, "", ""])
    body = [[_g(c["workers"]), _g(c["servers"]), _f(c.get("server_cpu_ms_per_push"), 3),
             _f(c.get("driver_cpu_ms_per_push"), 3),
             ", ".join(_f(x, 3) for x in _list(c.get("server_process_cpu_ms_per_push"))) or DASH,
             _f(c.get("capacity_pushes_per_s"), 0), _f(c.get("pushes_per_s"), 0),
             _f(_get(c, "reply_ms", "p99"), 1)] for c in cases]
    offered = {c.get("offered_pushes_per_s") for c in cases}
    offered = _f(offered.pop(), 0) if len(offered) == 1 else DASH
    return "\n".join([
        "", _table(["Workers N", "Servers K", "Server CPU per push (ms)", "Driver's part (ms)",
                    "Each server (ms)", "Pushes/s with a core each", "Pushes/s here", "Reply p99 (ms)"],
                   body), "",
        f"{servers_sentence(pl)} Offered {offered} pushes/s{_reps_note(cases)}. {measured(pl, label)}", "",
        *([servers_choice(sv), ""] if servers_choice(sv) else []), ""])


def servers_choice(sv: dict | None) -> str:
    """The model's answer to how many server processes N workers need (servermodel.json), or ''."""
    best, by = _get(sv, "best_servers"), _get(sv, "by_servers")
    if not isinstance(best, dict) or not isinstance(by, dict):
        return ""
    picks = "; ".join(f"N = {n}: K = {k} ({_f(_get(by, k, 'speed_up', n), 1)}x)" for n, k in best.items())
    return (f"How many to choose, as `bench/servermodel.py` predicts from these costs (a core per worker and per "
            f"process, steps of {_f(_get(sv, 'step_ms'), 1)} ms, a worker's {_f(_get(sv, 'worker_ms'), 2)} ms "
            f"outside training, a driver host of {_g(_get(sv, 'cores'))} cores): the smallest K of the best "
            f"per-step speed-up, {picks}.")


def speed_up_table(by: dict, best: dict | None) -> tuple[list, str]:
    """A model's predicted speed-ups (``by``: K -> its ``speed_up`` by N, ``best``: N -> K):
    (the Ks, the table of N by K with the best K of each N)."""
    ks = sorted(by, key=lambda k: int(k) if str(k).isdigit() else 0)
    ns = list((_get(by, ks[0], "speed_up") or {}).keys())
    body = [[n, *[_f(_get(by, k, "speed_up", n), 1) for k in ks], _g(_get(best, n))] for n in ns]
    return ks, _table(["Workers N", *[f"K = {k}" for k in ks], "Best K"], body)


def servermodel_section(sv: dict | None, pl: dict | None = None) -> str:
    """servermodel.json: the per-step speed-up predicted with K server processes that split the workers."""
    out = ["## Predicted speed-up with K server processes", ""]
    by = _get(sv, "by_servers")
    if not isinstance(by, dict) or not by:
        return "\n".join(out + [NOT_MEASURED])
    ks, table = speed_up_table(by, _get(sv, "best_servers"))
    f, v = _get(sv, "fit") or {}, _get(sv, "validation") or {}
    caps = ", ".join(f"K = {k}: {_f(_get(by, k, 'capacity_pushes_per_s'), 0)}" for k in ks)
    held = "; ".join(f"K = {k}: {_f(_get(x, 'predicted'), 0)} predicted, {_f(_get(x, 'measured'), 0)} measured"
                     for k, x in _items(v.get("by_servers")))
    out += [measured(sv, "servermodel"), "", table, "",
            f"Per-step GS-ASGD + MS, a core per worker and per server process on a driver host of "
            f"{_g(_get(sv, 'cores'))} cores, a {_g(_get(sv, 'gbit'))} Gbit/s driver link, steps of "
            f"{_f(_get(sv, 'step_ms'), 1)} ms and {_f(_get(sv, 'worker_ms'), 2)} ms of a worker's CPU outside "
            f"training. Costs per push measured by `bench/psload.py --servers 1 2` at N = "
            f"{_g(f.get('at_workers'))}: one server {_f(f.get('c_1_ms'), 3)} ms; two server processes "
            f"{_f(f.get('s_2_ms'), 3)} ms summed (taken to grow linearly with K beyond) and the driver's part "
            f"{_f(f.get('d_ms'), 3)} ms. Pushes/s the servers sustain: {caps}. Fitted at N = "
            f"{_g(v.get('fitted_at_workers'))} instead, the model's capacities at N = {_g(v.get('held_out_workers'))}: "
            f"{held or DASH}."]
    block = targets_block(sv, "servermodel", tg.of_servermodel(sv))
    return "\n".join(out + (["", block] if block else []))


def shardmodel_section(sm: dict | None, pl: dict | None = None) -> str:
    """shardmodel.json: the per-step speed-up predicted with K shards from psload's per-push costs."""
    out = ["## Predicted speed-up with K parameter-server shards", ""]
    by = _get(sm, "by_shards")
    if not isinstance(by, dict) or not by:
        return "\n".join(out + [NOT_MEASURED])
    ks, table = speed_up_table(by, _get(sm, "best_shards"))
    f, t = _get(sm, "fit") or {}, _get(sm, "target") or {}
    caps = ", ".join(f"K = {k}: {_f(_get(by, k, 'capacity_pushes_per_s'), 0)}" for k in ks)
    out += [measured(sm, "shardmodel"), "", table, "",
            f"Per-step GS-ASGD + MS, a core per worker and per server process, a {_g(_get(sm, 'gbit'))} Gbit/s "
            f"driver link, steps of {_f(_get(sm, 'step_ms'), 1)} ms. Costs per push measured by `bench/psload.py` "
            f"(at N = {_g(_get(sm, 'fitted_at_workers'))}): one server {_f(f.get('c_1_ms'), 3)} ms; with shards "
            f"the coordinator {_f(f.get('c_0_ms'), 3)} + {_f(f.get('c_w_ms'), 3)} K ms and a shard "
            f"{_f(f.get('s_0_ms'), 3)} + {_f(f.get('s_r_ms'), 3)} f ms (f: its share of the entries; the largest "
            f"tensor bounds it). Pushes/s the server sustains: {caps}. Target, at least "
            f"{_f(t.get('fraction_of_n'), 1)} N up to N = {_g(t.get('up_to'))} with the best K (judged below, on "
            "the repetitions of the costs it was fitted on)."]
    block = targets_block(sm, "shardmodel", tg.of_shardmodel(sm, pl))
    return "\n".join(out + (["", block] if block else []))


MOMENTUM_FORMS = (("correction", "Momentum correction"), ("sparsification_aware", "SAMomentum"))


def _per_epoch(mo: dict | None, setting, blocks, form) -> list[float]:
    """Mean test accuracy after each epoch over the seeds of one cell of momentum.json."""
    runs = [r for r in _list(_get(mo, "runs")) if isinstance(r, dict)
            and (r.get("setting"), r.get("blocks"), r.get("form")) == (setting, blocks, form)]
    curves = [r["accuracy_per_epoch"] for r in runs if isinstance(r.get("accuracy_per_epoch"), list)]
    if not curves or len({len(c) for c in curves}) != 1:
        return []
    return [sum(c[i] for c in curves) / len(curves) for i in range(len(curves[0]))]


def momentum_section(mo: dict | None, fig) -> str:
    """momentum.json: sparsification-aware momentum against momentum correction, by N blocks."""
    out = ["## Sparsification-aware momentum against momentum correction", ""]
    rows = [r for r in _list(_get(mo, "summary")) if isinstance(r, dict) and "blocks" in r]
    if not rows:
        return "\n".join(out + [NOT_MEASURED])

    def form(r, key):
        return r.get(key) if isinstance(r.get(key), dict) else {}

    def epochs(r, key):
        return " → ".join(_f(x, 3) for x in _per_epoch(mo, r.get("setting"), r.get("blocks"), key)) or DASH

    def acc(r, key):
        f, stopped = form(r, key), form(r, key).get("stopped")
        if f.get("mean") is None and stopped:
            return f"all {_g(stopped)} seeds stopped by the guard"
        return _pm(f.get("mean"), f.get("sd"), 4) + (f" ({_g(stopped)} stopped)" if stopped else "")

    body = [[f"`{r.get('setting', DASH)}`", _g(r.get("blocks")), *(acc(r, k) for k, _ in MOMENTUM_FORMS),
             _f(r.get("samomentum_minus_correction_points"), 2),
             *(epochs(r, k) for k, _ in MOMENTUM_FORMS),
             " / ".join(_f(form(r, k).get("final_train_loss"), 3) for k, _ in MOMENTUM_FORMS),
             " / ".join(_f(form(r, k).get("bytes_per_push"), 1, 1e-3) for k, _ in MOMENTUM_FORMS)] for r in rows]
    settings = _get(mo, "settings") or {}
    said = "; ".join(f"`{k}`: " + (", ".join(f"`{o}`" for o in v) if isinstance(v, list) and v else
                                   "the project's defaults") for k, v in _items(settings))
    out += [measured(mo, "momentum"), "",
            fig("momentum.png", "Final test accuracy by number of blocks, momentum correction and SAMomentum",
                _draw_momentum, rows), "",
            _table(["Setting", "N", "Momentum correction", "SAMomentum", "SAMomentum − correction (points)",
                    "Correction by epoch", "SAMomentum by epoch",
                    "Last epoch's training loss (correction / SAMomentum)",
                    "kB per push (correction / SAMomentum)"], body),
            "", displacement_sentence(mo), "",
            f"GS-ASGD + MS on the stream at one step per exchange (uplink density 0.001 after a 1-epoch "
            f"warm-up from 0.25, downlink 0.01), {_g(_get(mo, 'epochs'))} epochs, {_g(_get(mo, 'seeds'))} seeds per "
            "cell: mean ± sample standard deviation of the final test accuracy, and the mean after each epoch; "
            "training loss: the mean over the last epoch's pushes. "
            f"N blocks on `local[N]`, one per slot. Settings: {said}. kB per push: bytes up and down per applied "
            "push."]
    block = targets_block(mo, "momentum", tg.of_momentum(mo))
    return "\n".join([x for x in out if x is not None] + (["", block] if block else []))


def displacement_sentence(mo: dict | None) -> str | None:
    """How far each form's policy moves the weights on one synthetic gradient stream (momentum.json)."""
    d = _get(mo, "displacement")
    st = _get(d, "stream") or {}
    if not all(_num(_get(d, k, "along")) for k, _ in MOMENTUM_FORMS):
        return None
    def v(x):
        return f"{x:g}" if _num(x) else DASH

    noise = st.get("noise_sd") / st.get("mean_sd") if _num(st.get("noise_sd")) and _num(st.get("mean_sd")) else None
    return (f"Why a form trains slower: both policies fed one synthetic gradient stream ({v(st.get('size'))} "
            f"entries, {v(st.get('steps'))} steps at density {v(st.get('density'))}, lr {v(st.get('lr'))}, "
            f"momentum {v(st.get('momentum'))}; per entry a fixed mean plus noise {v(noise)} times the spread of "
            "the means). What the server applied, projected on the displacement of dense "
            f"momentum SGD on the same stream: momentum correction {_f(_get(d, 'correction', 'along'), 3)}, "
            f"SAMomentum {_f(_get(d, 'sparsification_aware', 'along'), 3)}. An entry SAMomentum sends rarely "
            "accumulates its gradients undecayed but gains no momentum (u /= m where not sent), so at the same lr "
            "its steps are smaller; the `lr_x4` rows test whether that is the whole gap.")


def momentum_finding(mo: dict | None) -> str | None:
    """One README line: SAMomentum against momentum correction at the largest N, and the measured reason."""
    rows = {(r.get("setting"), r.get("blocks")): r for r in _list(_get(mo, "summary")) if isinstance(r, dict)}
    n = max((b for s, b in rows if s == "project" and _num(b)), default=None)
    row = rows.get(("project", n))
    if not row or not _num(row.get("samomentum_minus_correction_points")):
        return None
    mc, sa = row["correction"], row["sparsification_aware"]
    x4 = rows.get(("lr_x4", n)) or {}
    sa4, mc4 = _get(x4, "sparsification_aware", "mean"), _get(x4, "correction", "mean")
    d = _get(mo, "displacement") or {}
    gap, gap4 = row["samomentum_minus_correction_points"], 100 * (sa4 - mc["mean"]) if _num(sa4) else None
    head = (f"- **Sparsification-aware momentum, {_g(n)} blocks:** {_f(gap, 2)} points against momentum "
            f"correction after {_plural(_get(mo, 'epochs'), 'epoch')} ({_f(sa.get('mean'), 4)} against "
            f"{_f(mc.get('mean'), 4)})")
    if gap >= -0.3:
        return head + ": meets the target (within 0.3 points, or better)."
    losses = (sa.get("final_train_loss"), mc.get("final_train_loss"))
    slower = all(_num(x) for x in losses) and losses[0] > losses[1]
    said = f"last epoch's training loss {_f(losses[0], 3)} against {_f(losses[1], 3)}"
    if gap4 is not None:
        at4 = (f"; at 4x the lr it reaches {_f(sa4, 4)}, {_f(abs(gap4), 2)} points "
               f"{'above' if gap4 >= 0 else 'below'} correction at the project's lr"
               + (f", while correction at 4x the lr reaches {_f(mc4, 4)}." if _num(mc4) else "."))
    else:
        at4 = "; at 4x the lr the guard stopped every seed." if _get(x4, "sparsification_aware", "stopped") else "."
    return (head + ", so `correction` is the default. Measured reason: "
            + (f"it trains slower ({said}); " if slower else f"not slower training ({said}); ")
            + f"at the same lr it moves the weights {_f(_get(d, 'sparsification_aware', 'along'), 3)} of dense "
            f"momentum SGD's way, correction {_f(_get(d, 'correction', 'along'), 3)}" + at4)


def cifar_table(cif: dict | None) -> str:
    generated = _get(cif, "throughput_only") is True  # runs before the real data: generated images
    out = ["## " + ("CIFAR-10-format run (throughput only)" if generated else "CIFAR-10 (JPEG copy), ResNet-20"), ""]
    modes = [m for m in _list(_get(cif, "modes")) if isinstance(m, dict)]
    if not modes:
        return "\n".join(out + [NOT_MEASURED])
    body = [[_g(m.get("mode")), _g(m.get("steps_per_exchange")),
             f"error: {m['error']}" if m.get("error") else _f(m.get("images_per_s"), 1),
             _f(m.get("test_accuracy"), 3), _f(m.get("bytes_up_per_exchange"), 0),
             _f(m.get("bytes_down_per_exchange"), 0)] for m in modes]
    about = ("on generated data in the CIFAR-10 binary format, so no accuracy is reported" if generated else
             f"on a seeded sample of {_g(_get(cif, 'train_rows'))} training and {_g(_get(cif, 'test_rows'))} test "
             f"images of {_g(_get(cif, 'dataset'))}; test accuracy of the weights each mode reached (a mode's "
             f"images/s counts when it reached {_f(_get(cif, 'trained_at_least'), 2)})")
    out += [measured(cif, "cifar"), "",
            _table(["Mode", "H", "Images/s", "Test accuracy", "Bytes up per exchange", "Bytes down per exchange"],
                   body), "",
            f"{_g(_get(cif, 'model'))} ({_g(_get(cif, 'parameters'))} parameters, batch "
            f"{_g(_get(cif, 'batch_size'))}) {about}. Images/s in the steady state per mode; bytes: mean bytes sent "
            "to (up) and received from (down) the driver per exchange (a sync round of every block, an async job or "
            "a stream push)."]
    block = targets_block(cif, "cifar", tg.of_cifar(cif))
    return "\n".join(out + (["", block] if block else []))


def scale_section(sc: dict | None, cm: dict | None, fig) -> str:
    out = ["## Scale", "", "### Driver apply cost", ""]
    apply_s, merged = _get(sc, "driver_apply_s"), _get(sc, "driver_apply_merged_s")
    if not isinstance(apply_s, dict) or not apply_s:
        out.append(NOT_MEASURED)
    else:
        ns = sorted({n for by_n in apply_s.values() if isinstance(by_n, dict) for n in by_n}, key=_order)
        body = []
        for model, by_n in _items(apply_s):
            params = _g(_get(sc, "model_params", model))
            for label, src in ((f"{model} ({params} params), N payloads", by_n),
                               (f"{model}, one payload merged by the executors", _get(merged, model))):
                if isinstance(src, dict):
                    body.append([label, *(_f(src.get(n), 2, 1000) for n in ns)])
        out += [measured(sc, "scale"), "",
                _table(["Model, payloads applied", *(f"N = {n} (ms)" for n in ns)], body), "",
                "Milliseconds of the engine's apply path for N sparse payloads of one model size (density "
                f"{_g(_get(sc, 'density'))}): decode and validate each, the divergence guard, the weighted sum "
                "and the parameter-server update; best of a few repetitions. Merged rows (when measured): the driver "
                "applies one payload, the N deltas summed by the executors in a tree of twos (their merge cost "
                "is not in it)."]
    out += ["", "### Cost model: held-out validation", ""]
    rows = [r for r in _list(_get(cm, "validation")) if isinstance(r, dict)]
    if not rows:
        out.append(NOT_MEASURED)
    else:
        body = [[_g(r.get("setup")), _g(r.get("case")), _f(r.get("predicted"), 1), _f(r.get("measured"), 1),
                 _f(r.get("error"), 1, 100, " %"), _g(r.get("bound"))] for r in rows]
        out += [measured(cm, "costmodel"), "",
                _table(["Setup", "Case", "Predicted images/s", "Measured images/s", "Error", "Bound"], body), "",
                "Each row: a case of a setup whose measurements were left out of the fit (constants fitted on "
                "the other setup), the images/s the model predicts for it, the measured images/s and the error "
                "(predicted / measured - 1); bound: the term of the model that sets the time per exchange. "
                f"Largest absolute error: {_f(_get(cm, 'max_abs_error'), 1, 100, ' %')}."]
    curves = speedup_curves(_get(cm, "speedup_curve"))
    if curves:
        ns = sorted({n for pts in curves.values() for n, _ in pts})
        body = [[label, *(_f(dict(pts).get(n), 1) for n in ns)] for label, pts in curves.items()]
        out += ["", "### Cost model: predicted speed-up", "", measured(cm, "costmodel"), "",
                _table(["Link, H, transport, payload", *(f"N = {n:g}" for n in ns)], body), "",
                "Speed-up over one worker alone that the fitted model predicts for N workers with a core each, "
                "by driver link bandwidth, local steps per exchange, transport (jobs: sync rounds of Spark jobs; "
                "stream: async pushes) and payload (sparse: uplink density 0.001, downlink 0.01); constants "
                f"fitted on the {_g(_get(cm, 'speedup_curve', 'constants_from'))} setup.", "",
                fig("speedup.png", "Predicted speed-up vs N", _draw_speedup, curves)]
    for doc, name, ts in ((sc, "scale", tg.of_scale(sc)), (cm, "costmodel", tg.of_costmodel(cm))):
        block = targets_block(doc, name, ts)
        out += ["", block] if block else []
    return "\n".join(out)


def speedup_curves(sc) -> dict[str, list[tuple[float, float]]]:
    """costmodel.json's ``speedup_curve`` ({"n": [N, ...], "<G>gbit_h<H>_<transport>_<kind>": [speed-up,
    ...]}, or a curve as {N: speed-up}) as {row label: [(N, speed-up)]}; empty when it is neither."""
    ns, curves = _list(_get(sc, "n")), {}
    for key, v in _items(sc):
        pts = []
        for n, x in (zip(ns, v) if isinstance(v, list) and key != "n" else _items(v)):
            try:
                pts.append((float(n), float(x)))
            except (TypeError, ValueError):
                pass
        m = re.fullmatch(r"(\d+(?:\.\d+)?)gbit_h(\d+)_([a-z]+)_([a-z]+)", str(key))
        if pts:
            curves[f"{m[1]} Gbit/s, H = {m[2]}, {m[3]}, {m[4]}" if m else str(key)] = pts
    return curves


def balance_section(bal: dict | None, thr: dict | None, fig) -> str:
    out = ["## Load balance and overlap", ""]
    if bal is None:
        out.append(NOT_MEASURED)
    else:
        modes = [("Sync, same H on both executors", "unbalanced", "unbalanced_images_per_s"),
                 ("Sync, H sized per executor", "sync_balanced", "sync_balanced_images_per_s"),
                 ("Async, jobs sized by time", "balanced", "balanced_images_per_s"),
                 ("Sum of each executor alone", "solo", "solo_sum_images_per_s")]
        solo = bal.get("solo_sum_images_per_s")
        trained = all((bal.get("trained") or {}).values())  # a run that did not train gets no share
        body = [[label, _f(bal.get(k), 1), _f(bal[k] / solo, 1, 100, " %")
                 if trained and _num(bal.get(k)) and _num(solo) and solo else DASH, _f(_get(bal, part, "idle_fraction"), 1, 100, " %"),
                 _f(_get(bal, part, "round_overhead_ms"), 1)] for label, part, k in modes]
        out += [measured(bal, "balance"), "",
                _table(["Mode", "Images/s", "Of solo sum", "Idle", "Overhead per round or job (ms)"], body), "",
                f"Two executors of one core ({_g(bal.get('executors'))}), one slowed "
                f"{_g(_get(bal, 'solo_speed_ratio'))}x. Of solo sum: images/s over the sum of each executor's rate "
                "when it trains alone (a perfectly balanced run with free communication). Idle: the share of "
                "executor time spent waiting; overhead: job wall minus the slowest task.", "",
                *([f"Test accuracy: sync same H {_f(_get(bal, 'unbalanced', 'test_accuracy'), 4)}, "
                   f"async {_f(_get(bal, 'balanced', 'test_accuracy'), 4)} "
                   f"({_g(_get(bal, 'balanced', 'epochs'))} passes, {_g(_get(bal, 'balanced', 'records'))} jobs), "
                   f"solo {_f(bal.get('solo_test_accuracy'), 4)} ({_g(bal.get('solo_records'))} jobs); "
                   f"{_g(bal.get('accuracy_gate'))}: "
                   + ("met." if trained else "**not met**, so no share of the solo sum."), ""]
                  if "trained" in bal else []),
                fig("balance.png", "Images/s by mode, one executor slowed", _draw_balance, modes, bal)]
        block = targets_block(bal, "balance", tg.of_targets_met(bal))
        out += ["", block] if block else []
    rows = throughput_rows(thr)
    if rows:
        out += ["", fig("overlap.png", "Exposed communication vs compute per exchange", _draw_overlap, rows), "",
                "Overlap (throughput.json): per exchange, the training compute and the time communication "
                "adds on top of it (jobs: job wall minus the slowest task, pipelined: round wall minus compute; "
                "stream: exposed ms per step x steps), log scale."]
    return "\n".join(out)


def jobcost_table(jc: dict | None) -> str:
    out = ["## Spark's per-job cost", ""]
    kinds = _get(jc, "kinds")
    if not isinstance(kinds, dict) or not kinds:
        return "\n".join(out + [NOT_MEASURED])
    body = [[kind, _g(_get(k, "tasks")), _g(_get(k, "result_bytes_per_task")), _f(_get(k, "jvm_cpu_ms_per_job"), 1),
             _f(_get(k, "driver_cpu_ms_per_job"), 1), _f(_get(k, "wall_ms_per_job"), 1)] for kind, k in _items(kinds)]
    out += [measured(jc, "jobcost"), "",
            _table(["Job", "Tasks", "Result bytes per task", "JVM CPU ms/job", "Driver CPU ms/job", "Wall ms/job"],
                   body), "",
            "Spark's own cost per job before any training, over "
            f"{_g(jc.get('jobs'))} jobs after warm-up on {_g(jc.get('master'))}: CPU of the JVM (scheduling, "
            "task launch, moving results), CPU of the driver's Python process (py4j, pickling, reading results) "
            "and wall time. A 2-task job with dense results costs "
            f"{_f(jc.get('share_of_h10_round'), 1, 100, ' %')} of the CPU of one H = 10 round."]
    return "\n".join(out)


def _exit_said(e: dict) -> str:
    code = e.get("exit")
    said = {0: "finished", EXIT_MISSED: "a target missed"}.get(code, "failed") if isinstance(code, int) else DASH
    return _g(code) + (f" ({e['error']})" if e.get("error") else f" ({said})" if isinstance(code, int) else "")


def run_table(ra: dict | None, docs: dict | None = None) -> str:
    out = ["## How this run was made", ""]
    entries = [e for e in _list(_get(ra, "benchmarks")) if isinstance(e, dict)]
    if not entries:
        return "\n".join(out + [NOT_MEASURED])
    judged = tg.of_folder(docs or {})
    body = [[_g(e.get("name")), f"`{e['command']}`" if e.get("command") else DASH, _exit_said(e),
             tg.summary(judged[e["name"]]) if judged.get(e.get("name")) else DASH, _f(e.get("wall_s"), 0)]
            for e in entries]
    out += [measured(ra, "run_all"), "",
            _table(["Benchmark", "Command", "Exit status", "Targets", "Wall (s)"], body), "",
            "Each benchmark ran as its own process, one after another on this machine; what it printed is "
            f"saved beside this document's data as `<benchmark>.json`. Exit status 0: finished with no target "
            f"missed; {EXIT_MISSED}: finished, a target missed; any other: failed. Targets: what this document "
            "judges from the JSON (an older bench exited 0 on a missed target). A benchmark without a JSON "
            "renders as not measured."]
    return "\n".join(out)


def method_section(docs_dir: str) -> str:
    """How the figures above are measured: fixed text (no figures), with links to the design notes."""
    return "\n".join([
        "## How it is measured", "",
        "- **One folder, one run.** `bench/run_all.py` runs every benchmark as its own process, one after "
        "another on one machine, into one folder; each prints one JSON object that names its commit, command, "
        "machine and date (`provenance`), and the tree must be committed (`git_dirty: false`). This document and "
        "the README's figures are a pure function of that folder: `python bench/render.py DIR --readme README.md "
        "--check` re-renders both and fails on any difference, and the test suite runs it on the committed "
        "folder.",
        "- **Throughput** (`bench/throughput.py`). Images/s in the steady state, warm-up and drain left out, "
        "against the compute limit: two single-thread processes each training its own block with no "
        "communication, measured once per run with its repetitions (`compute_limit`); every efficiency of a "
        "table divides by that one limit, and its spread is shown. Older runs divided each stream case by "
        "limits of its own, taken right before and after it: their efficiencies are shown as not judged. "
        "Every speed figure carries the test accuracy of the same run, or says it is missing.",
        "- **Targets.** Every target a benchmark judges is in its section's table, holding or not, and "
        "counted in the line this document opens with. The rule is in code (`bench/targets.py`): a speed or "
        "latency target is judged on the median of at least 5 repetitions, a tail latency on every "
        "repetition, an accuracy target on the mean of at least 2 seeds with their sd; with fewer, not judged.",
        "- **CPU accounting.** Every core-millisecond of an exchange is counted from /proc: the driver's Python, "
        "the JVM and Spark's Python workers, against `training_cpu_ms`, what the limit's processes spend on the "
        "same images. `efficiency_vs_limit` is exactly `compute_share` (training CPU over all CPU used) times "
        "`cores_busy`: when both cores are busy, whatever is not training caps the efficiency, and on a cluster, "
        "where the driver has cores of its own, the driver's and Spark's share leaves the executors' cores.",
        "- **Accuracy** (`bench/accuracy.py`). Each variant trains the same model on the same data and "
        "blocks; test accuracy is read at every epoch end, so a time to a target accuracy is the first epoch end "
        "at or above it. Rows over several seeds give the mean ± standard deviation over the seeds; the steady "
        "compression ratios are read once the density warm-up is over.",
        "- **Spark's per-job cost** (`bench/jobcost.py`). Jobs that train nothing, empty or returning dense "
        "results, after a warm-up: what a job costs the JVM and the driver before any training.",
        "",
        f"How the transports work and why they are built so: [transports]({docs_dir}/transports.md); the data "
        f"path, the parameter server and the modules: [architecture]({docs_dir}/architecture.md). The JSON of "
        "earlier runs stays in its own folders under `bench/results/`.",
    ])


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def headline(acc: dict | None, thr: dict | None, doc_link: str, mo: dict | None = None, summary: str = "",
             cifar: str | None = None) -> str:
    """The README block: three numbers, one line each, the momentum finding when measured, the
    CIFAR-10 line (``cifar``) and the targets' summary line with a link to the whole document."""
    by = {_name(r): r for r in seed_rows(acc)}
    ms = by.get("stream-gs-asgd-ms", {})
    seeds = _plural(len(ms["seeds"]), "seed") if isinstance(ms.get("seeds"), list) else f"{DASH} seeds"
    h1 = [(label, m, efficiency(thr, m, k)) for label, m, k in throughput_rows(thr)
          if m.get("steps_per_exchange") == 1 and _num(efficiency(thr, m, k))]
    best_case, best, best_eff = max(h1, key=lambda lm: lm[2], default=(DASH, {}, None))
    up = {n: _stat(by.get(n, {}), "bytes_up")[0] for n in ("stream-gs-asgd", "stream-asgd")}
    fewer = up["stream-asgd"] / up["stream-gs-asgd"] if all(_num(v) and v for v in up.values()) else None
    finding = momentum_finding(mo)
    whole = _stat(ms, "run_downlink_ratio")[0]
    if whole is None:  # results from before the aggregate: the mean over the row's own runs
        per_run = [r.get("run_downlink_ratio") for r in ms.get("runs") or []
                   if isinstance(r, dict) and "collapsed" not in r]
        whole = statistics.fmean(per_run) if per_run and all(_num(v) for v in per_run) else None
    return "\n".join([
        "",
        f"- **GS-ASGD + model-parameter sparsification, H = 1:** final test accuracy "
        f"{_pm(*_stat(ms, 'test_accuracy'), 4)} over {seeds}, downlink compressed "
        f"{_f(_stat(ms, 'steady_downlink_ratio')[0], 1)}x in the steady state and "
        f"{_f(whole, 1)}x over the whole run.",
        (f"- **Closest to the compute limit at H = 1:** {_f(best_eff, 1, 100, ' %')} of it "
         f"({best_case}, {_f(best.get('images_per_s'), 1)} images/s, {tg.accuracy_note(best)})."
         if h1 else "- **Closest to the compute limit at H = 1:** not judged: no single compute limit was "
         "measured for this run."),
        f"- **Uplink bytes, H = 1:** GS-ASGD sends {_f(up['stream-gs-asgd'], 1, 1e-6)} MB, ASGD "
        f"{_f(up['stream-asgd'], 1, 1e-6)} MB ({_f(fewer, 1)}x fewer).",
        *([finding] if finding else []),
        *([cifar] if cifar else []),
        "",
        (f"{summary}; every target, table, figure and the machine they were measured on: " if summary else
         "Every table, figure and the machine they were measured on: ")
        + f"[{os.path.basename(doc_link)}]({doc_link}).",
        "", ""])


# the README's table at a glance: the seed papers' variants at one step per exchange, and dense
# synchronous SGD over Spark jobs as the baseline
GLANCE = ("sync-dense", "stream-asgd", "stream-gs-asgd", "stream-gs-asgd-ms", "stream-gs-asgd-samomentum")


def _transport(run: dict) -> str:
    return ("stream" if _setting(run, "engine.transport") == "stream" else "jobs") + \
        (", async" if _setting(run, "engine.mode") == "async" else ", sync")


def summary_line(all_targets: list) -> str:
    """Every target of the folder, counted: BENCHMARKS.md opens with it and the README's results at
    a glance show it."""
    return f"**Targets: {tg.summary(all_targets)}**"


def glance_block(acc: dict | None) -> str:
    """The README's "results at a glance" table: a few rows of the seed table, fewer columns."""
    by = {_name(r): r for r in seed_rows(acc)}
    rows = [by[n] for n in GLANCE if n in by]
    if not rows:
        return f"\n{NOT_MEASURED}\n\n"
    body = [[NAMES[_name(r)], f"{_transport(r)}, H = {_h(r)}", _pm(*_stat(r, "test_accuracy"), 4),
             _f(_stat(r, "time_to_0_90_s")[0], 0) + _reached(r, "time_to_0_90_s"),
             _f(_stat(r, "bytes_up")[0], 1, 1e-6), _f(_stat(r, "bytes_down")[0], 1, 1e-6), _config_file(r)]
            for r in rows]
    keras = _get(acc, "reference", "keras")
    keras = keras if isinstance(keras, dict) else {}
    body.append(["Keras `model.fit`, one process", DASH, _f(keras.get("test_accuracy"), 4),
                 _f(keras.get("time_to_0_90_s"), 0), DASH, DASH, _config_file(keras)])
    return "\n".join([
        "",
        _table(["Variant", "Transport, mode, H", "Final test accuracy", "Seconds to 0.90", "MB up", "MB down",
                "Config"], body),
        "",
        f"{_g(_get(acc, 'reference', 'keras', 'epochs'))} epochs of Fashion-MNIST ({_g(_get(acc, 'model'))}), "
        f"{_g(_get(acc, 'blocks'))} blocks; MB: what all blocks sent to (up) and received from (down) the "
        "driver over the run. Config: the file the row trained (— where the run recorded none); "
        "`sparkcnn train --config FILE` trains it, the Keras row `python bench/keras_fit.py --config FILE`, "
        "and BENCHMARKS.md gives each row's whole command.",
        "", ""])


def transports_block(thr: dict | None, jc: dict | None) -> str:
    """The README's transports table: images/s and the CPU outside training per exchange, per
    transport, mode and H, and Spark's own CPU per job."""
    def steps(label: str) -> float:
        found = re.search(r"H [=≈] ([\d.]+)", label)
        return float(found[1]) if found else 0.0

    # H up to 10: where the choice of transport matters (BENCHMARKS.md has every H)
    rows = [r for r in throughput_rows(thr) if steps(r[0]) <= 10]
    if not rows:
        return f"\n{NOT_MEASURED}\n\n"

    def overhead(m):
        parts = [_get(m, "cpu", "cpu_ms", p) for p in ("driver", "jvm")]
        return sum(parts) if all(_num(x) for x in parts) else None

    body = [[label, _f(m.get(k), 0), tg.accuracy_note(m).replace("test accuracy ", ""),
             _efficiency_cell(thr, m, k, 0), _f(overhead(m), 1)]
            for label, m, k in rows]
    jvm = [x for x in (_get(k, "jvm_cpu_ms_per_job") for _, k in _items(_get(jc, "kinds"))) if _num(x)]
    spark = (f"Spark's own JVM CPU per job, before any training: {_f(min(jvm), 1)} to {_f(max(jvm), 1)} ms "
             "(`bench/jobcost.py`)." if jvm else "")
    return "\n".join([
        "",
        _table(["Transport, mode, H", "Images/s", "Test accuracy", "Of the compute limit",
                "Driver + JVM CPU ms per exchange"], body),
        "",
        f"On {_g(_get(thr, 'master'))}, {_g(_get(thr, 'blocks'))} blocks; test accuracy of the same run; compute "
        f"limit, two processes training with no communication: {_limit_said(thr, 0)}. {spark}".rstrip(),
        "", ""])


# ---- figures (matplotlib, Agg); not part of the check ------------------------------------------

def _plot(path: str, draw, *data) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    try:
        draw(ax, *data)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    except Exception:  # a figure must never cost the document; the text is what is checked
        log.warning("figure %s not drawn", path, exc_info=True)
    finally:
        plt.close(fig)


def _draw_accuracy(ax, rows, keras):
    # the colour cycle holds 10: rows beyond it change line style, so no two lines look alike
    for i, r in enumerate(rows):
        acc = r.get("accuracy_per_epoch_mean") or r.get("accuracy_per_epoch") or []
        ax.plot(range(1, len(acc) + 1), acc, marker=".", linestyle=("-", ":", "-.")[i // 10 % 3],
                label=f"{NAMES.get(_name(r), _name(r))}, H = {_h(r)}")
    if isinstance(keras, dict) and keras.get("accuracy_per_epoch"):
        acc = keras["accuracy_per_epoch"]
        ax.plot(range(1, len(acc) + 1), acc, "k--", label="Keras model.fit")
    ax.set(xlabel="epoch", ylabel="test accuracy")
    ax.legend(fontsize=7)


def _draw_links(ax, rates):
    names = sorted({n for _, cells in rates for n in cells}, key=list(LINK_NAMES).index if all(
        n in LINK_NAMES for _, cells in rates for n in cells) else str)
    width = 0.8 / max(1, len(names))
    for j, name in enumerate(names):
        ys = [(_get(cells, name, "time_to_0_88_s") or 0) for _, cells in rates]
        ax.bar([i + j * width for i in range(len(rates))], ys, width, label=LINK_NAMES.get(name, name))
    ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(rates))], [r for r, _ in rates])
    ax.set(xlabel="link rate per host", ylabel="seconds to 0.88 test accuracy (0: not reached)")
    ax.legend(fontsize=7)


def _draw_speedup(ax, curves):
    """One panel per link bandwidth (the label's first part), a line per curve."""
    groups: dict[str, dict] = {}
    for label, pts in curves.items():
        head, _, rest = label.partition(", ")
        groups.setdefault(head, {})[rest or head] = pts
    fig = ax.figure
    ax.remove()
    axes = fig.subplots(1, len(groups), sharey=True, squeeze=False)[0]
    for ax, (head, group) in zip(axes, groups.items()):
        for label, pts in group.items():
            ax.plot([n for n, _ in pts], [x for _, x in pts], marker=".", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set(title=head, xlabel="workers N")
        ax.legend(fontsize=6)
    axes[0].set_ylabel("predicted speed-up")


def _draw_momentum(ax, rows):
    labels = [f"{r.get('setting')}, N = {r.get('blocks')}" for r in rows]
    width = 0.8 / len(MOMENTUM_FORMS)
    for j, (key, name) in enumerate(MOMENTUM_FORMS):
        cells = [r.get(key) if isinstance(r.get(key), dict) else {} for r in rows]
        ax.bar([i + j * width for i in range(len(rows))], [c.get("mean") or 0 for c in cells], width,
               yerr=[c.get("sd") or 0 for c in cells], label=name, capsize=3)
    ax.set_xticks([i + width * (len(MOMENTUM_FORMS) - 1) / 2 for i in range(len(rows))], labels)
    lows = [c["mean"] for r in rows for k, _ in MOMENTUM_FORMS
            if isinstance(r.get(k), dict) and _num(r[k].get("mean")) for c in (r[k],)]
    if lows:
        ax.set_ylim(max(0.0, min(lows) - 0.05), min(1.0, max(lows) + 0.03))
    ax.set(ylabel="final test accuracy")
    ax.legend(fontsize=7)


def _draw_balance(ax, modes, bal):
    vals = [bal.get(k) if _num(bal.get(k)) else 0 for _, _, k in modes]
    ax.barh([label for label, _, _ in modes], vals)
    ax.set(xlabel="images/s")


def _draw_overlap(ax, rows):
    def exposed(m):
        if _num(m.get("exposed_comm_ms_per_step")):
            return m["exposed_comm_ms_per_step"] * (m.get("steps_per_exchange") or 1)
        return m.get("exposed_overhead_ms", m.get("round_overhead_ms"))

    def compute(m):
        if _num(m.get("compute_ms_per_step")):
            return m["compute_ms_per_step"] * (m.get("steps_per_exchange") or 1)
        return m.get("round_compute_ms")

    labels = [label for label, _, _ in rows]
    y = range(len(rows))
    ax.barh([i - 0.2 for i in y], [compute(m) or 0 for _, m, _ in rows], height=0.4, label="compute")
    ax.barh([i + 0.2 for i in y], [exposed(m) or 0 for _, m, _ in rows], height=0.4, label="exposed communication")
    ax.set_yticks(list(y), labels, fontsize=7)
    ax.set_xscale("log")
    ax.set(xlabel="ms per exchange")
    ax.legend(fontsize=7)


# ---- the document and the CLI ------------------------------------------------------------------

def results_label(results_dir: str) -> str:
    """``results_dir`` relative to the repository root when inside it, else as given."""
    rel = os.path.relpath(os.path.abspath(results_dir), ROOT)
    return results_dir if rel == os.pardir or rel.startswith(os.pardir + os.sep) else rel


def render(results_dir: str, figures_dir: str | None = None, *, doc: str | None = None,
           readme: str | None = None) -> dict:
    """{"benchmarks": BENCHMARKS.md's text, and per README block its text: "headline" (the block
    between the unnamed markers) and each name of ``BLOCKS``}.

    Figures are linked at ``results_dir/figures/`` relative to ``doc`` (default: the repository's
    BENCHMARKS.md), and the headline links ``doc`` relative to ``readme`` (default: the repository's
    README.md); with ``figures_dir`` the PNGs are also drawn there."""
    doc = os.path.abspath(doc or os.path.join(ROOT, "BENCHMARKS.md"))
    link_dir = os.path.relpath(os.path.join(os.path.abspath(results_dir), "figures"), os.path.dirname(doc))
    if figures_dir:
        os.makedirs(figures_dir, exist_ok=True)

    def fig(name, title, draw, *data):
        if figures_dir:
            _plot(os.path.join(figures_dir, name), draw, *data)
        return f"![{title}]({link_dir}/{name})"

    d, refused = load_results(results_dir)
    every = [t for ts in tg.of_folder(d).values() for t in ts]
    top = ["# sparkcnn benchmarks", "", summary_line(every) + " (each shown in its section below).", "", f"<!-- results: {results_label(results_dir)} -->", "",
           "Generated by `python bench/run_all.py` from the JSON each benchmark printed; do not edit by hand "
           "(re-render with `python bench/render.py RESULTS_DIR`)."]
    if refused:
        top += ["", "**Refused, so not shown:** " + "; ".join(f"`{n}`: {why}" for n, why in refused) + "."]
    elif fresh.read_manifest(results_dir) is None:
        top += ["", f"This folder has no `{fresh.MANIFEST}` (older runs wrote none): its files are shown as found, "
                "and `python bench/render.py --check-fresh` fails on it."]
    if _get(d["run_all"], "quick") is True:
        top += ["", "**This is a quick run (`--quick`): short forms of every benchmark, whose figures are not the "
                "published ones.**"]
    docs_dir = os.path.relpath(os.path.join(ROOT, "docs"), os.path.dirname(doc))
    from bench.render_cifar import (cifar_headline, cifar_links_section,  # they borrow this module's helpers
                                    cifar_seed_section)

    sections = [seed_table(d["accuracy"], fig), cifar_seed_section(d["accuracy-cifar10"]),
                cifar_links_section(d["links-cifar10"]),
                momentum_section(d["momentum"], fig),
                reference_table(d["accuracy"], d["throughput"]),
                throughput_table(d["throughput"]), cifar_table(d["cifar"]),
                scale_section(d["scale"], d["costmodel"], fig), links_section(d["links"], fig),
                linkmodel_section(d["linkmodel"]), psload_section(d["psload"]),
                shardmodel_section(d["shardmodel"], d["psload"]), servermodel_section(d["servermodel"]),
                balance_section(d["balance"], d["throughput"], fig),
                jobcost_table(d["jobcost"]), run_table(d["run_all"], d), method_section(docs_dir)]
    readme_dir = os.path.dirname(os.path.abspath(readme or os.path.join(ROOT, "README.md")))
    servers_dir = servers_results_of(_read(readme)) if readme else None
    servers = (d["psload"], "psload", d["servermodel"])
    if servers_dir:
        servers = (_load(os.path.join(ROOT, servers_dir), "psload"), f"{servers_dir}/psload",
                   _load(os.path.join(ROOT, servers_dir), "servermodel"))
    return {"benchmarks": "\n\n".join(["\n".join(top), *sections]) + "\n",
            "headline": headline(d["accuracy"], d["throughput"], os.path.relpath(doc, readme_dir), d["momentum"],
                                 summary_line(every), cifar_headline(d["accuracy-cifar10"], d["links-cifar10"])),
            "glance": glance_block(d["accuracy"]),
            "transports": transports_block(d["throughput"], d["jobcost"]), "servers": servers_block(*servers)}


# README block name -> render()'s key; "" is the headline between the unnamed markers
BLOCKS = {"": "headline", "glance": "glance", "transports": "transports", "servers": "servers"}
# The README's servers block shows the psload.json of RESULTS_DIR, or of the folder a README line
# ``<!-- results servers: DIR -->`` names (relative to the repository): a run of ``bench/psload.py
# --servers`` of its own, until a full run measures K server processes.
SERVERS_RESULTS = re.compile(r"^<!-- results servers: (.+?) -->$", re.M)


def servers_results_of(readme_text: str) -> str | None:
    """The results folder the README's servers block is rendered from, when it names one."""
    m = SERVERS_RESULTS.search(readme_text)
    return m.group(1).strip() if m else None


def readme_blocks(text: str) -> tuple[list[tuple[str, int, int]], str | None]:
    """([(name, begin line, end line)], None) for the README's marker pairs, in order, or
    ([], why) when they are unusable: an unknown name, a block twice, a begin without its end or
    an end without its begin, or no headline block."""
    found, open_ = [], None
    for i, line in enumerate(text.splitlines()):
        m = MARKER.match(line.strip())
        if not m:
            continue
        kind, name = m[1], m[2] or ""
        label = f"'<!-- benchmarks:{kind}{' ' + name if name else ''} -->'"
        if name not in BLOCKS:
            return [], f"{label}: unknown block (known: {', '.join(repr(n) for n in BLOCKS if n)} and the headline)"
        if kind == "begin":
            if open_ is not None:
                return [], f"{label} inside the block begun at line {open_[1] + 1}"
            if any(n == name for n, _, _ in found):
                return [], f"{label}: the block appears twice"
            open_ = (name, i)
        elif open_ is None or open_[0] != name:
            return [], f"{label} without its begin line"
        else:
            found.append((name, open_[1], i))
            open_ = None
    if open_ is not None:
        return [], f"the block begun at line {open_[1] + 1} has no end line"
    if not any(n == "" for n, _, _ in found):
        return [], f"no '{BEGIN}' ... '{END}' block to replace"
    return found, None


def replace_blocks(text: str, rendered: dict) -> str:
    """``text`` with the lines between every marker pair replaced by its rendered block (the
    marker lines kept); ``readme_blocks(text)`` must have found them usable."""
    blocks, why = readme_blocks(text)
    assert why is None, why
    lines = text.splitlines(keepends=True)
    out, at = [], 0
    for name, b, e in blocks:
        out += lines[at:b + 1] + [rendered[BLOCKS[name]]]
        at = e
    return "".join(out + lines[at:])


# A measured figure written by hand: a number with a unit of time, speed or size, a ratio or a
# share, a decimal of three digits or more, or a two-digit decimal next to "accuracy". Outside the
# rendered blocks the README may hold none.
FIGURE = re.compile(
    r"(?<![\w.])~?\d[\d,]*(?:\.\d+)?\s?(?:ms|s|sec|seconds?|min|minutes?|hours?|images/s|img/s"
    r"|[kKMGT]i?B|%|x|×)(?![\w/])"
    r"|(?<![\w.])0\.[1-9]\d{2,}(?![\d.])"
    r"|(?<![\w.])0\.\d\d(?![\d.])\s+(?:\w+\s+){0,2}accuracy|accuracy\s+(?:of\s+)?0\.\d\d(?![\d.])")
# Settings, not measurements, that the patterns would take for one; each with its reason.
SETTING_PHRASES = (
    "8 × parameters + 1 MiB",  # engine.max_message_bytes' default when 0 (sparkcnn/config_sections.py)
)


def hand_figures(text: str) -> list[str]:
    """Measured figures outside the rendered blocks of a README, one line each ("line N: ...")."""
    lines = text.splitlines()
    blocks, _ = readme_blocks(text)
    inside = {i for _, b, e in blocks for i in range(b, e + 1)}
    found = []
    for i, line in enumerate(lines):
        if i in inside:
            continue
        for phrase in SETTING_PHRASES:
            line = line.replace(phrase, "")
        found += [f"line {i + 1}: {m.group(0)!r} in {lines[i].strip()[:100]!r}" for m in FIGURE.finditer(line)]
    return found


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except FileNotFoundError:
        return ""


def check_fresh(doc: str, results_dir: str | None = None) -> int:
    """0 when every result behind ``doc`` (the folder its results line names, or ``results_dir``)
    is fresh (``bench/fresh.py``); 1, one line per stale result, otherwise; 2 when there is nothing to judge."""
    named = results_dir or fresh.results_dir_of(_read(doc))
    if named is None:
        print(f"bench/render.py: {doc}: no '<!-- results: DIR -->' line naming its results", file=sys.stderr)
        return 2
    folder = named if os.path.isabs(named) else os.path.join(ROOT, named)
    if not os.path.isdir(folder):
        print(f"bench/render.py: {named}: no such folder of benchmark JSON", file=sys.stderr)
        return 2
    stale, checked = fresh.stale(folder)
    if not checked:
        print(f"bench/render.py: {named}: no benchmark JSON to judge", file=sys.stderr)
        return 2
    for line in stale:
        print(f"stale: {named}/{line}")
    print(f"{checked - len(stale)} of {checked} results in {named} are fresh")
    return 1 if stale else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results_dir", nargs="?", help="a folder of <benchmark>.json (bench/run_all.py's --out)")
    ap.add_argument("--out", default=os.path.join(ROOT, "BENCHMARKS.md"), help="the document to write or check")
    ap.add_argument("--readme", help="a README whose benchmarks:begin/end blocks get the headline and figures")
    ap.add_argument("--check", action="store_true", help="write nothing; diff against the files, exit 1 if they differ")
    ap.add_argument("--check-fresh", action="store_true",
                    help="write nothing; exit 1 if a result of the folder --out names (or RESULTS_DIR) was run "
                         "from code, config or versions that changed since, or is off its manifest (bench/fresh.py)")
    a = ap.parse_args(argv)
    if a.check_fresh:
        return check_fresh(a.out, a.results_dir)
    if a.results_dir is None:
        ap.error("RESULTS_DIR is required (but with --check-fresh)")
    if not os.path.isdir(a.results_dir) or not any(n.endswith(".json") for n in os.listdir(a.results_dir)):
        print(f"bench/render.py: {a.results_dir}: no such folder of benchmark JSON", file=sys.stderr)
        return 2
    readme_text = _read(a.readme) if a.readme else None
    why = readme_blocks(readme_text)[1] if a.readme else None
    if why:
        print(f"bench/render.py: {a.readme}: {why}", file=sys.stderr)
        return 2
    figures = None if a.check else os.path.join(a.results_dir, "figures")
    text = render(a.results_dir, figures, doc=a.out, readme=a.readme)
    files = [(a.out, _read(a.out) if a.check else None, text["benchmarks"])]
    if a.readme:
        files.append((a.readme, readme_text, replace_blocks(readme_text, text)))
    if a.check:
        diff = [ln for path, old, new in files
                for ln in difflib.unified_diff(old.splitlines(True), new.splitlines(True), path, f"{path} (rendered)")]
        sys.stdout.writelines(ln if ln.endswith("\n") else ln + "\n" for ln in diff)
        hand = hand_figures(readme_text) if a.readme else []
        for line in hand:
            print(f"{a.readme}: a figure outside the rendered block, {line}")
        return 1 if diff or hand else 0
    for path, _, new in files:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
