"""Throughput of sparkcnn on CIFAR-10 (JPEG copy) with ResNet-20: images/s, bytes per exchange and
the test accuracy each mode reached.

The data are the real CIFAR-10 as ``make data-cifar10`` prepares it (``data/cifar10``, or
``--data``): 60,000 JPEG files of the public copy, decoded once, so every figure is labelled
"CIFAR-10 (JPEG copy)". The prepared splits hold the images class by class, so the bench trains
on a seeded random sample of them (every class in it, the split's pixel statistics kept), made
once beside the data: ``<data>-sample-<train>-<test>``.

Modes, each measured one after another on one local[2] session with the
helpers of ``bench/throughput.py`` (2 blocks; ``model.name=resnet20``):

- ``sync_h10_dense``, ``sync_h10_sparse``: plain sync rounds of H = 10 steps
  (``engine.run_round``) after one warm round; sparse = uplink density 0.001,
  downlink 0.01, no warm-up (``STREAM_SPARSE``).
- ``async_jobs_h10_dense``: ``AsyncEngine.run()`` over one epoch, 4 blocks,
  jobs sized to the measured compute time of 10 steps (as ``throughput.py``).
- ``stream_async_h1_sparse``, ``stream_async_h10_sparse``: ``StreamEngine.run()``
  over one epoch, async, H = 1 and 10, ``STREAM_SPARSE``.

Per mode: ``images_per_s``, ``bytes_up_per_exchange`` and
``bytes_down_per_exchange`` (an exchange: a sync round of every block, an
async job or a stream push of one block: ``blocks_per_exchange``),
``steps_per_exchange`` (per block), ``cpu_ms_per_round`` (CPU ms per exchange by
kind of process: driver, jvm, workers, and their total), ``test_accuracy`` (of the
weights the mode reached, on the sample's test rows) and the helper's other figures under
``detail``. A speed figure counts only if its run trained: ``trained`` is a test accuracy of at
least ``TRAINED_AT_LEAST``, the gate of the bench's one target (every mode trained; none with
``--quick``), whose miss is the bench's exit status. A mode that fails carries ``error`` and the
others still run.

Sizes (ResNet-20 trains ~100 images/s per single-thread core on an idle
machine here): full, batch 32 on 6,400 training rows (sync: 10 rounds after a warm one; async: 20
jobs of ~10 steps, 10 in the steady window), about 4 minutes on 2 idle cores; ``--quick``, batch 8
on 1,280 rows, about 90 s.

    python bench/cifar.py [--quick] [--data DIR] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import ROOT, emit, exit_status, log  # noqa: E402
from bench.throughput import (  # noqa: E402
    BLOCKS,
    STREAM_SPARSE,
    _engine,
    measure_async,
    measure_sparkcnn,
    measure_stream,
)

CIFAR = os.path.join(ROOT, "data", "cifar10")  # what `make data-cifar10` prepares
DATASET = "CIFAR-10 (JPEG copy)"
SEED = 20240601  # the sample's rows
H = 10
# a mode trained when its test accuracy is at least this: chance is 0.10, and every mode sees at
# least 6,400 images (the sync modes' 10 rounds after a warm one; the others one epoch of the sample)
TRAINED_AT_LEAST = 0.15
# full / quick: batch size (images per step per block), rows, measured sync rounds (after 1 warm)
# (full: 10 measured sync rounds, as ResNet-20's dense sync rounds test at chance after 4: 0.092, and
# reach 0.188 after 10, on one run each)
SIZES = {False: {"batch": 32, "train_rows": 6400, "test_rows": 1000, "sync_rounds": 10},
         True: {"batch": 8, "train_rows": 1280, "test_rows": 160, "sync_rounds": 2}}
MODEL = ["model.name=resnet20"]


def sample_cifar(src: str, train_rows: int, test_rows: int, seed: int = SEED) -> str:
    """A seeded random sample of a prepared dataset's splits (rows in ascending order, so every class
    is in it however the splits are ordered), with the train split's pixel statistics, made once
    beside ``src``: ``<src>-sample-<train>-<test>``."""
    from sparkcnn.data.parquet_io import META_MEAN, META_STD, read_meta, read_split_numpy, write_split

    out = f"{os.path.normpath(src)}-sample-{train_rows}-{test_rows}"
    if os.path.isdir(os.path.join(out, "test")):
        return out
    rng = np.random.default_rng(seed)
    tmp = f"{out}.tmp-{os.getpid()}"
    for split, rows in (("train", train_rows), ("test", test_rows)):
        meta = read_meta(os.path.join(src, split))
        x, y = read_split_numpy(os.path.join(src, split))
        keep = np.sort(rng.choice(len(y), size=min(rows, len(y)), replace=False))
        extra = {k: json.dumps(list(v)) for k, v in ((META_MEAN, meta.mean), (META_STD, meta.std)) if v}
        write_split(os.path.join(tmp, split), x[keep], y[keep], meta.classes, extra=extra)
    try:
        os.rename(tmp, out)
    except OSError:  # another bench made it meanwhile (same seed: same rows)
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def prepared(path: str) -> str | None:
    """Why ``path`` is not a prepared CIFAR-10, or None."""
    from sparkcnn.data.parquet_io import read_meta

    try:
        meta = read_meta(os.path.join(path, "train"))
        read_meta(os.path.join(path, "test"))
    except Exception:  # noqa: BLE001 - absent or unreadable
        return "no prepared CIFAR-10 there: run `make data-cifar10` (or pass --data)"
    if (meta.height, meta.width, meta.channels, len(meta.classes)) != (32, 32, 3, 10):
        return f"not CIFAR-10: {meta.height}x{meta.width}x{meta.channels} images, {len(meta.classes)} classes"
    return None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _mode(name: str, measure) -> dict:
    """Run one mode's measurement; ``measure()`` returns the mode's figures (or ``error``)."""
    log("%s ...", name)
    t0 = time.perf_counter()
    try:
        m = measure()
    except Exception as e:  # noqa: BLE001 - a failed mode is reported, the others still run
        m = {"error": _first_line(e)}
    if "error" in m:
        log("%s failed: %s", name, m["error"])
        return {"mode": name, "error": m["error"]}
    m["bench_wall_s"] = time.perf_counter() - t0
    log("%s: %.1f images/s, %.0f B up, %.0f B down per exchange (%.0f s)", name, m["images_per_s"],
        m["bytes_up_per_exchange"], m["bytes_down_per_exchange"], m["bench_wall_s"])
    return {"mode": name, **m}


def _sync(data: str, name: str, rounds: int, extra: list[str]) -> dict:
    engine = _engine(data, f"cifar-{name}", [f"train.steps_per_round={H}", *extra])
    r = measure_sparkcnn(data, H, rounds, extra, warm_rounds=1, engine=engine)
    return {"images_per_s": r.pop("sparkcnn_images_per_s"), "test_accuracy": r.pop("test_accuracy", None),
            "bytes_up_per_exchange": r.pop("bytes_up_per_round"),
            "bytes_down_per_exchange": r.pop("bytes_down_per_round"), "steps_per_exchange": H,
            "blocks_per_exchange": BLOCKS, "cpu_ms_per_round": r.pop("cpu_ms_per_round"), "detail": r}


def _async(data: str, target_job_s: float, extra: list[str]) -> dict:
    r = measure_async(data, H, target_job_s, extra)
    return {"images_per_s": r.pop("images_per_s"), "test_accuracy": r.pop("test_accuracy", None),
            "bytes_up_per_exchange": r.pop("bytes_up_per_job"),
            "bytes_down_per_exchange": r.pop("bytes_down_per_job"),
            "steps_per_exchange": r.pop("mean_steps_per_job"), "blocks_per_exchange": 1,
            "cpu_ms_per_round": r.pop("cpu_ms_per_round"), "detail": r}


def _stream(data: str, h: int, extra: list[str]) -> dict:
    r = measure_stream(data, h, "async", extra)
    if "error" in r:
        return r
    r.pop("mode", None)  # "async": the mode's name says so
    return {"images_per_s": r.pop("images_per_s"), "test_accuracy": r.pop("test_accuracy", None),
            "bytes_up_per_exchange": r.pop("bytes_up_per_exchange"),
            "bytes_down_per_exchange": r.pop("bytes_down_per_exchange"),
            "steps_per_exchange": r.pop("steps_per_exchange"), "blocks_per_exchange": 1,
            "cpu_ms_per_round": r.pop("cpu_ms_per_round"), "detail": r}


def _parameters() -> int:
    """P: floats in ResNet-20's weight vector (BatchNorm moving statistics included), as exchanged."""
    from sparkcnn.models import build_model

    return int(build_model("resnet20", (32, 32, 3), 10, 0).count_params())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="batch 8 on a 1280-row sample, about 90 s")
    ap.add_argument("--data", default=CIFAR, help="a prepared CIFAR-10 (default: make data-cifar10's)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    a = ap.parse_args(argv)
    why = prepared(a.data)
    if why:
        print(f"cifar: {a.data}: {why}", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    size = SIZES[a.quick]
    data = sample_cifar(a.data, size["train_rows"], size["test_rows"])
    common = [*MODEL, f"train.batch_size={size['batch']}"]
    out = {"benchmark": "cifar", "dataset": DATASET, "model": "resnet20", "parameters": None,
           "train_rows": size["train_rows"], "test_rows": size["test_rows"], "batch_size": size["batch"],
           "blocks": BLOCKS, "master": "local[2]", "quick": a.quick, "seed": SEED,
           "trained_at_least": TRAINED_AT_LEAST, "modes": []}
    modes = out["modes"]
    modes.append(_mode("sync_h10_dense", lambda: _sync(data, "sync-h10-dense", size["sync_rounds"], common)))
    modes.append(_mode("sync_h10_sparse", lambda: _sync(data, "sync-h10-sparse", size["sync_rounds"],
                                                        [*common, *STREAM_SPARSE])))
    # async jobs carry ~H steps: target = one block's compute time for H steps, measured in sync
    target = modes[0].get("detail", {}).get("block_compute_ms")

    def run_async():
        if target is None:
            raise RuntimeError("no job size: sync_h10_dense gave no block_compute_ms")
        return _async(data, target / 1000, common)

    modes.append(_mode("async_jobs_h10_dense", run_async))
    for h in (1, 10):
        modes.append(_mode(f"stream_async_h{h}_sparse",
                           lambda h=h: _stream(data, h, [*common, *STREAM_SPARSE])))
    for m in modes:
        acc = m.get("test_accuracy")
        m["trained"] = isinstance(acc, float) and acc >= TRAINED_AT_LEAST
    if not a.quick:  # --quick trains a few hundred images: too few for the gate, so no target
        out["target"] = {"trained_at_least": TRAINED_AT_LEAST, "met": all(m["trained"] for m in modes)}
    out["parameters"] = _parameters()  # after the engines: TF is imported here by then
    out["bench_wall_s"] = time.perf_counter() - t_start
    emit(out, a.out)
    return exit_status("cifar")


if __name__ == "__main__":
    sys.exit(main())
