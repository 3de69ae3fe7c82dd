"""What ``data.augment=crop_flip`` costs in the executors' input path: per minibatch, against the
step time, with the test accuracy of the same runs.

Two runs of one configuration, one after the other in this process (``engine.master`` is
``inprocess`` by default: the blocks train in turn here, each step alone on the machine), sync
rounds of H local steps with dense deltas: ``data.augment=none`` then ``data.augment=crop_flip``.
Then, on the same training images, the augmentation alone: what a task runs for each minibatch
once it is gathered (:class:`sparkcnn.data.augment.BatchAugment`: the generator of its (seed,
block, epoch, step), then the pad, crop and flip in place), timed over ``--batches`` minibatches
of the run's batch size.

Per run, from its records (``metrics.jsonl``): ``step_ms``, the median over rounds (the first
left out: tracing) of the blocks' compute time (``task_compute_s``: the steps, augmentation
included, and the delta) per local step; its final ``test_accuracy`` and per epoch, images/s and
wall time. Then ``augment_ms_per_batch`` (median, and p90), ``share_of_step`` (that over the
crop_flip run's ``step_ms``; the target is under ``TARGET``) and ``share_in_run`` (the runs' step
time difference over the crop_flip run's; noisy on short runs).

Data: ``--data`` (a prepared dataset; default Fashion-MNIST, made on first use, its first
``--train-rows``/``--test-rows`` rows); ``--tiny``: the tests' synthetic Fashion-MNIST look-alike
(1,200 training and 400 test images, 28x28x1), prepared in a temporary directory with its
per-channel statistics, so both runs also take ``data.normalize=dataset``: seconds per run.
``--set section.key=value`` adds settings (``model.name=resnet20`` on a CIFAR-10 dataset). Prints
one JSON object; exits 3 when ``share_of_step`` is not under the target.

    python bench/augment.py [--tiny] [--data DIR] [--epochs 2] [--batches 200] [--set KEY=VALUE ...]
                             [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import EXIT_MISSED, config_of, emit, ensure_data, log, portable_path, slice_data  # noqa: E402

TARGET = 0.10  # augmentation's share of a step it must stay under
BASE = ["engine.master=inprocess", "engine.mode=sync", "compression.method=none", "train.lr_warmup_epochs=0",
        "train.lr_schedule=constant", "data.num_blocks=2", "data.test_blocks=1"]
SIZES = {False: ["train.batch_size=64", "train.steps_per_round=10"],
         True: ["train.batch_size=32", "train.steps_per_round=5"]}


def tiny_data(root: str) -> str:
    from sparkcnn.data.prepare import prepare
    from sparkcnn.data.synthetic import make_fake_fashion

    out = os.path.join(root, "prepared")
    prepare("idx", make_fake_fashion(os.path.join(root, "raw"), 1200, 400, seed=3), out)
    return out


def step_ms(run_dir: str) -> float:
    """Median over the run's rounds but the first of its blocks' compute ms per local step."""
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as fh:
        rounds = [r for r in map(json.loads, fh) if r["kind"] == "round"]
    per = [1000 * sum(r["task_compute_s"].values()) / (r["steps"] * r["blocks"])
           for r in rounds[1:] if r["steps"]]
    return statistics.median(per)


def augment_cost(images: np.ndarray, batch: int, seed: int, batches: int) -> dict:
    """ms per minibatch of a task's augmentation (module docstring), on random minibatches of ``images``."""
    from sparkcnn.data.augment import batch_augment

    aug = batch_augment("crop_flip", seed, 0, [(0, s) for s in range(batches)])
    buf = np.empty((batch, *images.shape[1:]), images.dtype)
    pick = np.random.default_rng(seed)
    times = []
    for i in range(batches):
        np.take(images, pick.integers(0, len(images), batch), axis=0, out=buf)
        t = time.perf_counter()
        aug(i, buf)
        times.append(1000 * (time.perf_counter() - t))
    return {"median": statistics.median(times), "p90": float(np.percentile(times, 90)), "batches": batches}


def run(cfg) -> dict:
    from sparkcnn.train import train

    s = train(cfg)
    log("augment=%s: test accuracy %.4f in %.1f s", cfg.data.augment, s["test_accuracy"], s["wall_s"])
    return {"step_ms": step_ms(s["run_dir"]), "test_accuracy": s["test_accuracy"],
            "accuracy_per_epoch": s["accuracy_per_epoch"], "images_per_s": s["images_per_s"],
            "wall_s": s["wall_s"], "rounds": s["rounds"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="the tests' synthetic 1,200-image set")
    ap.add_argument("--data", help="a prepared dataset (default: Fashion-MNIST)")
    ap.add_argument("--train-rows", type=int, default=12000)
    ap.add_argument("--test-rows", type=int, default=2000)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batches", type=int, default=200, help="minibatches the augmentation alone is timed on")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", help="also write the JSON here")
    a = ap.parse_args(argv)
    if a.epochs < 1 or a.batches < 1:
        ap.error("--epochs and --batches must be >= 1")
    from sparkcnn import config
    from sparkcnn.data.parquet_io import read_split_numpy

    with tempfile.TemporaryDirectory(prefix="sparkcnn-bench-augment-") as tmp:
        if a.tiny:
            data, extra = tiny_data(tmp), ["data.normalize=dataset"]
        else:
            data, extra = a.data or slice_data(ensure_data(), a.train_rows, a.test_rows), []
        common = [f"data.path={data}", f"run.out_dir={tmp}/runs", f"train.epochs={a.epochs}", *BASE,
                  *SIZES[a.tiny], *extra, *a.overrides]
        cfgs = {name: config.load(None, [*common, f"data.augment={name}"]) for name in ("none", "crop_flip")}
        runs = {name: run(cfg) for name, cfg in cfgs.items()}
        cfg = cfgs["crop_flip"]
        images, _ = read_split_numpy(os.path.join(data, "train"))
        cost = augment_cost(images, cfg.train.batch_size, cfg.run.seed, a.batches)
    step = runs["crop_flip"]["step_ms"]
    share = cost["median"] / step
    out = {"data": portable_path(data), "tiny": a.tiny, "image_shape": list(images.shape[1:]),
           "batch_size": cfg.train.batch_size, "steps_per_round": cfg.train.steps_per_round,
           "model": cfg.model.name, "normalize": cfg.data.normalize,
           "augment_ms_per_batch": round(cost["median"], 4),
           "augment_ms_per_batch_p90": round(cost["p90"], 4),
           "augment_batches_timed": cost["batches"], "runs": runs,
           "share_of_step": round(share, 4),
           "share_in_run": round((step - runs["none"]["step_ms"]) / step, 4),
           "target_share": TARGET, "within_target": share < TARGET, **config_of(cfg)}
    emit(out, a.out)
    return 0 if share < TARGET else EXIT_MISSED


if __name__ == "__main__":
    sys.exit(main())
