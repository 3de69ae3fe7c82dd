"""Side by side with a peer at one step per exchange: Elephas's per-batch asynchronous training.

One epoch of Fashion-MNIST on ``local[2]``, the same model (``fmnist_cnn``), batch 64, SGD with
momentum 0.9 at lr 0.05, for:

- ``elephas``: Elephas 7.3 ``AsynchronousSparkModel`` with ``frequency="batch"`` (each worker
  GETs the weights and POSTs its delta over HTTP around every batch), 2 workers, constant lr;
  a subprocess in Elephas's own virtual environment (it pins pyspark 4.0, numpy < 2 and
  TensorFlow 2.19, which cannot share sparkcnn's);
- ``stream-asgd``: sparkcnn's stream, async, H = 1, dense both ways;
- ``stream-gs-asgd-ms``: the same with GS-ASGD + model-parameter sparsification (uplink 0.001
  with the project's density warm-up, downlink 0.01, DGC clipping),

each with its own defaults of schedule (sparkcnn: lr warm-up over 0.3 epoch, cosine decay).
The three run back to back, ``--reps`` (5) times in turn, so all share the machine's state of
the moment; every run records its images/s (training set over training wall time, start-up
and the final evaluation left out) and its test accuracy after the epoch.

Targets (``checks``), on the medians over the repetitions: each sparkcnn variant at >= 1.2 x
Elephas's images/s, and at test accuracy >= Elephas's minus 0.005 (equal within a seed's noise).

Elephas's environment: ``--elephas-python`` (default ``$SPARKCNN_ELEPHAS_PYTHON``, else
``.bench-venvs/elephas/bin/python`` in the repository); ``--setup`` creates it there with pip
(PyPI: ``elephas==7.3.0 tensorflow-cpu==2.19.* pyspark==4.0.0 "numpy<2" flask==2.3.3
h5py==3.11.0 cython==0.29.33``). Without it the JSON says ``"elephas": {"absent": ...}`` and
the checks fail.

Output: one JSON object (``runs``, ``medians``, ``checks``, ``passed``, ``provenance``). Exit 0
when every check holds, 1 otherwise, 2 on bad arguments.

    python bench/peers.py [--reps 5] [--train-rows N --test-rows N] [--elephas-python PATH] [--setup]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import ROOT, emit, ensure_data, log, portable_path, slice_data  # noqa: E402
from bench.accuracy import BIDIR, STREAM, STREAM_SPARSE, run_variant  # noqa: E402

ELEPHAS_VENV = os.path.join(ROOT, ".bench-venvs", "elephas")
ELEPHAS_REQUIREMENTS = ["elephas==7.3.0", "tensorflow-cpu==2.19.*", "pyspark==4.0.0", "numpy<2", "flask==2.3.3",
                        "h5py==3.11.0", "cython==0.29.33"]
SPARKCNN = {"stream-asgd": STREAM, "stream-gs-asgd-ms": [*STREAM_SPARSE, *BIDIR]}
LR, MOMENTUM, BATCH = 0.05, 0.9, 64
SPEED_TARGET, ACCURACY_SLACK = 1.2, 0.005

# Elephas's run, in its own interpreter: the prepared splits as .npy arrays (written by
# ``_arrays``), the same Keras model, one epoch of per-batch asynchronous training; prints one JSON line.
ELEPHAS = r"""
import json, os, sys, time
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np, keras
from keras import layers
from pyspark import SparkConf, SparkContext
from elephas.spark_model import AsynchronousSparkModel
from elephas.utils.rdd_utils import to_simple_rdd

arrays, lr, momentum, batch, seed = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
x, y, xt, yt = (np.load(os.path.join(arrays, f"{n}.npy"), allow_pickle=False) for n in ("x", "y", "xt", "yt"))
x, xt = x.astype("float32"), xt.astype("float32")
keras.utils.set_random_seed(seed)
model = keras.Sequential([keras.Input(shape=(28, 28, 1)), layers.Rescaling(1.0 / 255),
    layers.Conv2D(32, 3, activation="relu"), layers.MaxPooling2D(), layers.Conv2D(64, 3, activation="relu"),
    layers.MaxPooling2D(), layers.Flatten(), layers.Dense(128, activation="relu"), layers.Dense(10)])
