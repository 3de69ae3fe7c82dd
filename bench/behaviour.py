"""Same behaviour before and after a change: two checkouts trained side by side, interleaved.

Trains each variant with the CLI of two checkouts of this repository, each
importing its own ``sparkcnn`` (driver and Spark workers, checked by a probe),
on one prepared Fashion-MNIST dataset, and prints one JSON object with both
results and their comparison:

- ``test_accuracy``: ``|head - base|`` at most max(0.3 points, 2 sample standard deviations of
  the base's repetitions);
- ``images_per_s``: ``head / base`` within 10 % of 1;
- ``sync-deterministic`` (``run.deterministic=true``, sync, dense): the final
  weights allclose, ``|head - base| <= 1e-6 * |base|`` per entry (``atol = 0``).
  Bitwise equality is reported but not required: a change of summation order
  moves the last bits.

Variants: ``sync-dense`` (conf/fashion_mnist.yaml as is), ``sync-sparse`` and
``async-sparse`` (bench/accuracy.py's sparse uplink settings), ``--epochs``
each (3); ``sync-deterministic`` ``--deterministic-epochs`` (1). For each
variant both checkouts run one after the other, base first for one variant and
head first for the next, so slow drift of a shared machine spreads over both.

``--base REV`` (default: the last commit before the engine refactor) and
``--head REV`` go into temporary ``git worktree``s, removed at the end;
without ``--head`` the head is this repository's working tree as it is
(its commit, whether it is dirty, and a digest of its changes are recorded at
the start and the end).

Exit status: 0 when every run finished and every comparison is within its
tolerance; 1 otherwise (the JSON is printed either way); 2 on bad arguments.

    python bench/behaviour.py [--base REV] [--head REV] [--quick] [--epochs N] [--repeats N] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import glob
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import ROOT, emit, log, portable_path  # noqa: E402

BASE_REV = "8419361"  # the last commit before the engine refactor
FMNIST_SRC = "/usr/share/datasets/fashion-mnist"  # the Debian package dataset-fashion-mnist
ACCURACY_POINTS = 0.3    # |head - base| test accuracy, in percentage points
RATE_FRACTION = 0.10     # |head / base - 1| of images/s
WEIGHTS_RTOL = 1e-6      # np.allclose(head, base, rtol, atol=0) of the final weights

# bench/accuracy.py's sync-sparse uplink: density 0.001 after an exponential warm-up from 0.25 over
# 3 epochs, only biases dense, H = 10; async jobs sized to ~0.5 s (about 10 steps, as in sync).
# Written out here so that both checkouts get exactly these overrides whatever bench/ holds.
SPARSE = ["train.steps_per_round=10", "compression.method=threshold", "compression.density=0.001",
          "compression.initial_density=0.25", "compression.warmup_epochs=3", "compression.dense_below=1000"]
ASYNC = ["engine.mode=async", "scheduler.target_job_seconds=0.5"]
# the streaming transport as bench/accuracy.py's GS-ASGD rows run it: uplink 0.001 with DGC momentum
# correction (no factor masking, clipped), one step per exchange async, or ten per exchange sync
STREAM_SPARSE = ["engine.transport=stream", *SPARSE[1:], "compression.clip_norm=2.0",
                 "compression.factor_masking=false"]

# the CLI of whichever sparkcnn is first on sys.path (some checkouts have no __main__)
CLI = "import sys; from sparkcnn.cli import main; sys.exit(main())"

# where a checkout's sparkcnn comes from, in the driver and in a Spark Python worker
PROBE = r"""
import json, os, sys
import sparkcnn
from pyspark.sql import SparkSession
spark = (SparkSession.builder.master("local[1]").appName("sparkcnn behaviour probe")
         .config("spark.pyspark.python", sys.executable)
         .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1")
         .config("spark.ui.showConsoleProgress", "false").getOrCreate())
def where(_):
    import sparkcnn
    return sparkcnn.__file__
