"""The ASGD downlink's cadence: one downlink per ceil(N / 2) applied pushes against one per push.

Prints one JSON object. GS-ASGD + MS on the stream at one step per exchange (bench/accuracy.py's
``stream-gs-asgd-ms`` settings: uplink 0.001 and downlink 0.01 after the project's sparse
warm-up) on N = 4 and 8 blocks (``local[N]``, one Python worker per block on this machine's
cores: slower than a cluster, which accuracy does not mind), ``--epochs`` epochs, one seed,
each N with:

- ``cadence``: the exchange core as it is (a downlink once every ceil(N / 2) applied pushes);
- ``every_push``: the same run with a downlink after every applied push
  (``ps.downlink_every=1``), the rule before the cadence.

Each run records its test accuracy per epoch, bytes down per step (what replies carried),
images/s and the replica resyncs. The check (``passed``): at every N the cadence ends within
``--slack`` (0.5) points of every-push, or above it. Exit 0 when it holds, 1 otherwise.

    python bench/cadence.py [--blocks 4 8] [--epochs 2] [--slack 0.5] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import EXIT_MISSED, emit, ensure_data, log  # noqa: E402
from bench.accuracy import BIDIR, STREAM_SPARSE, run_variant  # noqa: E402

SEED = 42


def _stop_session() -> None:
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        active.stop()


def run(data: str, blocks: int, variant: str, epochs: int, out_dir: str) -> dict:
    overrides = [*STREAM_SPARSE, *BIDIR, f"data.num_blocks={blocks}", f"engine.master=local[{blocks}]",
                 f"run.seed={SEED}", *(["ps.downlink_every=1"] if variant == "every_push" else [])]
    r = run_variant(data, f"cadence-{blocks}-{variant}", overrides, epochs, out_dir)
    steps = r["steps"] or 1
    from sparkcnn.server.exchange import downlink_cadence

    every = downlink_cadence(1 if variant == "every_push" else 0, blocks)
    return {"blocks": blocks, "variant": variant, "downlink_every": every,
            "test_accuracy": r["test_accuracy"], "accuracy_per_epoch": r["accuracy_per_epoch"],
            "images_per_s": r["images_per_s"], "bytes_down_per_step": r["bytes_down"] / steps,
            "bytes_up_per_step": r["bytes_up"] / steps, "replica_resyncs": r["replica_resyncs"], "steps": steps,
            "overrides": overrides, "config_sha256": r.get("config_sha256")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=int, nargs="+", default=[4, 8])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--slack", type=float, default=0.5, help="points the cadence may end below every-push")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if any(n < 3 for n in args.blocks) or args.epochs < 1:
        print("cadence: --blocks must be >= 3 (below, the cadence is every push) and --epochs >= 1",
              file=sys.stderr)
        return 2
    data = ensure_data()
    out_dir = tempfile.mkdtemp(prefix="sparkcnn-cadence-")
    runs, checks = [], {}
    try:
        for n in args.blocks:
            _stop_session()  # local[N] for this N
            got = {}
            for variant in ("cadence", "every_push"):
                log("cadence: N = %d, %s", n, variant)
                got[variant] = run(data, n, variant, args.epochs, out_dir)
                log("  test accuracy %.4f, %.0f bytes down per step", got[variant]["test_accuracy"],
                    got[variant]["bytes_down_per_step"])
                runs.append(got[variant])
            diff = 100 * (got["cadence"]["test_accuracy"] - got["every_push"]["test_accuracy"])
            checks[f"n{n}_cadence_within_{args.slack}_points"] = {"points": diff, "ok": diff >= -args.slack}
        _stop_session()
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    passed = all(c["ok"] for c in checks.values())
    emit({"bench": "cadence", "epochs": args.epochs, "seed": SEED, "runs": runs, "checks": checks,
          "passed": passed}, args.out)
    return 0 if passed else EXIT_MISSED


if __name__ == "__main__":
    sys.exit(main())
