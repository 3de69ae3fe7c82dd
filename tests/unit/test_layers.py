"""Layering: the driver side never imports TensorFlow or the executor's modules; the worker
modules never import pyspark. Each import runs in a fresh interpreter."""

import json
import subprocess
import sys

import pytest

HEAVY = ("tensorflow", "keras")


def _loaded_after(module: str) -> list[str]:
    code = (f"import json, sys; import {module}; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('sparkcnn', 'tensorflow', "
            "'keras', 'pyspark', 'py4j')))))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", ["sparkcnn.protocol", "sparkcnn.server.driver", "sparkcnn.ps",
                                    "sparkcnn.compression", "sparkcnn.scheduler", "sparkcnn.server.apply"])
def test_driver_side_imports_no_tensorflow_and_no_worker(module):
    loaded = _loaded_after(module)
    bad = [m for m in loaded if m.split(".")[0] in HEAVY or m.startswith("sparkcnn.worker")]
    assert not bad, f"{module} pulled in {bad}"


def test_round_driver_is_spark_free():
    loaded = _loaded_after("sparkcnn.server.driver")
    assert not [m for m in loaded if m.split(".")[0] in ("pyspark", "py4j")]


@pytest.mark.parametrize("module", ["sparkcnn.worker.round", "sparkcnn.worker.trainer"])
def test_worker_modules_import_no_pyspark(module):
    loaded = _loaded_after(module)
    assert module in loaded
    assert not [m for m in loaded if m.split(".")[0] in ("pyspark", "py4j")], loaded
