"""Throughput of sparkcnn sync rounds next to single-process Keras and the parallel compute limit.

Prints one JSON object. For steps_per_round H in (10, 50): sparkcnn images/s
(local[2], 2 blocks, fmnist_cnn, batch 64), ``ratio_vs_keras``,
``efficiency_vs_limit`` and ``round_overhead_ms`` (round wall time minus the
slowest task's compute). ``keras_images_per_s`` is ``model.fit`` in one
process (TF default threads); ``compute_limit_images_per_s`` is the sum of two
independent single-thread TF processes, each training its own half with no
communication. All figures come from this one run, measured one after another.

    python bench/throughput.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import KERAS_FIT, SOLO, emit, ensure_data, run_children  # noqa: E402


def measure_sparkcnn(data: str, H: int, rounds: int, extra: list[str] = ()) -> dict:
    from sparkcnn import config
    from sparkcnn.engine.backend import SparkBackend, get_or_create_spark
    from sparkcnn.train import build_engine, warm_up

    cfg = config.load(None, [f"data.path={data}", "data.num_blocks=2", f"train.steps_per_round={H}",
                             "train.batch_size=64", *extra])
    backend = SparkBackend(get_or_create_spark("local[2]", "sparkcnn-bench"), f"bench-h{H}")
    engine, _ = build_engine(cfg, backend, backend.run_id)
    warm_up(backend, engine.spec)
    engine.run_round(0)  # first round traces the TF functions in both workers
    recs = []
    t0 = time.perf_counter()
    for t in range(1, rounds + 1):
        recs.append(engine.run_round(t))
    wall = time.perf_counter() - t0
    samples = sum(r["samples"] for r in recs)
    overhead = sorted(1000 * r["round_overhead_s"] for r in recs)
    return {
        "sparkcnn_images_per_s": samples / wall,
        "round_overhead_ms": overhead[len(overhead) // 2],
        "round_compute_ms": 1000 * sum(r["compute_s"] for r in recs) / len(recs),
        "round_wall_ms": 1000 * wall / len(recs),
        "rounds": len(recs),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps (< 1 minute)")
    a = ap.parse_args(argv)
    data = ensure_data()
    steps = 100 if a.quick else 400
    limit = run_children(SOLO, [[data, "2", str(k), str(steps), "1"] for k in (0, 1)])
    limit_ips = sum(r["images_per_s"] for r in limit)
    keras_ips = run_children(KERAS_FIT, [[data, str(steps)]])[0]["images_per_s"]
    out = {"quick": a.quick, "model": "fmnist_cnn", "blocks": 2, "batch_size": 64, "master": "local[2]",
           "keras_images_per_s": keras_ips, "compute_limit_images_per_s": limit_ips,
           "solo_step_ms": [r["step_ms"] for r in limit], "by_steps_per_round": {}}
    for H in (10, 50):
        rounds = max(2, (steps // H) if a.quick else (2 * steps // H))
        m = measure_sparkcnn(data, H, rounds)
        m["ratio_vs_keras"] = m["sparkcnn_images_per_s"] / keras_ips
        m["efficiency_vs_limit"] = m["sparkcnn_images_per_s"] / limit_ips
        out["by_steps_per_round"][str(H)] = m
    out["targets"] = {"ratio_vs_keras@50": ">= 0.9", "efficiency_vs_limit@50": ">= 0.85"}
    emit(out)
    return out


if __name__ == "__main__":
    main()
