"""The seams hold: the driver side imports no worker module, and the worker side no pyspark, at
import and at call time. ``engine.master=inprocess`` (``sparkcnn.backends.inprocess``), which runs
the workers' code in the driver's process by design, is exempt on the driver side; the worker
side is called through it here."""

import json
import subprocess
import sys

import pytest

SCRIPT = r"""
import importlib, json, pkgutil, sys

BLOCKED = tuple(sys.argv[1].split(","))
ONLY, SKIP = (tuple(a.split(",")) for a in sys.argv[2].split(";"))


class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.startswith(BLOCKED) and (name in BLOCKED or name.startswith(tuple(b + "." for b in BLOCKED))):
            raise ImportError(f"{name} is blocked on this side")
        return None


sys.meta_path.insert(0, Blocked())
import sparkcnn

names = [m.name for m in pkgutil.walk_packages(sparkcnn.__path__, "sparkcnn.")
         if m.name.startswith(ONLY) and not m.name.startswith(SKIP) and m.name != "sparkcnn.__main__"]
for name in names:
    importlib.import_module(name)

from sparkcnn import config
from sparkcnn.train import train

accuracy = {}
for case in json.loads(sys.argv[3]):
    summary = train(config.load(None, case))
    accuracy[" ".join(case[-3:])] = summary["test_accuracy"]
print(json.dumps({"imported": len(names), "accuracy": accuracy,
                  "loaded": sorted(m for m in sys.modules if m.startswith(BLOCKED))}))
"""


def _run(blocked: str, only: str, skip: str, cases: list[list[str]]) -> dict:
    """In a fresh interpreter with ``blocked`` unimportable: import the modules under ``only`` but not
    ``skip`` (comma-separated prefixes), then train each case; what it imported and reached."""
    proc = subprocess.run([sys.executable, "-c", SCRIPT, blocked, f"{only};{skip}", json.dumps(cases)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _common(tiny_data, tmp_path, master: str) -> list[str]:
    return [f"data.path={tiny_data}", f"run.out_dir={tmp_path / 'runs'}", f"engine.master={master}",
            "train.epochs=1", "train.batch_size=32", "compression.method=threshold", "compression.density=0.05",
            "compression.density_down=0.05"]


@pytest.mark.spark
def test_the_driver_side_runs_without_the_worker_modules(tiny_data, tmp_path):
    """Every driver-side module imports, and the jobs (sync, async) and stream transports train on
    local Spark, with ``sparkcnn.worker`` and ``sparkcnn.worker.blockstore`` unimportable in the driver."""
    common = _common(tiny_data, tmp_path, "local[2]")
    cases = [[*common, "engine.transport=jobs", "engine.mode=sync", "train.steps_per_round=5"],
             [*common, "engine.transport=jobs", "engine.mode=async", "train.steps_per_round=5"],
             [*common, "engine.transport=stream", "engine.mode=async", "train.steps_per_round=2"]]
    out = _run("sparkcnn.worker,sparkcnn.worker.blockstore", "sparkcnn.",
               "sparkcnn.worker,sparkcnn.worker.blockstore,sparkcnn.backends.inprocess", cases)
    assert out["imported"] > 40 and out["loaded"] == []
    assert len(out["accuracy"]) == 3 and all(a > 0.3 for a in out["accuracy"].values()), out


def test_the_worker_side_runs_without_pyspark(tiny_data, tmp_path):
    """Every worker module imports, and runs (in-process, the jobs and the stream transports' task
    code), with ``pyspark`` and ``py4j`` unimportable."""
    common = _common(tiny_data, tmp_path, "inprocess")
    cases = [[*common, "engine.transport=jobs", "engine.mode=sync", "train.steps_per_round=5"],
             [*common, "engine.transport=stream", "engine.mode=async", "train.steps_per_round=2"]]
    out = _run("pyspark,py4j", "sparkcnn.worker,sparkcnn.worker.blockstore", "-", cases)
    assert out["imported"] >= 5 and out["loaded"] == []
    assert len(out["accuracy"]) == 2 and all(a > 0.3 for a in out["accuracy"].values()), out
