"""The convergence matrix: every setting the streaming transport accepts converges, or is refused.

Trains ``fmnist_cnn`` on 2 blocks (local[2]) for ``--epochs`` (2) epochs per cell,
every cell with the same seed (``run.seed`` 42), in this process through
bench/accuracy.py's ``run_variant`` (conf/fashion_mnist.yaml's settings: lr 0.05
with a 0.3-epoch warm-up and cosine decay, momentum 0.9, batch 64), and prints
one JSON object: the cells, the refused settings, the checks and ``passed``.

Cells (``CELLS``): the jobs transport's references at H = 10, ``jobs-async-h10``
(jobs sized by ``scheduler.target_job_seconds`` = 0.5 s, about 10 steps here: the
async scheduler has no fixed H, so each cell records ``mean_steps_per_exchange``,
what its jobs carried) and ``jobs-sync-h10``; the stream, async and sync, at
H = 1 and 10 (the stream's lookahead acts at H = 1, always: a switch for it
went, see ``refused``). Each is ``-dense`` (``compression.method=none``) or
``-sparse``: bench/accuracy.py's uplink (density 0.001, only biases dense) with
its density warm-up over the first epoch, and downlink density 0.01; at H = 1
with accuracy.py's per-step additions (DGC gradient clipping 2.0, no factor
masking).

Each cell records its settings (and the same run as a ``sparkcnn train``
command), test accuracy per epoch and final, wall seconds, images/s, bytes up
and down, ``stale_dropped``, ``rejected_deltas``, ``loss_spikes``, exchanges,
steps and staleness per exchange, and its verdict: ``reference`` (its jobs
cell: same mode, same dense/sparse), ``delta_points`` (100 x (accuracy -
reference's)) and ``passed``.

Gate: a stream cell passes when its accuracy is at most ``--tolerance`` (0.02, 2
points) below its reference's; one 2-3 points below (``--rerun-within`` 0.03) is
trained once more with ``run.seed`` 43 and judged on the mean of the two. A
stream cell above its reference passes: at 2 epochs H = 1 may well beat H = 10,
and the gate is about convergence. A reference passes when it finished.

``refused`` (``REFUSED``): each setting the stream no longer accepts, run with
the CLI (``python -m sparkcnn train --config conf/fashion_mnist.yaml ...``) on top
of a stream cell's settings: ``ps.staleness=none`` with the async stream at
H = 10, and the removed ``engine.stream_lookahead`` (without the lookahead the
stream at H = 1 trained 2-9 points below the jobs transport in earlier runs of
this matrix) and ``engine.stream_downlink``. Each must exit 2 with one
line on stderr that names it.

The first cell's wall and images/s include Spark's start-up (``first_run``).

Size: the full training set (60 000 rows, 10 000 test) by default, what the
committed result uses; 14 cells of about 70 s each on an otherwise idle 2-core
machine (2 epochs at 2000-3000 images/s, evaluation and start-up), about 17
minutes, 20-25 with reruns. ``--train-rows``/``--test-rows`` train on the first
rows instead (``slice_data``); the JSON's ``data`` says what was used.
``--quick``: 1 epoch, 12 000/2 000 rows, three cells (jobs-async-h10-dense and
the dense async stream at H = 1 and 10), the refusals: one to two minutes, most of it
Spark's start-up.
``--cells a,b`` runs a subset (the references they need are added).

Exit status: 0 when every cell finished and every gate holds, 1 otherwise (the
JSON is printed either way), 2 on bad arguments.

    python bench/convergence.py [--quick] [--cells NAME,...] [--epochs N] [--train-rows N --test-rows N]
                                [--tolerance 0.02] [--rerun-within 0.03] [--set KEY=VALUE ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import ROOT, emit, ensure_data, log, portable_path, slice_data  # noqa: E402
from bench.accuracy import ASYNC, BIDIR, SPARSE, STREAM, STREAM_SPARSE, run_variant  # noqa: E402

SEED, SECOND_SEED = 42, 43
H_REF = 10  # the jobs references' steps per exchange
TOLERANCE, RERUN_WITHIN = 0.02, 0.03  # test accuracy below the reference: pass / train a second seed
QUICK_CELLS = ("jobs-async-h10-dense", "stream-async-h1-dense", "stream-async-h10-dense")
QUICK_ROWS = (12000, 2000)
CONFIG = "conf/fashion_mnist.yaml"  # what run_variant's defaults equal (the run name aside)

# accuracy.py's uplink and downlink, the density warm-up over the first epoch (of 2) instead of 3
SPARSE_CELL = [*(o for o in SPARSE if not o.startswith("compression.warmup_epochs=")), "compression.warmup_epochs=1",
               *BIDIR]
# accuracy.py's per-step (H = 1) sparse additions: DGC gradient clipping, no factor masking
PER_STEP_SPARSE = [o for o in STREAM_SPARSE if o not in STREAM and o not in SPARSE]


@dataclasses.dataclass(frozen=True)
class Cell:
    transport: str  # jobs | stream
    mode: str       # async | sync
    steps: int      # H: train.steps_per_round
    sparse: bool

    @property
    def name(self) -> str:
        return f"{self.transport}-{self.mode}-h{self.steps}-{'sparse' if self.sparse else 'dense'}"

    @property
    def reference(self) -> str | None:
        """The jobs cell a stream cell is judged against: same mode, same dense/sparse, H = 10."""
        if self.transport == "jobs":
            return None
        return Cell("jobs", self.mode, H_REF, self.sparse).name

    def overrides(self) -> list[str]:
        out = [f"engine.transport={self.transport}", f"engine.mode={self.mode}",
               f"train.steps_per_round={self.steps}"]
        if self.transport == "jobs" and self.mode == "async":
            out += [o for o in ASYNC if o not in out]  # jobs sized to ~0.5 s: about 10 steps here
        if self.sparse:
            out += SPARSE_CELL
            if self.steps == 1:
                out += PER_STEP_SPARSE
        return out


CELLS = {c.name: c for c in (
    *(Cell("jobs", m, H_REF, s) for m in ("async", "sync") for s in (False, True)),
    *(Cell("stream", m, h, s) for m in ("async", "sync") for h in (1, 10) for s in (False, True)),
)}


@dataclasses.dataclass(frozen=True)
class Refusal:
    setting: str   # the override the stream refuses
    cell: str      # on top of this cell's settings
    expect: str    # what the one line on stderr must hold
    why: str


REFUSED = (
    Refusal("ps.staleness=none", "stream-async-h10-dense", "ps.staleness=none diverges on the async stream",
            "lambda = 1 at H > 1 on the async stream diverged: refused at config time"),
    Refusal("engine.stream_lookahead=false", "stream-async-h1-dense",
            "unknown config key 'engine.stream_lookahead'",
            "without the lookahead the stream at H = 1 trained 2-9 points below the jobs transport (async: "
            "dense 0.835 vs 0.873, sparse 0.810 vs 0.843; sync: dense 0.792 vs 0.876, sparse 0.838 vs 0.859): "
            "the switch was removed, the key is unknown"),
    Refusal("engine.stream_downlink=round", "stream-async-h1-dense",
            "unknown config key 'engine.stream_downlink'",
            "the per-round downlink was removed: the key is unknown"),
)


# ---- pure gate logic (tests/bench/test_convergence.py) ----

def verdict(accuracies: list[float | None], reference: float | None, tolerance: float = TOLERANCE,
            rerun_within: float = RERUN_WITHIN) -> dict:
    """A stream cell against its reference: ``passed`` when the mean of its accuracies is at most
    ``tolerance`` below the reference's (rounded to 1e-9: 0.9115 - 0.8915 is 0.02); ``rerun`` when
    it has one accuracy and falls short by more than ``tolerance`` but at most ``rerun_within``."""
    if reference is None or not accuracies or any(a is None for a in accuracies):
        return {"judged_accuracy": None, "delta_points": None, "passed": False, "rerun": False}
    mean = statistics.fmean(accuracies)
    short = round(reference - mean, 9)
    return {"judged_accuracy": mean, "delta_points": round(100 * (mean - reference), 6),
            "passed": short <= tolerance,
            "rerun": len(accuracies) == 1 and tolerance < short <= rerun_within}


def cli_command(overrides: list[str]) -> list[str]:
    out = ["sparkcnn", "train", "--config", CONFIG, "--no-progress"]
    for o in overrides:
        out += ["--set", o]
    return out


# ---- runs ----

def _rounds_stats(run_dir: str) -> dict:
    from sparkcnn.metrics import read_jsonl

    rounds = [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if r["kind"] == "round"]
    steps = [r["steps"] for r in rounds]
    tau = [r["staleness"] for r in rounds if r.get("staleness") is not None]
    return {"exchanges": len(rounds),
            "mean_steps_per_exchange": statistics.fmean(steps) if steps else None,
            "min_steps_per_exchange": min(steps, default=None), "max_steps_per_exchange": max(steps, default=None),
            "mean_staleness": statistics.fmean(tau) if tau else None,
            "observed_max_staleness": max(tau, default=None)}


_runs_started = 0


def run_cell(data: str, cell: Cell, seed: int, epochs: int, out_dir: str, extra: list[str]) -> dict:
    """One training of ``cell`` with ``seed``; ``error`` instead of the results when it failed.
    ``first_run``: the process's first, whose wall and images/s include Spark's start-up (or its
    Python workers' and their TF import)."""
    global _runs_started
    _runs_started += 1
    overrides = [*cell.overrides(), f"run.seed={seed}", *extra]
    os.makedirs(out_dir, exist_ok=True)
    cell_dir = tempfile.mkdtemp(prefix=f"{cell.name}-s{seed}-", dir=out_dir)  # its one run directory
    rec = {"seed": seed, "overrides": overrides, "first_run": _runs_started == 1,
           "command": shlex.join(cli_command([f"data.path={portable_path(data)}", f"run.name={cell.name}",
                                              f"train.epochs={epochs}", *overrides]))}
    log("%s seed %d: %d epochs", cell.name, seed, epochs)
    t0 = time.perf_counter()
    try:
        r = run_variant(data, cell.name, overrides, epochs, cell_dir)
        [summary_path] = glob.glob(os.path.join(cell_dir, "*", "summary.json"))
        with open(summary_path, encoding="utf-8") as fh:
            s = json.load(fh)
        rec.update({k: r.get(k) for k in ("test_accuracy", "accuracy_per_epoch", "wall_s", "train_wall_s",
                                          "images_per_s", "bytes_up", "bytes_down", "dense_bytes_up",
                                          "steady_uplink_ratio", "steady_downlink_ratio", "state_resets",
                                          "replica_resyncs", "exposed_comm_ms_per_step", "time_to_0_88_s")})
        rec.update({k: s.get(k) for k in ("stale_dropped", "rejected_deltas", "loss_spikes", "duplicates_dropped")})
        rec.update(_rounds_stats(os.path.dirname(summary_path)))
        rec.update(config_sha256=r["config_sha256"], config=r["config"])
        log("%s seed %d: accuracy %s in %.0f s", cell.name, seed, rec["test_accuracy"], rec["wall_s"])
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the cell fails, the matrix goes on
        rec.update(error=f"{type(e).__name__}: {e}", wall_s=time.perf_counter() - t0)
        log("%s seed %d: FAILED %s", cell.name, seed, rec["error"])
    return rec


def refused(r: Refusal, epochs: int, timeout: float = 300) -> dict:
    """The CLI with a refused setting: its exit code and the one line it prints on stderr."""
    overrides = [*CELLS[r.cell].overrides(), f"train.epochs={epochs}", r.setting]
    argv = cli_command(overrides)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               TF_CPP_MIN_LOG_LEVEL="2")
    rec = {"setting": r.setting, "on_cell": r.cell, "why": r.why, "command": shlex.join(argv), "expect": r.expect}
    try:
        p = subprocess.run([sys.executable, "-m", "sparkcnn", *argv[1:]], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=timeout, check=False)
        lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
        rec.update(exit_code=p.returncode, stderr=lines[-1] if lines else "", stderr_lines=len(lines))
    except subprocess.TimeoutExpired:
        rec.update(exit_code="timeout", stderr="", stderr_lines=0)
    rec["passed"] = rec["exit_code"] == 2 and rec["stderr_lines"] == 1 and r.expect in rec["stderr"]
    log("refused %s: exit %s: %s", r.setting, rec["exit_code"], rec["stderr"])
    return rec