worker = spark.sparkContext.parallelize([0], 1).map(where).collect()[0]
spark.stop()
print(json.dumps({"driver": sparkcnn.__file__, "worker": worker}))
"""


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    overrides: tuple[str, ...]  # --set overrides on top of conf/fashion_mnist.yaml
    deterministic: bool = False  # 1 epoch by default; compared by final weights, not accuracy and rate


VARIANTS = (
    Variant("sync-dense", ()),
    Variant("sync-sparse", tuple(SPARSE)),
    Variant("async-sparse", tuple(ASYNC + SPARSE)),
    Variant("sync-deterministic", ("run.deterministic=true",), deterministic=True),
    Variant("stream-async-h1-sparse", tuple(STREAM_SPARSE + ["engine.mode=async", "train.steps_per_round=1"])),
    Variant("stream-sync-h10-sparse", tuple(STREAM_SPARSE + ["engine.mode=sync", "train.steps_per_round=10"])),
)


# ---- pure report logic (tests/bench/test_bench_behaviour.py) ----

def order_for(variant_index: int, repeat: int) -> tuple[str, str]:
    """Which checkout trains first: base for even ``variant_index + repeat``, head for odd."""
    return ("base", "head") if (variant_index + repeat) % 2 == 0 else ("head", "base")


def aggregate(runs: list[dict]) -> dict:
    """Mean test accuracy (with its sample standard deviation) and median images/s of the finished
    runs of one checkout."""
    ok = [r for r in runs if r.get("exit_code") == 0 and r.get("test_accuracy") is not None]
    accs = [r["test_accuracy"] for r in ok]
    return {"test_accuracy": statistics.fmean(accs) if ok else None,
            "test_accuracy_sd": statistics.stdev(accs) if len(accs) > 1 else None,
            "images_per_s": statistics.median(r["images_per_s"] for r in ok) if ok else None,
            "finished": len(ok), "runs": len(runs)}


def compare_accuracy(base: float | None, head: float | None, max_points: float = ACCURACY_POINTS,
                     base_sd: float | None = None) -> dict:
    """``ok``: ``|head - base| * 100 <= max(max_points, 2 * base_sd * 100)`` (rounded to 1e-9 points:
    30 of 10 000 is 0.3): a change within the base's own spread over its repetitions is no change."""
    bound = max(max_points, round(2 * base_sd * 100, 9)) if base_sd is not None else max_points
    if base is None or head is None:
        return {"base": base, "head": head, "diff_points": None, "max_points": bound, "ok": False}
    diff = round(abs(head - base) * 100, 9)
    return {"base": base, "head": head, "diff_points": diff, "max_points": bound, "ok": diff <= bound}


def compare_rate(base: float | None, head: float | None, fraction: float = RATE_FRACTION) -> dict:
    """``ratio = head / base``; ``within_10pct``: ``|ratio - 1| <= fraction``."""
    ratio = head / base if base and head is not None else None
    return {"base": base, "head": head, "ratio": ratio, "fraction": fraction,
            "within_10pct": ratio is not None and round(abs(ratio - 1), 9) <= fraction}


def compare_weights(base: list, head: list, rtol: float = WEIGHTS_RTOL) -> dict:
    """Final weights, tensor by tensor: ``allclose`` is ``|head - base| <= rtol * |base|`` everywhere.

    ``max_rel_diff`` = max ``|head - base| / |base|`` (inf where base is 0 and head is not)."""
    if len(base) != len(head) or any(np.shape(b) != np.shape(h) for b, h in zip(base, head)):
        return {"allclose": False, "bitwise_equal": False, "max_rel_diff": None, "max_abs_diff": None,
                "rtol": rtol, "error": f"shapes differ: base {[np.shape(b) for b in base]}, "
                                      f"head {[np.shape(h) for h in head]}"}
    allclose, bitwise, max_rel, max_abs = True, True, 0.0, 0.0
    for b, h in zip(base, head):
        b, h = np.asarray(b, dtype=np.float64), np.asarray(h, dtype=np.float64)
        diff = np.abs(h - b)
        allclose &= bool(np.allclose(h, b, rtol=rtol, atol=0.0))
        bitwise &= bool(np.array_equal(h, b))
        if diff.size:
            with np.errstate(divide="ignore", invalid="ignore"):
                rel = np.where(diff == 0, 0.0, diff / np.abs(b))
            max_rel, max_abs = max(max_rel, float(rel.max())), max(max_abs, float(diff.max()))
    return {"allclose": allclose, "bitwise_equal": bitwise, "max_rel_diff": max_rel,
            "max_abs_diff": max_abs, "rtol": rtol, "tensors": len(base)}


