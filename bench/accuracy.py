"""The seed experiment table on Fashion-MNIST: accuracy, time and bytes per variant.

Prints one JSON object ``{"runs": [...], "sweep": [...]}``. Each run trains
``fmnist_cnn`` on 2 blocks (local[2]) for ``--epochs`` epochs and reports final
and per-epoch test accuracy, wall time, measured bytes up and down, the dense
equivalents (4·P per block per round and direction), ``steady_uplink_ratio``
(dense / actual bytes per round once the density warm-up is over) and
``run_uplink_ratio`` (whole run); likewise for the downlink.

Each row trains its file in ``conf/seed/`` (``fmnist_<variant>.yaml``, bench/rows.py) with the
``--set`` overrides of its variant on top, and records both, per run and per row, as
``config_file`` and ``command`` (``sparkcnn train --config ... --set ...``; the Keras row's
``python bench/keras_fit.py --config conf/seed/fmnist_keras.yaml``): what reproduces it.

Variants: ``sync-dense``, ``sync-sparse`` (uplink density 0.001 after a
3-epoch exponential warm-up from 0.25), ``sync-sparse-bidir`` (and downlink
density 0.01), and the same three in async mode (ASGD, GS-ASGD, GS-ASGD with
model-parameter sparsification). ``momentum_forms``: the per-step path
(``steps_per_round`` = 1) with DGC momentum correction next to
sparsification-aware momentum, on a slice of the training set.

``stream`` (``--stream all`` or a list): the second seed's own setting, one step per exchange
(H = 1) over the streaming transport, async, ``--seeds`` seeds each (``run.seed`` 42, 43, ...),
mean and standard deviation per variant: ``stream-asgd`` (dense), ``stream-gs-asgd`` (uplink
0.001 after the same warm-up, momentum correction without factor masking, DGC's local
gradient clipping),
``stream-gs-asgd-ms`` (and model-parameter sparsification, downlink 0.01)
and ``stream-gs-asgd-samomentum`` (the third with
sparsification-aware momentum). Every run
carries ``time_to_0_88_s`` and ``time_to_0_90_s`` (to the first epoch end at test accuracy >= 0.88
or 0.90, null if never).

Every row runs ``--seeds`` seeds (``run.seed`` 42, 43, ...; the jobs rows too) and reports their
mean and sample standard deviation. ``stream-gs-asgd-ms-n8`` and ``stream-gs-asgd-samomentum-n8``
are the last two on 8 blocks (``local[8]``), each run in a process of its own.

``reference`` (``--keras``): ``keras``, single-process Keras ``model.fit`` on the same model, data,
batch size, momentum and lr schedule (TF's default threads), its accuracy per epoch, wall and times
to 0.88 and 0.90: what the parallel runs are compared with.

``--dataset cifar10``: the same rows from the ``cifar10_*.yaml`` files (ResNet-20 on
``data/cifar10``, their epochs unless ``--epochs``), relative checks only; the CIFAR-10 seed
table, with its 2-block comparison and its longer run, is ``bench/cifar_seeds.py``.

    python bench/accuracy.py [--quick] [--variants sync-dense,sync-sparse] [--no-sweep] [--no-momentum]
                             [--stream all --seeds 3] [--keras] [--dataset fmnist|cifar10]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import ROOT, config_of, emit, ensure_data, exit_status, log, portable_path  # noqa: E402
from bench import keras_fit  # noqa: E402 - its child (an import, so that bench/fresh.py counts it)
from bench.rows import ASYNC, N8, Variant, file_value, parts, reproduction, seed_file, variants  # noqa: E402,F401

# Each seed-table row is a conf/seed/ file (bench/rows.py); a variant is a row file and the --set
# overrides this bench puts on top of it. The parts the jobs variants share with the stream rows
# are read from the row files, so that the table and the files cannot drift apart. GS-ASGD is
# momentum correction (the seed's words) without DGC's factor masking, which slows coordinates
# selected every step (2 epochs: 0.848 with it, 0.862 without, 0.870 dense); sparse per-step rows
# clip each block's gradient (DGC; ~0.8-1.7 measured per batch here).
DATASETS = ("fmnist", "cifar10")  # --dataset: whose conf/seed files the rows train
VARIANTS, STREAM_VARIANTS = variants("fmnist")
_PARTS = parts("fmnist")  # what the other benches borrow, as override lists
SPARSE, BIDIR = list(_PARTS.sparse), list(_PARTS.bidir)
PER_STEP, STREAM = list(_PARTS.per_step), list(_PARTS.stream)
STREAM_SPARSE = [*STREAM, *SPARSE, *PER_STEP]
BASE = "conf/fashion_mnist.yaml"  # what a run of no row file trains on (the sweeps, the other benches)
# the two momentum forms of the per-step path (steps_per_round = 1, DESIGN §3), side by side on a
# slice of the training set: DGC momentum correction with factor masking, and sparsification-aware
# momentum (unsent coordinates keep accumulating instead of decaying)
MOMENTUM_FORMS = ("correction", "sparsification_aware")
MOMENTUM_BASE = ["train.steps_per_round=1", "compression.method=threshold", "compression.density=0.001",
                 "compression.initial_density=0.25", "compression.warmup_epochs=1",
                 "compression.dense_below=1000"]
# accuracy vs steady uplink ratio: density x steps_per_round (3 epochs each)
SWEEP = [(d, h) for d in (0.01, 0.001) for h in (10, 50)]


def _ratios(records: list[dict], warmup_epochs: float, rounds_per_epoch: int) -> dict:
    rounds = [r for r in records if r["kind"] == "round"]
    steady = [r for r in rounds if r["round"] >= warmup_epochs * rounds_per_epoch] or rounds
    up, down = sum(r["bytes_up"] for r in rounds), sum(r["bytes_down"] for r in rounds)
    dense = sum(r["dense_bytes"] for r in rounds)
    s_up, s_down = sum(r["bytes_up"] for r in steady), sum(r["bytes_down"] for r in steady)
    s_dense = sum(r["dense_bytes"] for r in steady)
    s_epochs = len(steady) / max(1, rounds_per_epoch)  # epochs the steady state spans
    return {"bytes_up": up, "bytes_down": down, "dense_bytes_up": dense, "dense_bytes_down": dense,
            # bytes per epoch once the density warm-up is over (the whole run's for a dense row)
            "steady_bytes_up_per_epoch": s_up / s_epochs if s_epochs else None,
            "steady_bytes_down_per_epoch": s_down / s_epochs if s_epochs else None,
            "steady_uplink_ratio": s_dense / max(1, s_up), "run_uplink_ratio": dense / max(1, up),
            "steady_downlink_ratio": s_dense / max(1, s_down), "run_downlink_ratio": dense / max(1, down),
            "run_total_ratio": 2 * dense / max(1, up + down),
            "mean_round_overhead_ms": 1000 * sum(r["round_overhead_s"] for r in rounds) / max(1, len(rounds))}


def _time_to(records: list[dict], target: float) -> float | None:
    """Seconds from the run's start to the first epoch end whose test accuracy reaches ``target``."""
    for r in records:
        if r["kind"] == "epoch" and r.get("test_accuracy", 0) >= target:
            return r["wall_s"]
    return None


