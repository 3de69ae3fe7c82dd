"""How often async training at one step per exchange collapses on a tiny learnable set, by setting.

The stream's ASGD at H = 1 on the tests' synthetic Fashion-MNIST look-alike (1,200 training rows,
400 test rows, 2 blocks on local[2]), 4 epochs at a constant lr of 0.05 without warm-up, run
``--runs`` times per variant in one Spark session. On Spark the blocks push concurrently, so the
staleness (about 3) and the order of pushes differ from run to run; in process (blocks in turn)
the same settings did not collapse. A run "collapsed" when it ends at or below 0.2 test accuracy
(chance is 0.1). Variants:

- ``sparse``: uplink threshold 0.01, downlink 0.05 (the shard and stream tests' setting), without
  DGC's local gradient clipping (``compression.clip_norm=0``);
- ``sparse-clip``: the same with the clipping at its default (``compression.clip_norm=2``);
- ``dense``: dense both ways (the clipping belongs to the sparse per-step form; dense ignores it);
- ``dense-inverse``: dense, with updates damped by 1/tau (``ps.staleness=inverse``) on top of the
  lookahead.

Prints one JSON object: ``{"variants": {name: {"accuracies", "collapsed", ...}}, "provenance"}``.

    python bench/tinyasync.py [--runs 30] [--variants sparse,dense] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import config_of, emit, log  # noqa: E402

BASE = ["train.epochs=4", "train.batch_size=32", "train.steps_per_round=1", "train.lr=0.05",
        "train.lr_warmup_epochs=0", "train.lr_schedule=constant", "engine.mode=async",
        "engine.transport=stream"]
SPARSE = ["compression.method=threshold", "compression.density=0.01", "compression.density_down=0.05"]
VARIANTS = {"sparse": [*SPARSE, "compression.clip_norm=0"], "sparse-clip": SPARSE, "dense": [],
            "dense-inverse": ["ps.staleness=inverse"]}
COLLAPSED = 0.2  # at or below: a collapsed run (chance is 0.1)


def tiny_data(root: str) -> str:
    from sparkcnn.data.prepare import prepare
    from sparkcnn.data.synthetic import make_fake_fashion

    out = os.path.join(root, "prepared")
    prepare("idx", make_fake_fashion(os.path.join(root, "raw"), 1200, 400, seed=3), out)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=30, help="runs per variant")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS))
    ap.add_argument("--out", help="also write the JSON here")
    a = ap.parse_args(argv)
    names = [v for v in a.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"bench/tinyasync.py: --variants {','.join(unknown)}: not one of {', '.join(VARIANTS)}")
    from sparkcnn import config
    from sparkcnn.backends.spark import SparkBackend
    from sparkcnn.backends.session import get_or_create_spark
    from sparkcnn.train import train

    out = {"base": BASE, "runs_per_variant": a.runs, "collapsed_at_or_below": COLLAPSED, "variants": {}}
    with tempfile.TemporaryDirectory(prefix="sparkcnn-tinyasync-") as tmp:
        data = tiny_data(tmp)
        spark = get_or_create_spark("local[2]", app_name="bench-tinyasync")
        try:
            for name in names:
                cfg = config.load(None, [f"data.path={data}", f"run.out_dir={tmp}/runs", *BASE, *VARIANTS[name]])
                acc, t0 = [], time.perf_counter()
                for i in range(a.runs):
                    s = train(cfg, backend=SparkBackend(spark, f"tinyasync-{name}-{i}"), progress=None)
                    acc.append(s["test_accuracy"])
                log("%s: %d of %d collapsed", name, sum(x <= COLLAPSED for x in acc), len(acc))
                out["variants"][name] = {
                    "settings": VARIANTS[name], "accuracies": acc,
                    "collapsed": sum(x <= COLLAPSED for x in acc), "median": statistics.median(acc),
                    "min": min(acc), "wall_s": round(time.perf_counter() - t0, 1), **config_of(cfg)}
        finally:
            spark.stop()
    emit(out, a.out)
    return out


if __name__ == "__main__":
    main()
