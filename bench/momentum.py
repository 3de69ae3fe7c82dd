"""Sparsification-aware momentum against momentum correction, by number of blocks.

The ablation of the second seed's momentum: GS-ASGD + MS (stream transport, async, one step per
push, uplink density 0.001 after a 1-epoch exponential warm-up from 0.25, downlink density 0.01,
DGC's local clipping) with ``compression.momentum`` = ``correction`` (DGC's momentum correction,
no factor masking: the project's GS-ASGD) or ``sparsification_aware`` (SAMomentum, Yan 2019), on
N = 2, 4 and 8 blocks (``local[N]``, one block per slot), ``--seeds`` seeds each (``run.seed`` 42,
43, ...), ``--epochs`` epochs. Staleness grows with N, which this momentum is meant to absorb.

``--settings`` picks the hyper-parameters: ``project`` (the project's lr 0.05, momentum 0.9,
batch 64), ``dgs`` (the paper's CIFAR-10 code defaults where they differ: lr 0.1; its momentum
0.9 and batch 64 are the project's too) and ``lr_x4`` (lr 0.2: about the step SAMomentum loses,
below). DGS's weight decay, 5e-4, is left out: the project's model carries its own
regularisation and both forms get the same gradient. ``dgs`` and ``lr_x4`` run at
``--dgs-blocks`` only.

Why a form trains slower, measured two ways:

- ``train_loss_per_epoch``: each run's mean training loss over the pushes of each epoch
  (its epoch records' ``train_loss``), beside its test accuracy: a form that trains slower
  has both worse.
- ``displacement``: the two policies themselves, fed one synthetic gradient stream (per
  entry a fixed mean plus noise ten times larger, one tensor of ``DISPLACEMENT["size"]``
  entries, ``steps`` steps at the case's uplink density) with what the server applies summed
  up. ``along``: the projection of that sum on the displacement of dense momentum SGD at the
  same lr and momentum (1: the same step; the rest is still in the residual or never sent);
  ``norm``: the ratio of their lengths.

Every run is a child process (its own Spark session on ``local[N]``), one after another. Each
records test accuracy per epoch, bytes up and down, pushes and the guard's counters. The summary
gives, per setting and N, each form's mean, sample standard deviation (ddof 1) and
``samomentum_minus_correction`` in points, with bytes per push of each form (equal bytes: the
same density, so the two forms send about the same).

    python bench/momentum.py [--blocks 2,4,8] [--seeds 2] [--epochs 3] [--settings project,dgs,lr_x4]
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

from bench._common import emit, ensure_data, exit_status, log  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASE = ["engine.transport=stream", "engine.mode=async", "train.steps_per_round=1",
        "compression.method=threshold", "compression.density=0.001", "compression.initial_density=0.25",
        "compression.warmup_epochs=1", "compression.dense_below=1000", "compression.clip_norm=2.0",
        "compression.factor_masking=false", "compression.density_down=0.01", "train.lr_warmup_epochs=0.3"]
FORMS = ("correction", "sparsification_aware")
SETTINGS = {"project": [], "dgs": ["train.lr=0.1", "train.momentum=0.9", "train.batch_size=64"],
            "lr_x4": ["train.lr=0.2"]}
# the synthetic gradient stream of displacement(): the case's density, the project's lr and momentum
DISPLACEMENT = {"size": 100_000, "steps": 1000, "density": 0.001, "lr": 0.05, "momentum": 0.9,
                "mean_sd": 0.1, "noise_sd": 1.0, "seed": 0}

# one run in a child: argv = data, out_dir, blocks, seed, epochs, then overrides; prints one JSON line
CHILD = r"""
import json, os, sys
from sparkcnn import config
from sparkcnn.errors import Diverged
from sparkcnn.metrics import read_jsonl
from sparkcnn.train import train
data, out_dir, blocks, seed, epochs, *over = sys.argv[1:]
cfg = config.load(None, [f"data.path={data}", f"run.out_dir={out_dir}", f"run.seed={seed}",
                         f"run.name=momentum-{blocks}-{seed}", f"train.epochs={epochs}",
                         f"data.num_blocks={blocks}", f"engine.master=local[{blocks}]", *over])
try:
    s = train(cfg, progress=None)
except Diverged as e:  # the guard stopped it: a result of the setting, not a failure of the bench
    print(json.dumps({"stopped": str(e).splitlines()[0], "test_accuracy": None}))
    sys.exit(0)
