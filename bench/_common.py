"""Shared helpers for the benchmarks: dataset location, child processes, JSON output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.environ.get("SPARKCNN_BENCH_DATA", os.path.join(ROOT, "data", "fashion-mnist"))
FMNIST_SRC = "/usr/share/datasets/fashion-mnist"


def ensure_data() -> str:
    """The prepared Fashion-MNIST dataset, prepared on first use."""
    if not os.path.isdir(os.path.join(DATA, "test")):
        from sparkcnn.data.prepare import prepare

        prepare("idx", FMNIST_SRC, DATA)
    return DATA


# A child that trains one block alone with single-thread TF and reports its
# steady-state images/s: the "no communication at all" compute limit.
SOLO = r"""
import json, os, sys, time
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(int(sys.argv[5]))
tf.config.threading.set_inter_op_parallelism_threads(1)
from sparkcnn.blockstore import read_block
from sparkcnn.worker import TaskSpec, Trainer, batch_indices
data, blocks, block, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
x, y = read_block(os.path.join(data, "train"), blocks, block)
spec = TaskSpec(run_id="solo", train_dir="", test_dir="", num_blocks=blocks, test_blocks=1,
                model_name="fmnist_cnn", input_shape=x.shape[1:], num_classes=10, seed=0,
                batch_size=64, momentum=0.9, weight_decay=0.0, layout=())
tr = Trainer(spec)
b = [batch_indices(len(y), 64, 0, 0, block, i) for i in range(steps + 5)]
tr.train(x, y, b[:5], 0.05)
t = time.perf_counter(); tr.train(x, y, b[5:], 0.05); dt = time.perf_counter() - t
print(json.dumps({"images_per_s": steps * 64 / dt, "step_ms": 1000 * dt / steps}))
"""

KERAS_FIT = r"""
import json, os, sys, time
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import keras
from sparkcnn.data.parquet_io import read_split_numpy
from sparkcnn.models import build_model
data, steps = sys.argv[1], int(sys.argv[2])
x, y = read_split_numpy(os.path.join(data, "train"))
n = (steps + 5) * 64
x, y = x[:n], y[:n]
m = build_model("fmnist_cnn", x.shape[1:], 10, 0)
m.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
m.fit(x[:320], y[:320], batch_size=64, epochs=1, verbose=0)
t = time.perf_counter(); m.fit(x[320:], y[320:], batch_size=64, epochs=1, verbose=0, shuffle=True)
dt = time.perf_counter() - t
print(json.dumps({"images_per_s": steps * 64 / dt}))
"""


def run_children(script: str, argvs: list[list[str]], timeout: float = 600) -> list[dict]:
    """Start the children together and return their JSON lines."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen([sys.executable, "-c", script, *argv], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for argv in argvs]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"benchmark child failed: {stderr.strip().splitlines()[-1:]}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def emit(obj: dict) -> None:
    print(json.dumps(obj, indent=2, sort_keys=False))


class Timer:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.s = time.perf_counter() - self.t0
