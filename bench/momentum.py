"""Sparsification-aware momentum against momentum correction, by number of blocks.

The ablation of the second seed's momentum: GS-ASGD + MS (stream transport, async, one step per
push, uplink density 0.001 after a 1-epoch exponential warm-up from 0.25, downlink density 0.01,
DGC's local clipping) with ``compression.momentum`` = ``correction`` (DGC's momentum correction,
no factor masking: the project's GS-ASGD) or ``sparsification_aware`` (SAMomentum, Yan 2019), on
N = 2, 4 and 8 blocks (``local[N]``, one block per slot), ``--seeds`` seeds each (``run.seed`` 42,
43, ...), ``--epochs`` epochs. Staleness grows with N, which this momentum is meant to absorb.

``--settings`` picks the hyper-parameters: ``project`` (the project's lr 0.05, momentum 0.9,
batch 64) and ``dgs`` (the paper's CIFAR-10 code defaults where they differ: lr 0.1; its momentum
0.9 and batch 64 are the project's too). Its weight decay, 5e-4, is left out: the project's model
carries its own regularisation and both forms get the same gradient.

Every run is a child process (its own Spark session on ``local[N]``), one after another. Each
records test accuracy per epoch, bytes up and down, pushes and the guard's counters. The summary
gives, per setting and N, each form's mean, sample standard deviation (ddof 1) and
``samomentum_minus_correction`` in points, with bytes per push of each form (equal bytes: the
same density, so the two forms send about the same).

    python bench/momentum.py [--blocks 2,4,8] [--seeds 2] [--epochs 3] [--settings project,dgs]
                             [--dgs-blocks 8] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import emit, ensure_data, log  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASE = ["engine.transport=stream", "engine.mode=async", "train.steps_per_round=1",
        "compression.method=threshold", "compression.density=0.001", "compression.initial_density=0.25",
        "compression.warmup_epochs=1", "compression.dense_below=1000", "compression.clip_norm=2.0",
        "compression.factor_masking=false", "compression.density_down=0.01", "train.lr_warmup_epochs=0.3"]
FORMS = ("correction", "sparsification_aware")
SETTINGS = {"project": [], "dgs": ["train.lr=0.1", "train.momentum=0.9", "train.batch_size=64"]}

# one run in a child: argv = data, out_dir, blocks, seed, epochs, then overrides; prints one JSON line
CHILD = r"""
import json, os, sys
from sparkcnn import config
from sparkcnn.metrics import read_jsonl
from sparkcnn.train import train
data, out_dir, blocks, seed, epochs, *over = sys.argv[1:]
cfg = config.load(None, [f"data.path={data}", f"run.out_dir={out_dir}", f"run.seed={seed}",
                         f"run.name=momentum-{blocks}-{seed}", f"train.epochs={epochs}",
                         f"data.num_blocks={blocks}", f"engine.master=local[{blocks}]", *over])
s = train(cfg, progress=None)
rounds = [r for r in read_jsonl(os.path.join(s["run_dir"], "metrics.jsonl")) if r["kind"] == "round"]
print(json.dumps({"test_accuracy": s["test_accuracy"], "accuracy_per_epoch": s["accuracy_per_epoch"],
                  "pushes": len(rounds), "bytes_up": sum(r["bytes_up"] for r in rounds),
                  "bytes_down": sum(r["bytes_down"] for r in rounds),
                  "rejected_deltas": s.get("rejected_deltas"), "loss_spikes": s.get("loss_spikes"),
                  "images_per_s": s["images_per_s"], "lr": cfg.train.lr, "momentum": cfg.train.momentum,
                  "batch_size": cfg.train.batch_size}))
"""


def run_one(data: str, out_dir: str, blocks: int, seed: int, epochs: int, over: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", CHILD, data, out_dir, str(blocks), str(seed), str(epochs), *over],
                       capture_output=True, text=True, env=env, timeout=7200)
    if p.returncode != 0:
        raise RuntimeError(f"momentum run N={blocks} seed={seed} {over}: exit {p.returncode}: "
                           f"{p.stderr.strip().splitlines()[-1:]}")
    return {**json.loads(p.stdout.strip().splitlines()[-1]), "wall_s": round(time.perf_counter() - t0, 1)}


def _mean_sd(xs: list[float]) -> tuple[float, float | None]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)


def summarise(runs: list[dict]) -> list[dict]:
    rows = []
    for setting in dict.fromkeys(r["setting"] for r in runs):
        for n in sorted({r["blocks"] for r in runs if r["setting"] == setting}):
            row = {"setting": setting, "blocks": n}
            for form in FORMS:
                mine = [r for r in runs if (r["setting"], r["blocks"], r["form"]) == (setting, n, form)]
                if not mine:
                    continue
                mean, sd = _mean_sd([r["test_accuracy"] for r in mine])
                row[form] = {"mean": mean, "sd": sd, "seeds": len(mine),
                             "accuracies": [r["test_accuracy"] for r in mine],
                             "bytes_per_push": statistics.fmean((r["bytes_up"] + r["bytes_down"]) / max(1, r["pushes"])
                                                                for r in mine)}
            if all(f in row for f in FORMS):
                row["samomentum_minus_correction_points"] = round(
                    100 * (row["sparsification_aware"]["mean"] - row["correction"]["mean"]), 2)
            rows.append(row)
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", default="2,4,8", help="comma-separated N")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--settings", default="project,dgs", help=f"comma-separated, of {sorted(SETTINGS)}")
    ap.add_argument("--dgs-blocks", default="8", help="the N the dgs setting runs at")
    ap.add_argument("--out", help="also write the JSON here")
    a = ap.parse_args(argv)
    settings = [s for s in a.settings.split(",") if s]
    bad = [s for s in settings if s not in SETTINGS]
    if bad:
        print(f"--settings: unknown {bad[0]!r}, expected some of {sorted(SETTINGS)}", file=sys.stderr)
        raise SystemExit(2)
    data = ensure_data()
    plan = [(s, int(n), f, 42 + i)
            for s in settings for n in (a.blocks if s == "project" else a.dgs_blocks).split(",")
            for i in range(a.seeds) for f in FORMS]
    runs = []
    with tempfile.TemporaryDirectory(prefix="sparkcnn-momentum-") as tmp:
        for k, (setting, n, form, seed) in enumerate(plan, 1):
            over = [*CASE, f"compression.momentum={form}", *SETTINGS[setting]]
            r = run_one(data, tmp, n, seed, a.epochs, over)
            runs.append({"setting": setting, "blocks": n, "form": form, "seed": seed, **r})
            log("%d/%d %s N=%d %s seed %d: test accuracy %.4f (%.0f s)", k, len(plan), setting, n, form, seed,
                r["test_accuracy"], r["wall_s"])
    out = {"case": CASE, "settings": {s: SETTINGS[s] for s in settings}, "epochs": a.epochs,
           "seeds": a.seeds, "runs": runs, "summary": summarise(runs)}
    emit(out, a.out)
    return out


if __name__ == "__main__":
    main()
