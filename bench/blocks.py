"""Seconds to build the cached data blocks of prepared Fashion-MNIST on local[2].

Each block is read by a Spark task straight from its Parquet row groups into one
contiguous uint8 array (Arrow buffers → numpy) and kept resident in the Python
worker and the executor's local directory. Prints one JSON object.

    python bench/blocks.py [--blocks 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import emit, ensure_data  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=2)
    a = ap.parse_args(argv)
    data = ensure_data()
    from sparkcnn.worker import blockstore
    from sparkcnn.backends.spark import SparkBackend
    from sparkcnn.backends.session import get_or_create_spark

    backend = SparkBackend(get_or_create_spark("local[2]", "sparkcnn-bench-blocks"), "bench-blocks")
    train_dir = os.path.abspath(os.path.join(data, "train"))
    backend.map_blocks(lambda b, ctx: os.getpid(), list(range(a.blocks)), "start python workers")
    run_id = f"blocks-{time.time_ns()}"

    def build(block, ctx):
        import sparkcnn.worker.jobs  # noqa: F401  (import cost as in a real task)
        t = time.perf_counter()
        x, y = blockstore.get_block(ctx.local_dir, run_id, "train", a.blocks, block,
                                    load=lambda: blockstore.read_block(train_dir, a.blocks, block))
        return {"block": block, "rows": int(len(y)), "bytes": int(x.nbytes + y.nbytes),
                "task_s": time.perf_counter() - t}

    t0 = time.perf_counter()
    res = backend.map_blocks(build, list(range(a.blocks)), "sparkcnn build blocks")
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = backend.map_blocks(build, list(range(a.blocks)), "sparkcnn reuse blocks")
    reuse_s = time.perf_counter() - t0
    out = {"blocks": a.blocks, "rows": sum(r["rows"] for r in res), "bytes": sum(r["bytes"] for r in res),
           "build_s": build_s, "max_task_build_s": max(r["task_s"] for r in res),
           "reuse_job_s": reuse_s, "max_task_reuse_s": max(r["task_s"] for r in again),
           "target": "build_s < 10"}
    emit(out)
    return out


if __name__ == "__main__":
    main()