def _own_process(overrides: list[str]) -> bool:
    """A run whose master is set (another N than this process's session) needs a process of its own."""
    return any(o.startswith("engine.master=") for o in overrides)


def run_isolated(data: str, name: str, overrides: list[str], epochs: int, out_dir: str,
                 config_file: str = BASE) -> dict:
    """:func:`run_variant` in a child process (its own Spark session, on the master it names)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYSPARK_PYTHON=sys.executable)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", name, "--data", data,
                           "--epochs", str(epochs), "--out-dir", out_dir, "--config", config_file,
                           "--overrides", json.dumps(overrides)],
                          capture_output=True, text=True, env=env, timeout=4 * 3600)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [""])[-1]
        if last.startswith(f"{DIVERGED}:"):  # the guard stopped a collapse: a result, as in-process
            raise Collapsed(last[len(DIVERGED) + 1:].strip())
        raise RuntimeError(f"bench/accuracy.py: {name} failed (exit {proc.returncode}): {[last]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


DIVERGED = "sparkcnn.errors.Diverged"  # how a child's traceback names the guard's stop


class Collapsed(Exception):
    """A run the divergence guard stopped (sparkcnn.errors.Diverged), in this process or a child."""


def run_seeds(data: str, name: str, variant: Variant, epochs: int, out_dir: str, seeds: int,
              own_process: bool = False, runner=None) -> dict:
    """``name`` over ``seeds`` seeds (``run.seed`` 42, 43, ...), aggregated, with the row's
    reproduction (its file and command, without the seed). A seed the guard stopped is kept as a
    collapsed run (its reason, no accuracy) and the others still run: a collapse is a result of
    the table, not a failure of the bench. ``own_process``: every seed in a child process (its
    own Spark session on the master its file names), as a run whose overrides set one is;
    ``runner``: what runs one seed instead (``run_isolated``'s arguments)."""
    from sparkcnn.errors import Diverged

    overrides, path = list(variant.sets), portable_path(data)
    run = runner or (run_isolated if own_process or _own_process(overrides) else run_variant)
    out = []
    for i in range(seeds):
        seeded = [*overrides, f"run.seed={42 + i}"]
        try:
            out.append(run(data, name, seeded, epochs, out_dir, config_file=variant.config))
        except (Diverged, Collapsed) as e:
            log("%s seed %d collapsed: %s", name, 42 + i, e)
            out.append({"name": name, "overrides": seeded, "epochs": epochs, "seed": 42 + i,
                        "collapsed": str(e), **reproduction(variant.config, seeded, data=path, epochs=epochs)})
    return {**_aggregate(name, out), **reproduction(variant.config, overrides, data=path, epochs=epochs)}


def run_variant(data: str, name: str, overrides: list[str], epochs: int, out_dir: str,
                config_file: str = BASE) -> dict:
    """One training of ``config_file`` (relative to the repository) with ``overrides`` on top, on
    ``data`` for ``epochs`` epochs: its figures, resolved config and reproduction."""
    from sparkcnn import config
    from sparkcnn.metrics import read_jsonl
    from sparkcnn.train import train

    cfg = config.load(os.path.join(ROOT, config_file), [f"data.path={data}", f"run.out_dir={out_dir}",
                                                         f"run.name={name}", f"train.epochs={epochs}",
                                                         *overrides])
    t0 = time.perf_counter()
    s = train(cfg)
    wall = time.perf_counter() - t0
    records = read_jsonl(os.path.join(s["run_dir"], "metrics.jsonl"))
    rpe = max(1, s["rounds"] // max(1, s["epochs"]))
    return {"name": name, "overrides": overrides, "epochs": epochs, "test_accuracy": s["test_accuracy"],
            "accuracy_per_epoch": s["accuracy_per_epoch"], "wall_s": wall, "train_wall_s": s["wall_s"],
            "images_per_s": s["images_per_s"],
            **_ratios(records, cfg.compression.warmup_epochs if cfg.compression.method != "none" else 0, rpe),
            "state_resets": s["state_resets"], "replica_resyncs": s["replica_resyncs"],
            "seed": cfg.run.seed, "time_to_0_88_s": _time_to(records, 0.88),
            # CIFAR-10's marks (bench/cifar_seeds.py; 0.60: bench/cifar_links.py)
            "time_to_0_60_s": _time_to(records, 0.60), "time_to_0_70_s": _time_to(records, 0.70),
            "time_to_0_80_s": _time_to(records, 0.80),
            "steps": sum(r.get("steps", 0) for r in records if r["kind"] == "round"),
            "time_to_0_90_s": _time_to(records, 0.90),
            "exposed_comm_ms_per_step": s.get("exposed_comm_ms_per_step"),
            "bytes_per_exchange_quantiles": exchange_bytes_quantiles(records),
            "exchange_slices": exchange_slices(records), **config_of(cfg),
            **reproduction(config_file, overrides, data=portable_path(data), epochs=epochs)}


def exchange_bytes_quantiles(records: list[dict], points: int = 20) -> list[float]:
    """Bytes up + down of one block's exchange at the midpoints of ``points`` equal slices of the
    run's exchanges (a sync round record holds every block's): how the traffic spreads over the
    run, e.g. the density warm-up's heavy first exchanges (bench/linkmodel.py reads it)."""
    xs = [(r["bytes_up"] + r["bytes_down"]) / max(1, r.get("blocks", 1)) for r in records
          if r["kind"] == "round" and r.get("blocks", 1) > 0]
    return [float(q) for q in np.quantile(xs, [(i + 0.5) / points for i in range(points)])] if xs else []


def exchange_slices(records: list[dict], points: int = 20) -> dict:
    """A stream run's exchanges in arrival order, cut into ``points`` equal consecutive slices, and
    each slice's means: ``bytes`` up + down of one exchange, ``period_s`` a block's time per
    exchange (compute and the wait for the previous reply) and ``server_s`` the driver's time on
    the push (``apply_s``). In time order, so that the three stay paired: the density warm-up's
    first exchanges are the heaviest in bytes and in the server's time alike (bench/linkmodel.py
    reads them). Empty for a run whose records lack these times (the jobs transport)."""
    rows = [r for r in records if r["kind"] == "round"]
    if len(rows) < points or any(r.get("apply_s") is None or r.get("exposed_comm_s") is None for r in rows):
        return {}
    columns = {"bytes": [r["bytes_up"] + r["bytes_down"] for r in rows],
               "period_s": [r["compute_s"] + r["exposed_comm_s"] for r in rows],
               "server_s": [r["apply_s"] for r in rows]}
    return {k: [float(c.mean()) for c in np.array_split(np.asarray(v, dtype=float), points)]
            for k, v in columns.items()}


def keras_reference(data: str, epochs: int, out_dir: str,
                    keras_file: str = seed_file("fmnist", "keras"), seed: int | None = None,
                    extra: tuple[str, ...] = ()) -> dict:
    """Single-process Keras ``model.fit`` of the row file ``keras_file`` on ``data`` for ``epochs``
    epochs (bench/keras_fit.py), in a child process so that this one's TF (and Spark's workers) do
    not share its threads; its wall includes each epoch's evaluation, as the engines' does.
    ``seed``: its ``run.seed`` (default: the file's); ``extra``: more ``--set`` overrides."""
    seeded = [*extra, *([f"run.seed={seed}"] if seed is not None else [])]
    sets = [f"data.path={data}", f"train.epochs={epochs}", f"run.out_dir={out_dir}", *seeded,
            *([f"run.name=keras-{seed}"] if seed is not None else [])]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    argv = [sys.executable, os.path.abspath(keras_fit.__file__),
            "--config", os.path.join(ROOT, keras_file), *(x for s in sets for x in ("--set", s))]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=7200)
    if proc.returncode != 0:
        raise RuntimeError(f"bench/keras_fit.py failed: {proc.stderr.strip().splitlines()[-1:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"keras": {**out, **reproduction(keras_file, seeded, data=portable_path(data), epochs=epochs)}}


def _aggregate(name: str, seeds: list[dict]) -> dict:
    """A stream variant over its seeds: mean and sample standard deviation (ddof = 1; None over
    one value) of what the table reports."""
    import numpy as np

    def stat(key):  # over the seeds that ran to the end
        vals = [r[key] for r in seeds if r.get(key) is not None and "collapsed" not in r]
        if not vals:
            return None, None
        return float(np.mean(vals)), (float(np.std(vals, ddof=1)) if len(vals) > 1 else None)

    done = [r for r in seeds if "collapsed" not in r]
    out = {"name": name, "overrides": seeds[0]["overrides"][:-1], "seeds": [r["seed"] for r in seeds],
           "runs": seeds, "collapsed": len(seeds) - len(done),
           "accuracy_per_epoch_mean": (np.mean([r["accuracy_per_epoch"] for r in done], 0).tolist() if done else []),
           "reached_0_90": sum(r["time_to_0_90_s"] is not None for r in done)}
    for key in ("test_accuracy", "wall_s", "time_to_0_88_s", "time_to_0_90_s", "images_per_s", "bytes_up", "bytes_down",
                "steady_uplink_ratio", "steady_downlink_ratio", "run_downlink_ratio",
                "exposed_comm_ms_per_step", "time_to_0_70_s", "time_to_0_80_s",
                "steady_bytes_up_per_epoch", "steady_bytes_down_per_epoch"):
        out[f"{key}_mean"], out[f"{key}_std"] = stat(key)
    return out


def _v(row: dict, key: str) -> float:
    """A row's aggregate for a check: NaN when no seed ran to the end, so that the check fails."""
    value = row.get(key)
    return float("nan") if value is None else value


def _summary(row: dict) -> str:
    """A seed-table row in one line: mean +- sample sd, and how many seeds collapsed."""
    mean, sd = row["test_accuracy_mean"], row["test_accuracy_std"] or 0
    text = f"{mean:.4f} +- {sd:.4f}" if mean is not None else "no seed ran to the end"
    return text + (f" ({row['collapsed']} of {len(row['seeds'])} seeds collapsed)" if row["collapsed"] else "")


def _sparse_downlink(row: dict) -> bool:
    """Whether a row's runs sparsify the downlink: from their resolved config, else (runs that
    carry none) from the row's overrides."""
    configs = [r["config"] for r in row.get("runs") or [] if isinstance(r.get("config"), dict)]
    if configs:
        return configs[0].get("compression", {}).get("density_down", 0) > 0
    return "density_down" in " ".join(row.get("overrides") or [])


def _stream_checks(by: dict, absolute: bool = True) -> dict:
    """The issue's bars for the per-step table: ASGD >= 0.905 (Fashion-MNIST's: ``absolute``);
    GS-ASGD within 0.5 points of it; with model-parameter sparsification within 0.7 points and
    steady downlink compression >= 100x."""
    checks, asgd = {}, by.get("stream-asgd")
    if asgd and absolute:
        checks["stream-asgd mean>=0.905"] = _v(asgd, "test_accuracy_mean") >= 0.905
    for name, pts in (("stream-gs-asgd", 0.005), ("stream-gs-asgd-ms", 0.007), ("stream-gs-asgd-ms-round", 0.007),
                      ("stream-gs-asgd-samomentum", 0.007)):
        if name in by and asgd:
            checks[f"{name} mean within {100 * pts:g}pt of stream-asgd"] = (
                _v(asgd, "test_accuracy_mean") - _v(by[name], "test_accuracy_mean") <= pts)
        if name in by and _sparse_downlink(by[name]):
            checks[f"{name} steady_downlink_ratio>=100"] = _v(by[name], "steady_downlink_ratio_mean") >= 100
    return checks


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 epoch per variant, no sweep")
    ap.add_argument("--dataset", choices=DATASETS, default="fmnist",
                    help="whose conf/seed row files the rows train (cifar10: its data.path, make data-cifar10; "
                         "no sweep, momentum forms or Fashion-MNIST bars)")
    ap.add_argument("--epochs", type=int, help="epochs per run (default: the row files' train.epochs)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--stream", default="", help="comma-separated stream variants to run "
                    f"({', '.join(STREAM_VARIANTS)}; 'all' for every one)")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per stream variant (run.seed 42, 43, ...)")
    ap.add_argument("--keras", action="store_true",
                    help="also train single-process Keras model.fit on the same model and data (reference)")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--sweep-epochs", type=int, default=3)
    ap.add_argument("--no-momentum", action="store_true", help="skip the momentum-form comparison")
    ap.add_argument("--momentum-epochs", type=int, default=3)
    ap.add_argument("--momentum-rows", type=int, default=20000,
                    help="training rows of the slice the momentum forms are compared on")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child of run_isolated: one run, its JSON
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    ap.add_argument("--overrides", help=argparse.SUPPRESS)
    ap.add_argument("--config", default=BASE, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one:
        print(json.dumps(run_variant(a.data, a.one, json.loads(a.overrides), a.epochs, a.out_dir, a.config)))
        return {}
    if a.seeds < 1:
        raise SystemExit(f"bench/accuracy.py: --seeds must be >= 1, got {a.seeds}")
    jobs_table, stream_table = variants(a.dataset)
    keras_file, sync_file = seed_file(a.dataset, "keras"), jobs_table["sync-dense"].config
    fmnist = a.dataset == "fmnist"
    data = ensure_data() if fmnist else os.path.join(ROOT, file_value(sync_file, "data.path"))
    if not os.path.isdir(os.path.join(data, "test")):
        print(f"bench/accuracy.py: data.path {portable_path(data)} of {sync_file}: no prepared dataset "
              "(make data-cifar10)", file=sys.stderr)
        raise SystemExit(2)
    out_dir = tempfile.mkdtemp(prefix="sparkcnn-bench-acc-")
    epochs = 1 if a.quick else (a.epochs or file_value(sync_file, "train.epochs"))
    reference = keras_reference(data, epochs, out_dir, keras_file) if a.keras else {}
    if reference:
        print(f"# keras model.fit: {reference['keras']['test_accuracy']}", file=sys.stderr, flush=True)
    runs = []
    for name in filter(None, a.variants.split(",")):
        if name not in jobs_table:
            raise SystemExit(f"bench/accuracy.py: unknown variant {name!r} (known: {', '.join(jobs_table)})")
        runs.append(run_seeds(data, name, jobs_table[name], epochs, out_dir, a.seeds))
        print(f"# {name}: {_summary(runs[-1])}", file=sys.stderr, flush=True)
    stream = []
    names = list(stream_table) if a.stream == "all" else list(filter(None, a.stream.split(",")))
    for name in names:
        if name not in stream_table:
            raise SystemExit(f"bench/accuracy.py: unknown stream variant {name!r} "
                             f"(known: {', '.join(stream_table)})")
        stream.append(run_seeds(data, name, stream_table[name], epochs, out_dir, a.seeds))
        print(f"# {name}: {_summary(stream[-1])}", file=sys.stderr, flush=True)
    sweep = []
    if not (a.quick or a.no_sweep or not fmnist):
        for d, h in SWEEP:
            # 3-epoch runs: a 1-epoch density warm-up leaves 2 steady epochs to measure
            ov = [f"train.steps_per_round={h}", *SPARSE, f"compression.density={d}", "compression.warmup_epochs=1"]
            r = run_variant(data, f"sweep-d{d}-h{h}", ov, a.sweep_epochs, out_dir)
            sweep.append({"density": d, "steps_per_round": h, "test_accuracy": r["test_accuracy"],
                          "steady_uplink_ratio": r["steady_uplink_ratio"], "wall_s": r["wall_s"],
                          "epochs": a.sweep_epochs})
            print(f"# sweep d={d} h={h}: {r['test_accuracy']}", file=sys.stderr, flush=True)
    momentum = []
    if not (a.quick or a.no_momentum or not fmnist):
        from bench._common import slice_data

        short = slice_data(data, a.momentum_rows, 10000)
        for form in MOMENTUM_FORMS:
            r = run_variant(short, f"momentum-{form}", [*MOMENTUM_BASE, f"compression.momentum={form}"],
                            a.momentum_epochs, out_dir)
            momentum.append({"momentum": form, "steps_per_round": 1, "train_rows": a.momentum_rows,
                             **{k: r[k] for k in ("test_accuracy", "accuracy_per_epoch", "wall_s",
                                                  "steady_uplink_ratio", "epochs")}})
            print(f"# momentum {form}: {r['test_accuracy']}", file=sys.stderr, flush=True)
    by = {r["name"]: r for r in runs} if fmnist else {}  # the jobs rows' bars are Fashion-MNIST's
    checks = {}
    for mode in ("sync", "async"):
        dense = by.get(f"{mode}-dense")
        if mode == "sync" and dense:
            checks["sync-dense>=0.91"] = _v(dense, "test_accuracy_mean") >= 0.91
        for v in (f"{mode}-sparse", f"{mode}-sparse-bidir"):
            if v in by:
                checks[f"{v} steady_uplink_ratio>=270"] = _v(by[v], "steady_uplink_ratio_mean") >= 270
                if dense:
                    checks[f"{v} within 0.5pt of {mode}-dense"] = (
                        _v(dense, "test_accuracy_mean") - _v(by[v], "test_accuracy_mean") <= 0.005)
        bidir = by.get(f"{mode}-sparse-bidir")
        if bidir:
            checks[f"{mode}-sparse-bidir steady_downlink_ratio>=100"] = _v(bidir, "steady_downlink_ratio_mean") >= 100
            if mode == "async" and dense:
                checks["async-sparse-bidir faster than async-dense"] = _v(bidir, "wall_s_mean") < _v(dense, "wall_s_mean")
    checks.update(_stream_checks({r["name"]: r for r in stream}, absolute=fmnist))
    checks.update({f"{r['name']} no seed collapsed": r["collapsed"] == 0 for r in runs + stream})
    out = {"bench": "accuracy", "quick": a.quick, "dataset": a.dataset, "std_ddof": 1, "runs": runs,
           "model": file_value(sync_file, "model.name"), "blocks": file_value(sync_file, "data.num_blocks"),
           "reference": reference, "sweep": sweep, "momentum_forms": momentum, "stream": stream, "checks": checks}
    emit(out)
    return out


if __name__ == "__main__":
    sys.exit(exit_status("accuracy", main()))
