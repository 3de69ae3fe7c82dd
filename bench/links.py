"""The seeds' speed-up in time: the same training on separate hosts behind links of different rates.

A 2-host test bed (:mod:`sparkcnn.testing.testbed`: two network namespaces of one Spark worker
with one core each, the driver and master on a bridge, each host's link shaped in both
directions by tbf) trains ``fmnist_cnn`` on Fashion-MNIST, 2 blocks, with these variants
(``VARIANTS``: bench/accuracy.py's stream rows and its sync reference, each its conf/seed file,
whose training command every cell records as ``config_file`` and ``command``):

- ``stream-asgd``: the stream, async, one step per exchange (H = 1), dense both ways;
- ``stream-gs-asgd``: + uplink sparsification (density 0.001, DGC momentum correction,
  clipping), with the project's sparse warm-up (conf/fashion_mnist_sparse.yaml: density
  0.25 decaying to 0.001 over 3 epochs);
- ``stream-gs-asgd-ms``: + model-parameter sparsification of the downlink (density 0.01);
- ``jobs-sync-dense``: the jobs transport, sync, H = 10, dense.

at each link rate of ``--rates`` (default ``unshaped,1gbit,100mbit``; 100 Mbit/s is what each
of 64 workers gets of a driver's 10 Gbit/s NIC). Every variant runs ``--epochs`` (5) epochs,
enough for the dense variants to pass 0.88 test accuracy, one seed (``run.seed`` 42), and
``--reps`` (1) repetitions per cell, whose medians (images/s, time to 0.88, accuracy, exposed
communication) the cell reports and the checks judge, beside each repetition's figures. A
repetition runs every rate in turn, so that the machine's drift falls on all rates alike, and
the speed check takes the median of each repetition's ratio. A cell
takes 1-4 minutes, the whole bench at one repetition 20-40 minutes on this machine.
The cluster, the session and the executors' Python workers live through the whole run; a
short unrecorded run of every variant on 4,000 rows first imports TensorFlow, traces the
model and compiles the codec in the executors (``warm_up_s``).

Each cell records images/s, test accuracy per epoch and final, ``time_to_0_88_s`` (seconds
from the run's start to the end of the first epoch whose test accuracy reaches 0.88; None if
none does), bytes up and down (total and per local step), ``exposed_comm_ms_per_step`` (the
stream: time a task waited for replies, per step) and the jobs transport's mean round overhead.

Checks (``checks``): every cell reaches its accuracy gate (``--gate``, 0.85 after the last
epoch: a speed figure counts only if the run trained), and the two targets at 100 Mbit/s,
when that rate is run:
- ``gs_asgd_ms_0_88_speedup_at_100mbit``: dense ASGD's time to 0.88 over GS-ASGD + MS's >= 3;
- ``gs_asgd_ms_keeps_its_speed_at_100mbit``: GS-ASGD + MS's images/s at 100 Mbit/s >= 0.9 x
  its unshaped images/s.

Output: one JSON object, ``{"rates": {rate: {variant: {...}}}, "checks", "passed",
"testbed", "provenance"}``. Exit 0 when every check holds, 1 otherwise (the JSON is printed
either way), 2 on bad arguments or when this machine cannot build a test bed (one line).

    python bench/links.py [--epochs 5] [--rates unshaped,1gbit,100mbit] [--variants a,b] [--reps 1]
                          [--train-rows N --test-rows N] [--gate 0.85] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import emit, ensure_data, exit_status, log, slice_data  # noqa: E402
from bench.accuracy import STREAM_VARIANTS, VARIANTS as JOBS_VARIANTS, run_variant  # noqa: E402

SEED = 42
# bench/accuracy.py's rows: each trains its conf/seed file (the cells record its command)
VARIANTS = {
    "stream-asgd": STREAM_VARIANTS["stream-asgd"],
    "stream-gs-asgd": STREAM_VARIANTS["stream-gs-asgd"],
    "stream-gs-asgd-ms": STREAM_VARIANTS["stream-gs-asgd-ms"],
    "jobs-sync-dense": JOBS_VARIANTS["sync-dense"],
}
RATES = ("unshaped", "1gbit", "100mbit")
TARGET = 0.88


def _cell(data: str, name: str, epochs: int, out_dir: str, rate: str, variant=None, run=run_variant,
          run_name: str | None = None) -> dict:
    """One variant at one link rate (``variant``: its row, default ``VARIANTS[name]``; ``run``: what
    trains it, ``run_variant``'s arguments)."""
    v = variant or VARIANTS[name]
    r = run(data, run_name or f"links-{rate}-{name}", [*v.sets, f"run.seed={SEED}"], epochs, out_dir,
            config_file=v.config)
    steps = r["steps"] or 1
    keep = ("test_accuracy", "accuracy_per_epoch", "images_per_s", "time_to_0_88_s", "time_to_0_60_s", "wall_s",
            "train_wall_s", "bytes_up", "bytes_down", "dense_bytes_up", "run_uplink_ratio", "run_downlink_ratio",
            "exposed_comm_ms_per_step", "mean_round_overhead_ms", "state_resets", "replica_resyncs", "seed",
            "bytes_per_exchange_quantiles", "exchange_slices", "config_file", "command", "made")
    return {"link": rate, "overrides": list(v.sets), "epochs": epochs, **{k: r.get(k) for k in keep},
            "steps": steps, "bytes_up_per_step": r["bytes_up"] / steps, "bytes_down_per_step": r["bytes_down"] / steps,
            **shape_of(r.get("config") or {}), "config_sha256": r.get("config_sha256")}


def shape_of(config: dict) -> dict:
    """A run's blocks, batch size, local steps per exchange and mode (bench/linkmodel.py's inputs)."""
    return {"blocks": config.get("data", {}).get("num_blocks"), "batch_size": config.get("train", {}).get("batch_size"),
            "steps_per_round": config.get("train", {}).get("steps_per_round"),
            "transport": config.get("engine", {}).get("transport"), "mode": config.get("engine", {}).get("mode")}


def _repeated(reps: list[dict]) -> dict:
    """One cell from its repetitions: the first's record, with the medians of images/s, time to
    0.88, test accuracy and exposed communication, and every repetition's figures."""
    if len(reps) == 1:
        return reps[0]
    keys = ("images_per_s", "time_to_0_88_s", "test_accuracy", "exposed_comm_ms_per_step")
    med = {k: statistics.median(r[k] for r in reps) if all(r[k] is not None for r in reps) else None for k in keys}
    return {**reps[0], **med, "repetitions": [{k: r[k] for k in (*keys, "accuracy_per_epoch")} for r in reps]}


def _checks(rates: dict, gate: float) -> dict:
    checks = {}
    for rate, cells in rates.items():
        for name, c in cells.items():
            checks[f"{rate}/{name}_trained"] = {"test_accuracy": c["test_accuracy"], "gate": gate,
                                                "passed": (c["test_accuracy"] or 0) >= gate}
    slow, base = rates.get("100mbit", {}), rates.get("unshaped", {})
    if "stream-asgd" in slow and "stream-gs-asgd-ms" in slow:
        dense_t, sparse_t = slow["stream-asgd"]["time_to_0_88_s"], slow["stream-gs-asgd-ms"]["time_to_0_88_s"]
        ratio = dense_t / sparse_t if dense_t and sparse_t else None
        checks["gs_asgd_ms_0_88_speedup_at_100mbit"] = {
            "stream_asgd_s": dense_t, "gs_asgd_ms_s": sparse_t, "ratio": ratio, "target": 3.0,
            "passed": ratio is not None and ratio >= 3.0}
    if "stream-gs-asgd-ms" in slow and "stream-gs-asgd-ms" in base:
        s, b = slow["stream-gs-asgd-ms"], base["stream-gs-asgd-ms"]
        # each repetition's 100 Mbit/s run over the same repetition's unshaped run, then the median
        pairs = [x["images_per_s"] / y["images_per_s"] for x, y in zip(s.get("repetitions") or [s],
                                                                        b.get("repetitions") or [b])]
        ratio = statistics.median(pairs)
        checks["gs_asgd_ms_keeps_its_speed_at_100mbit"] = {"ratio": ratio, "per_repetition": pairs, "target": 0.9,
                                                           "passed": ratio >= 0.9}
    return checks


def on_testbed(bench: str, rates: list[str], variants: list[str], reps: int, epochs: int, cell, warm_up):
    """Every variant at every rate on the 2-host test bed, ``reps`` times (the rates in turn within a
    repetition: the machine's drift falls on all alike): ``cell(name, rate, rep)`` makes each cell,
    after ``warm_up()`` once. The cluster, its session and the executors' Python workers live
    through the whole run. (cells {rate: {name: [one per repetition]}}, warm-up s, test bed)."""
    from sparkcnn.testing import standalone
    from sparkcnn.testing.testbed import TestBed

    with TestBed(hosts=2, cores=1) as bed:
        spark = standalone.session(bed.cluster, f"sparkcnn-{bench}",
                                   conf={"spark.executor.extraJavaOptions": standalone.FAST_START_JAVA_OPTS})
        try:
            t0 = time.perf_counter()
            warm_up()
            warm_up_s = time.perf_counter() - t0
            runs: dict[str, dict[str, list]] = {rate: {name: [] for name in variants} for rate in rates}
            for rep in range(reps):
                for rate in rates:
                    bed.reshape(None if rate == "unshaped" else rate)
                    for name in variants:
                        log("%s: repetition %d/%d, %s %s (%d epochs)", bench, rep + 1, reps, rate, name, epochs)
                        runs[rate][name].append(cell(name, rate, rep))
            return runs, warm_up_s, bed.describe()
        finally:
            spark.stop()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--rates", default=",".join(RATES))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--train-rows", type=int)
    p.add_argument("--test-rows", type=int)
    p.add_argument("--gate", type=float, default=0.85)
    p.add_argument("--reps", type=int, default=1, help="repetitions per cell (medians are judged)")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    from sparkcnn.testing.testbed import parse_rate, unavailable_reason

    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    try:
        for r in rates:
            if r != "unshaped":
                parse_rate(r)
        bad = [v for v in variants if v not in VARIANTS]
        if bad:
            raise ValueError(f"--variants: unknown {bad}; known: {', '.join(VARIANTS)}")
        if args.epochs < 1 or args.reps < 1:
            raise ValueError(f"--epochs and --reps must be >= 1, got {args.epochs}, {args.reps}")
    except ValueError as e:
        print(f"links: {e}", file=sys.stderr)
        return 2
    why = unavailable_reason()
    if why:
        print(f"links: {why}", file=sys.stderr)
        return 2
    data = ensure_data()
    if args.train_rows:
        data = slice_data(data, args.train_rows, args.test_rows or max(1000, args.train_rows // 6))
    out_dir = tempfile.mkdtemp(prefix="sparkcnn-links-")
    try:
        warm = slice_data(data, 4000, 1000)

        def warm_up():  # TF import, tracing and the codec's compilation in the executors
            for name in variants:
                run_variant(warm, f"links-warm-up-{name}", list(VARIANTS[name].sets), 1, out_dir, VARIANTS[name].config)

        def cell(name, rate, rep):
            c = _cell(data, name, args.epochs, out_dir, rate)
            log("links: %s %s: %.0f images/s, accuracy %.4f, time to 0.88 %s", rate, name, c["images_per_s"],
                c["test_accuracy"], c["time_to_0_88_s"])
            return c

        runs, warm_up_s, testbed = on_testbed("links", rates, variants, args.reps, args.epochs, cell, warm_up)
        results = {rate: {name: _repeated(rs) for name, rs in cells.items()} for rate, cells in runs.items()}
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    checks = _checks(results, args.gate)
    out = {"rates": results, "checks": checks, "passed": all(c["passed"] for c in checks.values()),
           "epochs": args.epochs, "reps": args.reps, "target_accuracy": TARGET, "warm_up_s": warm_up_s,
           "data": {"train_rows": args.train_rows, "test_rows": args.test_rows} if args.train_rows else "full",
           "testbed": {**testbed, "link_rate": "per cell (rates)"}}
    emit(out, args.out)
    return exit_status("links")


if __name__ == "__main__":
    sys.exit(main())
