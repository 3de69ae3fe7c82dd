"""Throughput of sparkcnn on CIFAR-10-format data with ResNet-20: images/s and bytes per exchange.

THROUGHPUT ONLY. The real CIFAR-10 cannot be fetched where this runs, so the
data are generated in the exact CIFAR-10 binary format (``data_batch_1.bin`` …
``data_batch_5.bin``, ``test_batch.bin``: 3073-byte records, a label byte then
the R, G, B planes of a 32×32 image) from a fixed pattern per class plus
uniform noise, with a fixed seed. They go through the project's own
``prepare("cifar10-bin", ...)`` (the ``sparkcnn prepare`` step), so the bench
exercises the real reader path. Any accuracy on such data means nothing and
none is reported.

Made once beside the other bench data: ``cifar10-generated-bin/`` (the binary
batches) and ``cifar10-generated/`` (prepared); ``--quick`` trains on a slice of it.

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
kind of process: driver, jvm, workers, and their total) and the helper's other
figures under ``detail``. A mode that fails carries ``error`` and the others
still run.

Sizes (ResNet-20 trains ~100 images/s per single-thread core on an idle
machine here, about the same at batch 32 and 64, ~85 at 16, ~60 at 8; a
shared machine's load slows every figure alike): full, batch 32 on 6400
training rows (async: 20 jobs of ~10 steps, 10 in the steady window), about
4 minutes on 2 idle cores; ``--quick``, batch 8 on a 1280-row slice (16 jobs,
6 in the window), about 90 s.

    python bench/cifar.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import DATA, emit, log, slice_data  # noqa: E402
from bench.throughput import (  # noqa: E402
    BLOCKS,
    STREAM_SPARSE,
    _engine,
    measure_async,
    measure_sparkcnn,
    measure_stream,
)

GEN_BIN = os.path.join(os.path.dirname(DATA), "cifar10-generated-bin")
GEN = os.path.join(os.path.dirname(DATA), "cifar10-generated")
SEED = 20240601
TRAIN_BATCHES = 5  # data_batch_1.bin … data_batch_5.bin, as published
H = 10
# full / quick: batch size (images per step per block), rows, measured sync rounds (after 1 warm)
SIZES = {False: {"batch": 32, "train_rows": 6400, "test_rows": 1000, "sync_rounds": 4},
         True: {"batch": 8, "train_rows": 1280, "test_rows": 160, "sync_rounds": 2}}
MODEL = ["model.name=resnet20"]


def generated_images(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """uint8 (N, 32, 32, 3) HWC: ``30 + 160 * pattern[label] + noise``, noise uniform in 0..65.

    ``pattern[c]``: class ``c``'s colours in [0, 1] on an 8×8 grid of 4×4-pixel
    cells, drawn from ``rng`` first (so one seed fixes patterns and noise)."""
    coarse = rng.random((10, 8, 8, 3))
    patterns = np.kron(coarse, np.ones((1, 4, 4, 1)))  # (10, 32, 32, 3)
    noise = rng.integers(0, 66, size=(len(labels), 32, 32, 3))
    return (30 + 160 * patterns[labels] + noise).astype(np.uint8)  # max 30 + 160 + 65 = 255


def write_generated_cifar(out: str, train_rows: int, test_rows: int, seed: int = SEED) -> str:
    """Write a CIFAR-10 binary directory at ``out``: ``train_rows`` records over the five
    ``data_batch_*.bin``, ``test_rows`` in ``test_batch.bin``, and ``batches.meta.txt``.

    Labels cycle 0..9 and are shuffled, so each class has ``rows / 10`` records (±1);
    the same arguments give the same bytes."""
    from sparkcnn.data.cifar import CIFAR10_CLASSES
    from sparkcnn.data.synthetic import write_cifar_bin

    if train_rows < TRAIN_BATCHES:
        raise ValueError(f"train_rows must be >= {TRAIN_BATCHES} (one per data_batch file), got {train_rows}")
    if test_rows < 1:
        raise ValueError(f"test_rows must be >= 1, got {test_rows}")
    rng = np.random.default_rng(seed)
    os.makedirs(out, exist_ok=True)

    def labels_of(n):
        y = (np.arange(n) % 10).astype(np.uint8)
        rng.shuffle(y)
        return y

    y_train, y_test = labels_of(train_rows), labels_of(test_rows)
    x_train, x_test = np.split(generated_images(np.concatenate([y_train, y_test]), rng), [train_rows])
    for k, idx in enumerate(np.array_split(np.arange(train_rows), TRAIN_BATCHES), start=1):
        write_cifar_bin(os.path.join(out, f"data_batch_{k}.bin"), x_train[idx], y_train[idx])
    write_cifar_bin(os.path.join(out, "test_batch.bin"), x_test, y_test)
    with open(os.path.join(out, "batches.meta.txt"), "w", encoding="utf-8") as f:
        f.write("".join(name + "\n" for name in CIFAR10_CLASSES))
    return out


def ensure_cifar(train_rows: int, test_rows: int) -> str:
    """The prepared generated dataset with these row counts, generated and prepared on first use."""
    from sparkcnn.data.parquet_io import read_meta
    from sparkcnn.data.prepare import prepare

    try:
        if (read_meta(os.path.join(GEN, "train")).num_rows, read_meta(os.path.join(GEN, "test")).num_rows) \
                == (train_rows, test_rows):
            return GEN
    except Exception:  # noqa: BLE001 - absent or unreadable: make it again
        pass
    log("generating CIFAR-10 binary batches (%d train, %d test rows) in %s", train_rows, test_rows, GEN_BIN)
    tmp = f"{GEN_BIN}.tmp-{os.getpid()}"
    write_generated_cifar(tmp, train_rows, test_rows)
    shutil.rmtree(GEN_BIN, ignore_errors=True)  # rows changed: the old batches go
    try:
        os.rename(tmp, GEN_BIN)
    except OSError:  # another bench made it meanwhile (same seed: same bytes)
        shutil.rmtree(tmp, ignore_errors=True)
    log("prepare cifar10-bin -> %s", GEN)
    prepare("cifar10-bin", GEN_BIN, GEN)
    return GEN


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
    return {"images_per_s": r.pop("sparkcnn_images_per_s"), "bytes_up_per_exchange": r.pop("bytes_up_per_round"),
            "bytes_down_per_exchange": r.pop("bytes_down_per_round"), "steps_per_exchange": H,
            "blocks_per_exchange": BLOCKS, "cpu_ms_per_round": r.pop("cpu_ms_per_round"), "detail": r}


def _async(data: str, target_job_s: float, extra: list[str]) -> dict:
    r = measure_async(data, H, target_job_s, extra)
    return {"images_per_s": r.pop("images_per_s"), "bytes_up_per_exchange": r.pop("bytes_up_per_job"),
            "bytes_down_per_exchange": r.pop("bytes_down_per_job"),
            "steps_per_exchange": r.pop("mean_steps_per_job"), "blocks_per_exchange": 1,
            "cpu_ms_per_round": r.pop("cpu_ms_per_round"), "detail": r}


def _stream(data: str, h: int, extra: list[str]) -> dict:
    r = measure_stream(data, h, "async", extra)
    if "error" in r:
        return r
    r.pop("test_accuracy", None)  # generated data: not a result
    r.pop("mode", None)  # "async": the mode's name says so
    return {"images_per_s": r.pop("images_per_s"), "bytes_up_per_exchange": r.pop("bytes_up_per_exchange"),
            "bytes_down_per_exchange": r.pop("bytes_down_per_exchange"),
            "steps_per_exchange": r.pop("steps_per_exchange"), "blocks_per_exchange": 1,
            "cpu_ms_per_round": r.pop("cpu_ms_per_round"), "detail": r}


def _parameters() -> int:
    """P: floats in ResNet-20's weight vector (BatchNorm moving statistics included), as exchanged."""
    from sparkcnn.models import build_model

    return int(build_model("resnet20", (32, 32, 3), 10, 0).count_params())


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="batch 8 on a 1280-row slice, about 90 s")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    full, size = SIZES[False], SIZES[a.quick]
    data = ensure_cifar(full["train_rows"], full["test_rows"])
    if a.quick:
        data = slice_data(data, size["train_rows"], size["test_rows"])
    common = [*MODEL, f"train.batch_size={size['batch']}"]
    out = {"benchmark": "cifar", "throughput_only": True,
           "dataset": "CIFAR-10 binary format, generated: throughput only",
           "note": "generated class patterns plus noise; accuracy on them means nothing and is not reported",
           "model": "resnet20", "parameters": None, "train_rows": size["train_rows"],
           "test_rows": size["test_rows"], "batch_size": size["batch"], "blocks": BLOCKS,
           "master": "local[2]", "quick": a.quick, "seed": SEED, "modes": []}
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
        modes.append(_mode(f"stream_async_h{h}_sparse", lambda h=h: _stream(data, h, [*common, *STREAM_SPARSE])))
    out["parameters"] = _parameters()  # after the engines: TF is imported here by then
    out["bench_wall_s"] = time.perf_counter() - t_start
    emit(out)
    return out


if __name__ == "__main__":
    main()