def _cell_record(cell: Cell, runs: list[dict]) -> dict:
    first = runs[0]
    return {"name": cell.name, "transport": cell.transport, "mode": cell.mode, "steps_per_round": cell.steps,
            "compression": "sparse" if cell.sparse else "dense", "stream_lookahead": cell.transport == "stream" and cell.steps == 1,
            "settings": cell.overrides(), **{k: v for k, v in first.items() if k != "overrides"},
            "rerun": runs[1] if len(runs) > 1 else None, "reference": cell.reference}


def _selected(names: str | None, quick: bool, ap: argparse.ArgumentParser) -> list[Cell]:
    wanted = list(filter(None, names.split(","))) if names else list(QUICK_CELLS if quick else CELLS)
    unknown = [n for n in wanted if n not in CELLS]
    if unknown or not wanted:
        ap.error(f"--cells: unknown {', '.join(unknown) or '(none given)'} (known: {', '.join(CELLS)})")
    refs = {CELLS[n].reference for n in wanted} - {None} - set(wanted)
    if refs:
        log("adding the references %s", ", ".join(sorted(refs)))
    return [c for n, c in CELLS.items() if n in set(wanted) | refs]  # references first, in CELLS' order


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"1 epoch, {QUICK_ROWS[0]}/{QUICK_ROWS[1]} rows, cells {', '.join(QUICK_CELLS)}")
    ap.add_argument("--cells", help=f"comma-separated subset of: {', '.join(CELLS)}")
    ap.add_argument("--epochs", type=int, help="epochs per cell (default 2, --quick 1)")
    ap.add_argument("--train-rows", type=int, help="train on the first rows of the training set (default: all)")
    ap.add_argument("--test-rows", type=int, help="evaluate on the first rows of the test set (default: all)")
    ap.add_argument("--data", help="a prepared dataset instead of Fashion-MNIST (tests)")
    ap.add_argument("--tolerance", type=float, default=TOLERANCE,
                    help="a stream cell passes at most this far below its reference's test accuracy")
    ap.add_argument("--rerun-within", type=float, default=RERUN_WITHIN,
                    help=f"a cell short by more than --tolerance and at most this is run again (run.seed "
                         f"{SECOND_SEED}) and judged on the mean")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every cell, after the cell's own (the committed result uses none)")
    ap.add_argument("--runs-dir", help="keep the run directories here (default: a temporary folder, removed)")
    ap.add_argument("--out", help="also write the JSON here")
    a = ap.parse_args(argv)
    epochs = a.epochs if a.epochs is not None else (1 if a.quick else 2)
    if epochs < 1 or (a.train_rows is not None and a.train_rows < 1) or (a.test_rows is not None and a.test_rows < 1):
        ap.error("--epochs, --train-rows and --test-rows must be >= 1")
    if not 0 <= a.tolerance <= a.rerun_within:
        ap.error("need 0 <= --tolerance <= --rerun-within")
    cells = _selected(a.cells, a.quick, ap)
    from sparkcnn import config
    from sparkcnn.errors import BadInput

    for c in cells:  # a cell the config refuses is a bad matrix, found before anything trains
        try:
            config.load(os.path.join(ROOT, CONFIG), [*c.overrides(), *a.set])
        except BadInput as e:
            ap.error(f"cell {c.name}: {e}")

    t_start = time.perf_counter()
    data = os.path.abspath(a.data) if a.data else ensure_data()
    rows = QUICK_ROWS if a.quick else (None, None)
    train_rows, test_rows = a.train_rows or rows[0], a.test_rows or rows[1]
    if train_rows or test_rows:
        data = slice_data(data, train_rows or 10**9, test_rows or 10**9)
    from sparkcnn.data.parquet_io import read_meta

    sizes = {split: read_meta(os.path.join(data, split)).num_rows for split in ("train", "test")}
    runs_dir = os.path.abspath(a.runs_dir) if a.runs_dir else tempfile.mkdtemp(prefix="sparkcnn-bench-conv-")
    records, refusals = {}, []
    try:
        for cell in cells:
            runs = [run_cell(data, cell, SEED, epochs, runs_dir, a.set)]
            ref_acc = records.get(cell.reference, {}).get("test_accuracy")
            v = verdict([runs[0].get("test_accuracy")], ref_acc, a.tolerance, a.rerun_within)
            if v["rerun"]:
                log("%s: %.2f points below %s, a second seed", cell.name, -v["delta_points"], cell.reference)
                runs.append(run_cell(data, cell, SECOND_SEED, epochs, runs_dir, a.set))
                v = verdict([r.get("test_accuracy") for r in runs], ref_acc, a.tolerance, a.rerun_within)
            rec = records[cell.name] = _cell_record(cell, runs)
            if cell.reference is None:
                rec.update(reference_accuracy=None, judged_accuracy=rec.get("test_accuracy"), delta_points=None,
                           passed=rec.get("test_accuracy") is not None)
            else:
                rec.update(reference_accuracy=ref_acc, judged_accuracy=v["judged_accuracy"],
                           delta_points=v["delta_points"], passed=v["passed"])
        refusals = [refused(r, epochs) for r in REFUSED]
    finally:
        if not a.runs_dir:
            shutil.rmtree(runs_dir, ignore_errors=True)

    checks = {}
    for rec in records.values():
        if rec["reference"] is None:
            checks[f"{rec['name']} finished"] = rec["passed"]
        else:
            seeds = "mean of 2 seeds " if rec["rerun"] else ""
            checks[f"{rec['name']} {seeds}at most {100 * a.tolerance:g} pt below {rec['reference']}"] = rec["passed"]
    for r in refusals:
        checks[f"{r['setting']} refused: exit 2, one line"] = r["passed"]
    out = {"bench": "convergence", "quick": a.quick, "model": "fmnist_cnn", "blocks": 2, "epochs": epochs,
           "seed": SEED, "second_seed": SECOND_SEED, "base_config": CONFIG, "extra_overrides": a.set,
           "data": {"path": portable_path(data), "train_rows": sizes["train"], "test_rows": sizes["test"],
                    "sliced": bool(train_rows or test_rows)},
           "gate": {"tolerance": a.tolerance, "rerun_within": a.rerun_within,
                    "rule": "a stream cell passes when its test accuracy (the mean of two seeds when the first "
                            "fell short by more than tolerance, at most rerun_within) is at most tolerance below "
                            "its jobs reference's (same mode and compression, H = 10); a reference when it "
                            "finished"},
           "cells": list(records.values()), "refused": refusals, "checks": checks,
           "passed": bool(checks) and all(checks.values()), "wall_s": time.perf_counter() - t_start}
    emit(out, a.out)
    log("convergence: %s in %.0f s", "passed" if out["passed"] else "FAILED", out["wall_s"])
    return 0 if out["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