records = list(read_jsonl(os.path.join(s["run_dir"], "metrics.jsonl")))
rounds = [r for r in records if r["kind"] == "round"]
print(json.dumps({"test_accuracy": s["test_accuracy"], "accuracy_per_epoch": s["accuracy_per_epoch"],
                  "train_loss_per_epoch": [r["train_loss"] for r in records if r["kind"] == "epoch"],
                  "mean_staleness": sum(r["staleness"] for r in rounds) / max(1, len(rounds)),
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


def displacement(form: str, p: dict = DISPLACEMENT) -> dict:
    """What the server applies from ``form``'s policy over a synthetic gradient stream, against
    the displacement of dense momentum SGD on the same stream (see the module docstring)."""
    import numpy as np

    from sparkcnn.compression.feedback import make_policy, server_scale

    rng = np.random.default_rng(p["seed"])
    size, m, lr = p["size"], p["momentum"], p["lr"]
    mean = rng.normal(0.0, p["mean_sd"], size).astype(np.float32)
    policy = make_policy("threshold", form, True, (size,), "float32", 1000, m, masking=False)
    scale = server_scale("threshold", form, True, lr)
    applied, dense, u = (np.zeros(size, np.float32) for _ in range(3))
    for _ in range(p["steps"]):
        g = mean + rng.normal(0.0, p["noise_sd"], size).astype(np.float32)
        u = m * u + g
        dense += lr * u
        sent = policy.step(g, p["density"], lr=lr, weights=None)
        applied[sent.indices] += scale * sent.values
    return {"along": float(applied @ dense / (dense @ dense)),
            "norm": float(np.linalg.norm(applied) / np.linalg.norm(dense))}


def _mean_of(xs) -> float | None:
    """The mean, or None when any is missing (a run from before the field existed)."""
    xs = list(xs)
    return None if not xs or any(x is None for x in xs) else statistics.fmean(xs)


def _mean_sd(xs: list[float]) -> tuple[float, float | None]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)


def summarise(runs: list[dict]) -> list[dict]:
    rows = []
    for setting in dict.fromkeys(r["setting"] for r in runs):
        for n in sorted({r["blocks"] for r in runs if r["setting"] == setting}):
            row = {"setting": setting, "blocks": n}
            for form in FORMS:
                every = [r for r in runs if (r["setting"], r["blocks"], r["form"]) == (setting, n, form)]
                mine = [r for r in every if r["test_accuracy"] is not None]
                if not every:
                    continue
                if not mine:  # the guard stopped every seed
                    row[form] = {"mean": None, "sd": None, "seeds": 0, "stopped": len(every)}
                    continue
                mean, sd = _mean_sd([r["test_accuracy"] for r in mine])
                row[form] = {"mean": mean, "sd": sd, "seeds": len(mine), "stopped": len(every) - len(mine),
                             "accuracies": [r["test_accuracy"] for r in mine],
                             "final_train_loss": _mean_of(r.get("train_loss_per_epoch", [None])[-1] for r in mine),
                             "mean_staleness": _mean_of(r.get("mean_staleness") for r in mine),
                             "bytes_per_push": statistics.fmean((r["bytes_up"] + r["bytes_down"]) / max(1, r["pushes"])
                                                                for r in mine)}
            if all(f in row and row[f]["mean"] is not None for f in FORMS):
                row["samomentum_minus_correction_points"] = round(
                    100 * (row["sparsification_aware"]["mean"] - row["correction"]["mean"]), 2)
            rows.append(row)
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", default="2,4,8", help="comma-separated N")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--settings", default="project,dgs,lr_x4", help=f"comma-separated, of {sorted(SETTINGS)}")
    ap.add_argument("--dgs-blocks", default="8", help="the N the dgs and lr_x4 settings run at")
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
            log("%d/%d %s N=%d %s seed %d: %s (%.0f s)", k, len(plan), setting, n, form, seed,
                r.get("stopped") or f"test accuracy {r['test_accuracy']:.4f}", r["wall_s"])
    moved = {form: displacement(form) for form in FORMS}
    log("displacement along dense momentum SGD: %s", ", ".join(f"{f} {d['along']:.3f}" for f, d in moved.items()))
    out = {"case": CASE, "settings": {s: SETTINGS[s] for s in settings}, "epochs": a.epochs,
           "seeds": a.seeds, "runs": runs, "summary": summarise(runs),
           "displacement": {"stream": DISPLACEMENT, **moved}}
    emit(out, a.out)
    return out


if __name__ == "__main__":
    sys.exit(exit_status("momentum", main()))