def compare_variant(deterministic: bool, base: dict, head: dict, weights: dict | None = None) -> dict:
    """The comparison of one variant's aggregates; ``passed`` applies the variant's own checks:
    accuracy and images/s, or for the deterministic variant the weights."""
    out = {"accuracy": compare_accuracy(base["test_accuracy"], head["test_accuracy"],
                                        base_sd=base.get("test_accuracy_sd")),
           "images_per_s": compare_rate(base["images_per_s"], head["images_per_s"])}
    if deterministic:
        out["weights"] = weights or {"allclose": False, "error": "no weights compared"}
        out["passed"] = bool(out["weights"].get("allclose"))
    else:
        out["passed"] = out["accuracy"]["ok"] and out["images_per_s"]["within_10pct"]
    return out


def summary_line(name: str, cmp: dict) -> str:
    """One line per variant: both numbers, the difference and the verdict."""
    a, r = cmp["accuracy"], cmp["images_per_s"]

    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    line = (f"{name}: accuracy base {num(a['base'], '.4f')} head {num(a['head'], '.4f')} "
            f"diff {num(a['diff_points'], '.2f')} pt; images/s base {num(r['base'], '.0f')} "
            f"head {num(r['head'], '.0f')} ratio {num(r['ratio'], '.3f')}")
    if "weights" in cmp:
        w = cmp["weights"]
        line += (f"; weights allclose {w.get('allclose')} bitwise {w.get('bitwise_equal')} "
                 f"max_rel_diff {num(w.get('max_rel_diff'), '.3g')}")
    return line + (" -> ok" if cmp["passed"] else " -> FAIL")


def json_safe(obj):
    """``obj`` with non-finite floats as strings ("inf"): strict JSON has no Infinity or NaN."""
    if isinstance(obj, float) and not np.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


# ---- checkouts, runs, provenance ----

def _git(*args: str, cwd: str = ROOT) -> str:
    p = subprocess.run(["git", "--no-optional-locks", *args], cwd=cwd, capture_output=True, text=True,
                       check=False)
    if p.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {(p.stderr.strip().splitlines() or ['failed'])[-1]}")
    return p.stdout.strip()


def _tree_digest(root: str) -> str:
    """SHA-256 of the working tree's changes against HEAD, untracked files included."""
    h = hashlib.sha256(subprocess.run(["git", "--no-optional-locks", "diff", "HEAD", "--binary"], cwd=root,
                                      check=True, capture_output=True).stdout)
    for path in sorted(_git("ls-files", "--others", "--exclude-standard", cwd=root).splitlines()):
        h.update(path.encode())
        try:
            with open(os.path.join(root, path), "rb") as fh:
                h.update(fh.read())
        except OSError:
            h.update(b"<unreadable>")
    return h.hexdigest()


def working_tree_state(root: str) -> dict:
    return {"commit": _git("rev-parse", "HEAD", cwd=root),
            "dirty": bool(_git("status", "--porcelain", cwd=root)), "changes_sha256": _tree_digest(root)}


