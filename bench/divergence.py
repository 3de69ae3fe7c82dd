"""The rare divergence of async H = 1 sparse without the density warm-up: many seeds, each loss curve.

One of nine 1-epoch runs of the stream's GS-ASGD (async, one step per push, uplink density 0.001)
without the density warm-up once ended at 0.384 test accuracy, against 0.70-0.81 for the others,
and nothing caught it. This runs that case over ``--seeds`` seeds (``run.seed`` 42, 43, ...), one
after another on local[2], and records for each: test accuracy, the guard's counts (rejected
deltas, loss spikes, and the lr factor its actions left) and the loss curve (the mean training
loss of every ``--window`` applied pushes), so a collapse shows where it starts. "Without
warm-up" is the uplink density at 0.001 from the first push (``compression.warmup_epochs=0``);
the lr warm-up stays the project's.

Prints one JSON object: ``{"runs": [...], "summary": {...}, "provenance": ...}``.

    python bench/divergence.py [--seeds 10] [--epochs 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import config_of, emit, ensure_data  # noqa: E402

# the stream's GS-ASGD of bench/accuracy.py (stream-gs-asgd) with the density warm-up removed
CASE = ["engine.transport=stream", "engine.mode=async", "train.steps_per_round=1",
        "compression.method=threshold", "compression.density=0.001", "compression.initial_density=0.001",
        "compression.warmup_epochs=0", "compression.dense_below=1000", "compression.clip_norm=2.0",
        "compression.factor_masking=false", "train.lr_warmup_epochs=0.3"]


def curve(losses: list[float], window: int) -> list[float]:
    """Mean of every ``window`` consecutive losses (the last, shorter window too)."""
    return [round(statistics.fmean(losses[i:i + window]), 4) for i in range(0, len(losses), window)]


def run_seed(data: str, seed: int, epochs: int, window: int, out_dir: str) -> dict:
    from sparkcnn import config
    from sparkcnn.metrics import read_jsonl
    from sparkcnn.train import train

    cfg = config.load(None, [f"data.path={data}", f"run.out_dir={out_dir}", f"run.name=divergence-{seed}",
                             f"run.seed={seed}", f"train.epochs={epochs}", *CASE])
    t0 = time.perf_counter()
    s = train(cfg, progress=None)
    rounds = [r for r in read_jsonl(os.path.join(s["run_dir"], "metrics.jsonl")) if r["kind"] == "round"]
    losses = [r["loss"] for r in rounds]
    return {"seed": seed, "test_accuracy": s["test_accuracy"], "wall_s": round(time.perf_counter() - t0, 1),
            "pushes": len(rounds), "rejected_deltas": s.get("rejected_deltas"),
            "loss_spikes": s.get("loss_spikes"), "guard_lr_factor": s.get("guard_lr_factor"),
            "final_window_loss": curve(losses, window)[-1] if losses else None,
            "max_window_loss": max(curve(losses, window)) if losses else None,
            "loss_curve": curve(losses, window), **config_of(cfg)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--window", type=int, default=50, help="pushes per point of a loss curve")
    ap.add_argument("--out", help="also write the JSON here")
    a = ap.parse_args(argv)
    data = ensure_data()
    runs = []
    with tempfile.TemporaryDirectory(prefix="sparkcnn-divergence-") as tmp:
        for i in range(a.seeds):
            runs.append(run_seed(data, 42 + i, a.epochs, a.window, tmp))
            print(f"seed {runs[-1]['seed']}: test accuracy {runs[-1]['test_accuracy']:.4f}", file=sys.stderr)
    acc = [r["test_accuracy"] for r in runs]
    med = statistics.median(acc)
    out = {"case": CASE, "epochs": a.epochs, "window": a.window, "runs": runs,
           "summary": {"seeds": len(runs), "median": med, "min": min(acc), "max": max(acc),
                       "within_5_points_of_median": sum(abs(x - med) <= 0.05 for x in acc),
                       "above_0_65": sum(x > 0.65 for x in acc)}}
    emit(out, a.out)
    return out


if __name__ == "__main__":
    main()