model.compile(optimizer=keras.optimizers.SGD(lr, momentum=momentum),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
sc = SparkContext(conf=SparkConf().setMaster("local[2]").setAppName("elephas-peer")
                  .set("spark.driver.host", "127.0.0.1").set("spark.driver.bindAddress", "127.0.0.1")
                  .set("spark.ui.enabled", "false"))
sc.setLogLevel("ERROR")
rdd = to_simple_rdd(sc, x, y).repartition(2).cache()
rdd.count()
spark_model = AsynchronousSparkModel(model, num_workers=2, frequency="batch", mode="asynchronous", batch_size=batch)
t0 = time.perf_counter()
spark_model.fit(rdd, epochs=1, batch_size=batch, verbose=0, validation_split=0.0)
wall = time.perf_counter() - t0
loss, acc = spark_model.master_network.evaluate(xt, yt, batch_size=1000, verbose=0)
sc.stop()
import elephas
print(json.dumps({"test_accuracy": float(acc), "test_loss": float(loss), "train_wall_s": wall,
                  "images_per_s": len(y) / wall, "rows": int(len(y)), "seed": seed,
                  "elephas": getattr(elephas, "__version__", None), "keras": keras.__version__}))
"""


def elephas_python(arg: str | None) -> str:
    return arg or os.environ.get("SPARKCNN_ELEPHAS_PYTHON") or os.path.join(ELEPHAS_VENV, "bin", "python")


def setup_elephas() -> str:
    """Create Elephas's virtual environment (pip, PyPI); returns its interpreter."""
    subprocess.run([sys.executable, "-m", "venv", ELEPHAS_VENV], check=True)
    py = os.path.join(ELEPHAS_VENV, "bin", "python")
    subprocess.run([py, "-m", "pip", "install", "-q", *ELEPHAS_REQUIREMENTS], check=True)
    return py


def _arrays(data: str, where: str) -> str:
    """The prepared splits as x/y/xt/yt .npy files in ``where`` (Elephas's venv has no pyarrow)."""
    import numpy as np

    from sparkcnn.data.parquet_io import read_split_numpy

    x, y = read_split_numpy(os.path.join(data, "train"))
    xt, yt = read_split_numpy(os.path.join(data, "test"))
    for name, a in (("x", x), ("y", y.astype("int64")), ("xt", xt), ("yt", yt.astype("int64"))):
        np.save(os.path.join(where, f"{name}.npy"), a, allow_pickle=False)
    return where


def run_elephas(py: str, data: str, seed: int) -> dict:
    env = {**os.environ, "PYSPARK_PYTHON": py, "PYSPARK_DRIVER_PYTHON": py, "SPARK_LOCAL_IP": "127.0.0.1"}
    env.pop("PYTHONPATH", None)
    env.pop("SPARK_HOME", None)  # its own pyspark's
    with tempfile.TemporaryDirectory(prefix="sparkcnn-elephas-") as cwd:
        arrays = _arrays(data, cwd)
        t0 = time.perf_counter()
        p = subprocess.run([py, "-c", ELEPHAS, arrays, str(LR), str(MOMENTUM), str(BATCH), str(seed)], cwd=cwd,
                           env=env, capture_output=True, text=True, timeout=3600)
    if p.returncode != 0:
        return {"failed": p.stderr.strip().splitlines()[-1:] or ["exit %d" % p.returncode],
                "wall_s": time.perf_counter() - t0}
    return {**json.loads(p.stdout.strip().splitlines()[-1]), "wall_s": time.perf_counter() - t0}


def run_sparkcnn(data: str, name: str, out_dir: str, seed: int) -> dict:
    r = run_variant(data, f"peers-{name}", [*SPARKCNN[name], f"train.batch_size={BATCH}", f"train.lr={LR}",
                                            f"train.momentum={MOMENTUM}", f"run.seed={seed}"], 1, out_dir)
    return {k: r.get(k) for k in ("test_accuracy", "images_per_s", "train_wall_s", "wall_s", "bytes_up",
                                  "bytes_down", "exposed_comm_ms_per_step", "seed", "overrides")}


def _checks(med: dict) -> dict:
    out = {}
    base = med.get("elephas") or {}
    for name in SPARKCNN:
        m = med.get(name) or {}
        if base.get("images_per_s") and m.get("images_per_s"):
            ratio = m["images_per_s"] / base["images_per_s"]
            out[f"{name}_speed_vs_elephas"] = {"ratio": ratio, "target": SPEED_TARGET, "passed": ratio >= SPEED_TARGET}
            gap = m["test_accuracy"] - base["test_accuracy"]
            out[f"{name}_accuracy_vs_elephas"] = {"difference": gap, "target": -ACCURACY_SLACK,
                                                   "passed": gap >= -ACCURACY_SLACK}
        else:
            out[f"{name}_speed_vs_elephas"] = {"ratio": None, "target": SPEED_TARGET, "passed": False}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--train-rows", type=int)
    p.add_argument("--test-rows", type=int)
    p.add_argument("--elephas-python")
    p.add_argument("--setup", action="store_true", help="create Elephas's virtual environment first")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if args.reps < 1:
        print(f"peers: --reps must be >= 1, got {args.reps}", file=sys.stderr)
        return 2
    py = setup_elephas() if args.setup else elephas_python(args.elephas_python)
    absent = None if os.path.exists(py) else f"no Elephas environment at {portable_path(py)} (run with --setup)"
    data = ensure_data()
    if args.train_rows:
        data = slice_data(data, args.train_rows, args.test_rows or max(1000, args.train_rows // 6))
    from pyspark.sql import SparkSession

    def stop_session():  # one Spark application on the machine at a time: Elephas's runs alone
        active = SparkSession.getActiveSession()
        if active is not None:
            active.stop()

    out_dir = tempfile.mkdtemp(prefix="sparkcnn-peers-")
    runs: dict[str, list] = {"elephas": [], **{n: [] for n in SPARKCNN}}
    try:
        warm = False
        for rep in range(args.reps):
            seed = 42 + rep
            if absent is None:
                stop_session()
                warm = False
                log("peers: rep %d elephas", rep + 1)
                runs["elephas"].append(run_elephas(py, data, seed))
            for name in SPARKCNN:
                if not warm:  # sparkcnn's own local[2] session (started by the first run), warmed up:
                    # TF, tracing and the codec in the Python workers, not timed
                    run_variant(slice_data(data, 4000, 1000), "peers-warm-up", SPARKCNN["stream-gs-asgd-ms"], 1,
                                out_dir)
                    warm = True
                log("peers: rep %d %s", rep + 1, name)
                runs[name].append(run_sparkcnn(data, name, out_dir, seed))
        stop_session()
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    med = {}
    for name, rs in runs.items():
        ok = [r for r in rs if "failed" not in r]
        if ok:
            med[name] = {k: statistics.median(r[k] for r in ok) for k in ("images_per_s", "test_accuracy")}
    checks = _checks(med)
    out = {"runs": runs, "medians": med, "checks": checks, "passed": all(c["passed"] for c in checks.values()),
           "elephas": {"absent": absent} if absent else {"python": portable_path(py),
                                                          "requirements": ELEPHAS_REQUIREMENTS},
           "settings": {"epochs": 1, "batch_size": BATCH, "lr": LR, "momentum": MOMENTUM, "master": "local[2]",
                        "reps": args.reps},
           "data": {"train_rows": args.train_rows, "test_rows": args.test_rows} if args.train_rows else "full"}
    emit(out, args.out)
    return 0 if out["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