def checkout_env(directory: str) -> dict:
    """This interpreter with ``directory`` first on sys.path, for the driver and Spark's workers."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [directory, os.environ.get("PYTHONPATH")])),
                PYSPARK_PYTHON=sys.executable, TF_CPP_MIN_LOG_LEVEL="2")


def probe(directory: str) -> dict:
    """Where the checkout's sparkcnn is imported from; ``own_code`` when driver and worker both use it."""
    p = subprocess.run([sys.executable, "-c", PROBE], cwd=directory, env=checkout_env(directory),
                       capture_output=True, text=True, timeout=600, check=False)
    if p.returncode != 0:
        return {"own_code": False, "error": p.stderr.strip().splitlines()[-3:]}
    where = json.loads(p.stdout.strip().splitlines()[-1])
    inside = [os.path.realpath(f).startswith(os.path.realpath(directory) + os.sep) for f in where.values()]
    return {"sparkcnn_driver": where["driver"], "sparkcnn_worker": where["worker"], "own_code": all(inside)}


def _tail(path: str, lines: int = 15) -> list[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read().splitlines()[-lines:]
    except OSError:
        return []


def train_once(directory: str, variant: Variant, epochs: int, data: str, out_dir: str, timeout: float) -> dict:
    """One ``sparkcnn train`` of ``variant`` with the checkout in ``directory``."""
    os.makedirs(out_dir, exist_ok=True)
    overrides = [f"data.path={data}", f"run.out_dir={out_dir}", f"run.name={variant.name}",
                 f"train.epochs={epochs}", *variant.overrides]
    argv = ["train", "--config", "conf/fashion_mnist.yaml", "--no-progress"]
    for o in overrides:
        argv += ["--set", o]
    rec = {"command": shlex.join(["sparkcnn", *argv]), "loadavg_before": os.getloadavg()[0]}
    t0 = time.perf_counter()
    with open(os.path.join(out_dir, "train.out"), "w") as out, open(os.path.join(out_dir, "train.err"), "w") as err:
        try:
            rec["exit_code"] = subprocess.run([sys.executable, "-c", CLI, *argv], cwd=directory, stdout=out,
                                              stderr=err, env=checkout_env(directory), timeout=timeout,
                                              check=False).returncode
        except subprocess.TimeoutExpired:
            rec["exit_code"] = "timeout"
    rec["wall_s"] = time.perf_counter() - t0
    rec["loadavg_after"] = os.getloadavg()[0]  # 1-minute load: above the core count, others share them
    found = glob.glob(os.path.join(out_dir, "*", "summary.json"))
    rec["summary"] = found[0] if len(found) == 1 else None
    if rec["exit_code"] == 0 and rec["summary"]:
        with open(rec["summary"]) as fh:
            s = json.load(fh)
        rec.update(test_accuracy=s.get("test_accuracy"), images_per_s=s.get("images_per_s"),
                   train_wall_s=s.get("wall_s"), rounds=s.get("rounds"),
                   model=os.path.join(os.path.dirname(rec["summary"]), "model.keras"))
    else:
        rec["exit_code"] = rec["exit_code"] if rec["exit_code"] != 0 else "no summary.json"
        rec["stderr_tail"] = _tail(os.path.join(out_dir, "train.err"))
    return rec


_ABS_PATH = re.compile(r"(?<![\w.<>:/])/[^\s'\"=:,]+")


def portable(obj):
    """The report with every absolute path in it as ``portable_path`` writes it (relative to the
    repository inside it, else ``<tmp>/`` and its last part): a result names no path of the
    machine that ran it."""
    if isinstance(obj, dict):
        return {k: portable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [portable(v) for v in obj]
    if isinstance(obj, str):
        return _ABS_PATH.sub(lambda m: portable_path(m.group(0)), obj)
    return obj


def load_weights(model_path: str) -> list:
    import keras

    return keras.saving.load_model(model_path, compile=False).get_weights()


def weights_of(base_runs: list[dict], head_runs: list[dict]) -> dict:
    """compare_weights of each repeat's pair of finished runs; the worst pair is reported."""
    pairs = [(b, h) for b, h in zip(base_runs, head_runs) if b.get("model") and h.get("model")]
    if not pairs:
        return {"allclose": False, "error": "no pair of finished runs"}
    results = [compare_weights(load_weights(b["model"]), load_weights(h["model"])) for b, h in pairs]
    worst = max(results, key=lambda r: (not r["allclose"], r["max_rel_diff"] or 0.0))
    return {**worst, "pairs": len(results)}


def provenance(argv: list[str]) -> dict:
    def version(*names):  # the first installed of a package's distribution names
        for name in names:
            try:
                return importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                pass
        return None

    cpu, mem = None, None
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), None)
        with open("/proc/meminfo") as fh:
            mem = next((int(ln.split()[1]) / 1024 ** 2 for ln in fh if ln.startswith("MemTotal")), None)
    except OSError:
        pass
    java = subprocess.run(["java", "-version"], capture_output=True, text=True, check=False)
    return {"command": shlex.join(["python", *argv]), "date": datetime.datetime.now().astimezone().isoformat(),
            "python": platform.python_version(),
            "tensorflow": version("tensorflow", "tensorflow-cpu", "tensorflow-intel"),
            **{p: version(p) for p in ("keras", "pyspark", "numpy")},
            "java": (java.stderr.splitlines() or [""])[0], "cpu": cpu, "cores": os.cpu_count(),
            "memory_gib": round(mem, 1) if mem else None, "platform": platform.platform()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default=BASE_REV, help=f"base revision, in a worktree (default {BASE_REV})")
    ap.add_argument("--head", help="head revision, in a worktree (default: this working tree as it is)")
    ap.add_argument("--epochs", type=int, default=3, help="epochs of each variant but the deterministic one")
    ap.add_argument("--deterministic-epochs", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1, help="runs per variant and checkout (order alternates)")
    ap.add_argument("--quick", action="store_true", help="1 epoch for every variant")
    ap.add_argument("--variants", default=",".join(v.name for v in VARIANTS))
    ap.add_argument("--source", default=FMNIST_SRC, help="Fashion-MNIST IDX files (prepared once if --data is absent)")
    ap.add_argument("--data", default=os.path.join(ROOT, "data", "fashion-mnist"), help="prepared dataset")
    ap.add_argument("--runs-dir", help="where the run directories go (default: a new temporary directory, kept)")
    ap.add_argument("--run-timeout", type=float, default=7200, help="seconds per training run")
    ap.add_argument("--out", help="also write the JSON here")
    a = ap.parse_args(argv)
    by_name = {v.name: v for v in VARIANTS}
    variants = [by_name.get(n) for n in filter(None, a.variants.split(","))]
    if None in variants or not variants or min(a.epochs, a.deterministic_epochs, a.repeats) < 1:
        ap.error(f"--variants must name some of {', '.join(by_name)}; --epochs, --deterministic-epochs and "
                 "--repeats must be >= 1")
    t_start = time.perf_counter()
    prov = provenance([os.path.relpath(sys.argv[0]) if argv is None else "bench/behaviour.py",
                       *(sys.argv[1:] if argv is None else argv)])
    work = tempfile.mkdtemp(prefix="sparkcnn-behaviour-")
    worktrees, checkouts, dirs = [], {}, {}
    report: dict = {"bench": "behaviour", "quick": a.quick, "passed": False}
    try:
        for name, rev in (("base", a.base), ("head", a.head)):
            if rev is None:
                dirs[name] = ROOT
                checkouts[name] = {"rev": "working tree", "worktree": False, **working_tree_state(ROOT)}
                continue
            commit = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
            dirs[name] = os.path.join(work, name)
            _git("worktree", "add", "--detach", dirs[name], commit)
            worktrees.append(dirs[name])
            checkouts[name] = {"rev": rev, "commit": commit, "worktree": True, "dirty": False}
        for name in ("base", "head"):
            log("probe %s: where sparkcnn is imported from", name)
            checkouts[name].update(directory=dirs[name], **probe(dirs[name]))
        runs_dir = os.path.abspath(a.runs_dir or tempfile.mkdtemp(prefix="sparkcnn-behaviour-runs-"))
        report.update(checkouts=checkouts, runs_dir=runs_dir)
        if not all(c["own_code"] for c in checkouts.values()):
            raise RuntimeError("a checkout does not import its own sparkcnn: "
                               + json.dumps({k: {x: c.get(x) for x in ("sparkcnn_driver", "sparkcnn_worker",
                                                                          "error")} for k, c in checkouts.items()}))
        data = os.path.abspath(a.data)
        if not os.path.isdir(os.path.join(data, "test")):
            log("prepare %s from %s with the head checkout", data, a.source)
            subprocess.run([sys.executable, "-c", CLI, "prepare", "--format", "idx", "--source", a.source,
                            "--out", data], cwd=dirs["head"], env=checkout_env(dirs["head"]), check=True,
                           stdout=subprocess.DEVNULL)
        runs = {v.name: {"base": [], "head": []} for v in variants}
        for rep in range(a.repeats):
            for i, v in enumerate(variants):
                epochs = 1 if a.quick else (a.deterministic_epochs if v.deterministic else a.epochs)
                for name in order_for(i, rep):
                    log("%s r%d: %s (%d epochs)", v.name, rep, name, epochs)
                    rec = train_once(dirs[name], v, epochs, data, os.path.join(runs_dir, v.name, f"{name}-r{rep}"),
                                     a.run_timeout)
                    rec.update(repeat=rep, position=order_for(i, rep).index(name), epochs=epochs)
                    runs[v.name][name].append(rec)
                    log("  exit %s accuracy %s images/s %s wall %.0f s", rec["exit_code"], rec.get("test_accuracy"),
                        rec.get("images_per_s"), rec["wall_s"])
        results, lines = {}, []
        for v in variants:
            base, head = aggregate(runs[v.name]["base"]), aggregate(runs[v.name]["head"])
            weights = weights_of(runs[v.name]["base"], runs[v.name]["head"]) if v.deterministic else None
            cmp = compare_variant(v.deterministic, base, head, weights)
            results[v.name] = {"overrides": list(v.overrides), "base": {**base, "runs": runs[v.name]["base"]},
                               "head": {**head, "runs": runs[v.name]["head"]}, "comparison": cmp}
            lines.append(summary_line(v.name, cmp))
        loads = [r[k] for by in runs.values() for rs in by.values() for r in rs
                 for k in ("loadavg_before", "loadavg_after") if k in r]
        lines.append(f"load: 1-minute load average {min(loads):.1f} to {max(loads):.1f} on {os.cpu_count()} cores"
                     " (images/s compares fairly only on an otherwise idle machine)")
        failed = [f"{v}/{c}/r{r['repeat']}" for v, by in runs.items() for c, rs in by.items() for r in rs
                  if r["exit_code"] != 0]
        report.update(passed=not failed and all(r["comparison"]["passed"] for r in results.values()),
                      summary=lines, failed_runs=failed, variants=results)
    except Exception as e:  # noqa: BLE001 - reported in the JSON, exit 1
        report["error"] = f"{type(e).__name__}: {e}"
    finally:
        for path in worktrees:
            subprocess.run(["git", "worktree", "remove", "--force", path], cwd=ROOT, capture_output=True, check=False)
        shutil.rmtree(work, ignore_errors=True)
        if a.head is None and "head" in checkouts:
            end = working_tree_state(ROOT)
            checkouts["head"]["changed_during_run"] = changed = end != {k: checkouts["head"][k] for k in end}
            if changed:
                report.setdefault("summary", []).append("head: the working tree changed during the run, "
                                                        "so its runs may mix code versions")
    report.update(thresholds={"accuracy_points": ACCURACY_POINTS, "images_per_s_fraction": RATE_FRACTION,
                              "weights_rtol": WEIGHTS_RTOL, "weights_atol": 0.0},
                  provenance=prov, wall_s=time.perf_counter() - t_start)
    report = portable(json_safe(report))
    emit(report)
    if a.out:
        tmp = f"{a.out}.tmp-{os.getpid()}"
        with open(tmp, "w") as fh:
            json.dump(report, fh, indent=2)
        os.replace(tmp, a.out)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
