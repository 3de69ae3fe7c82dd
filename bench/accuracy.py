"""The seed experiment table on Fashion-MNIST: accuracy, time and bytes per variant.

Prints one JSON object ``{"runs": [...], "sweep": [...]}``. Each run trains
``fmnist_cnn`` on 2 blocks (local[2]) for ``--epochs`` epochs and reports final
and per-epoch test accuracy, wall time, measured bytes up and down, the dense
equivalents (4·P per block per round and direction), ``steady_uplink_ratio``
(dense / actual bytes per round once the density warm-up is over) and
``run_uplink_ratio`` (whole run); likewise for the downlink.

Variants: ``sync-dense``, ``sync-sparse`` (uplink density 0.001 after a
3-epoch exponential warm-up from 0.25), ``sync-sparse-bidir`` (and downlink
density 0.01), and the same three in async mode (ASGD, GS-ASGD, GS-ASGD with
model-parameter sparsification). ``momentum_forms``: the per-step path
(``steps_per_round`` = 1) with DGC momentum correction next to
sparsification-aware momentum, on a slice of the training set.

    python bench/accuracy.py [--quick] [--variants sync-dense,sync-sparse] [--no-sweep] [--no-momentum]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import emit, ensure_data  # noqa: E402

SPARSE = ["compression.method=threshold", "compression.density=0.001", "compression.initial_density=0.25",
          "compression.warmup_epochs=3", "compression.dense_below=1000"]  # only biases travel dense
BIDIR = ["compression.density_down=0.01"]
# async: one block per job, jobs sized to ~0.5 s (about 10 steps here, as in sync)
ASYNC = ["engine.mode=async", "scheduler.target_job_seconds=0.5"]
VARIANTS = {
    "sync-dense": ["train.steps_per_round=10"],
    "sync-sparse": ["train.steps_per_round=10", *SPARSE],
    "sync-sparse-bidir": ["train.steps_per_round=10", *SPARSE, *BIDIR],
    "async-dense": ["train.steps_per_round=10", *ASYNC],
    "async-sparse": ["train.steps_per_round=10", *ASYNC, *SPARSE],
    "async-sparse-bidir": ["train.steps_per_round=10", *ASYNC, *SPARSE, *BIDIR],
}
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
    return {"bytes_up": up, "bytes_down": down, "dense_bytes_up": dense, "dense_bytes_down": dense,
            "steady_uplink_ratio": s_dense / max(1, s_up), "run_uplink_ratio": dense / max(1, up),
            "steady_downlink_ratio": s_dense / max(1, s_down), "run_downlink_ratio": dense / max(1, down),
            "run_total_ratio": 2 * dense / max(1, up + down),
            "mean_round_overhead_ms": 1000 * sum(r["round_overhead_s"] for r in rounds) / max(1, len(rounds))}


def run_variant(data: str, name: str, overrides: list[str], epochs: int, out_dir: str) -> dict:
    from sparkcnn import config
    from sparkcnn.metrics import read_jsonl
    from sparkcnn.train import train

    cfg = config.load(None, [f"data.path={data}", f"run.out_dir={out_dir}", f"run.name={name}",
                             f"train.epochs={epochs}", "train.lr_warmup_epochs=0.3", *overrides])
    t0 = time.perf_counter()
    s = train(cfg)
    wall = time.perf_counter() - t0
    records = read_jsonl(os.path.join(s["run_dir"], "metrics.jsonl"))
    rpe = max(1, s["rounds"] // max(1, s["epochs"]))
    return {"name": name, "overrides": overrides, "epochs": epochs, "test_accuracy": s["test_accuracy"],
            "accuracy_per_epoch": s["accuracy_per_epoch"], "wall_s": wall, "train_wall_s": s["wall_s"],
            "images_per_s": s["images_per_s"],
            **_ratios(records, cfg.compression.warmup_epochs if cfg.compression.method != "none" else 0, rpe),
            "state_resets": s["state_resets"], "replica_resyncs": s["replica_resyncs"]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 epoch per variant, no sweep")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--sweep-epochs", type=int, default=3)
    ap.add_argument("--no-momentum", action="store_true", help="skip the momentum-form comparison")
    ap.add_argument("--momentum-epochs", type=int, default=3)
    ap.add_argument("--momentum-rows", type=int, default=20000,
                    help="training rows of the slice the momentum forms are compared on")
    a = ap.parse_args(argv)
    data = ensure_data()
    out_dir = tempfile.mkdtemp(prefix="sparkcnn-bench-acc-")
    epochs = 1 if a.quick else a.epochs
    runs = []
    for name in filter(None, a.variants.split(",")):
        if name not in VARIANTS:
            raise SystemExit(f"bench/accuracy.py: unknown variant {name!r} (known: {', '.join(VARIANTS)})")
        runs.append(run_variant(data, name, VARIANTS[name], epochs, out_dir))
        print(f"# {name}: {runs[-1]['test_accuracy']}", file=sys.stderr, flush=True)
    sweep = []
    if not (a.quick or a.no_sweep):
        for d, h in SWEEP:
            # 3-epoch runs: a 1-epoch density warm-up leaves 2 steady epochs to measure
            ov = [f"train.steps_per_round={h}", *SPARSE, f"compression.density={d}", "compression.warmup_epochs=1"]
            r = run_variant(data, f"sweep-d{d}-h{h}", ov, a.sweep_epochs, out_dir)
            sweep.append({"density": d, "steps_per_round": h, "test_accuracy": r["test_accuracy"],
                          "steady_uplink_ratio": r["steady_uplink_ratio"], "wall_s": r["wall_s"],
                          "epochs": a.sweep_epochs})
            print(f"# sweep d={d} h={h}: {r['test_accuracy']}", file=sys.stderr, flush=True)
    momentum = []
    if not (a.quick or a.no_momentum):
        from bench._common import slice_data

        short = slice_data(data, a.momentum_rows, 10000)
        for form in MOMENTUM_FORMS:
            r = run_variant(short, f"momentum-{form}", [*MOMENTUM_BASE, f"compression.momentum={form}"],
                            a.momentum_epochs, out_dir)
            momentum.append({"momentum": form, "steps_per_round": 1, "train_rows": a.momentum_rows,
                             **{k: r[k] for k in ("test_accuracy", "accuracy_per_epoch", "wall_s",
                                                  "steady_uplink_ratio", "epochs")}})
            print(f"# momentum {form}: {r['test_accuracy']}", file=sys.stderr, flush=True)
    by = {r["name"]: r for r in runs}
    checks = {}
    for mode in ("sync", "async"):
        dense = by.get(f"{mode}-dense")
        if mode == "sync" and dense:
            checks["sync-dense>=0.91"] = dense["test_accuracy"] >= 0.91
        for v in (f"{mode}-sparse", f"{mode}-sparse-bidir"):
            if v in by:
                checks[f"{v} steady_uplink_ratio>=270"] = by[v]["steady_uplink_ratio"] >= 270
                if dense:
                    checks[f"{v} within 0.5pt of {mode}-dense"] = (
                        dense["test_accuracy"] - by[v]["test_accuracy"] <= 0.005)
        bidir = by.get(f"{mode}-sparse-bidir")
        if bidir:
            checks[f"{mode}-sparse-bidir steady_downlink_ratio>=100"] = bidir["steady_downlink_ratio"] >= 100
            if mode == "async" and dense:
                checks["async-sparse-bidir faster than async-dense"] = bidir["wall_s"] < dense["wall_s"]
    out = {"bench": "accuracy", "quick": a.quick, "model": "fmnist_cnn", "blocks": 2, "runs": runs,
           "sweep": sweep, "momentum_forms": momentum, "checks": checks}
    emit(out)
    return out


if __name__ == "__main__":
    main()
