"""Layering: the worker modules never import pyspark. Each import runs in a fresh interpreter.
(The driver side, the Spark-free layer, importing neither TensorFlow nor the worker modules:
tests/unit/test_purity.py.)"""

import json
import subprocess
import sys

import pytest


def _loaded_after(module: str) -> list[str]:
    code = (f"import json, sys; import {module}; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('sparkcnn', 'tensorflow', "
            "'keras', 'pyspark', 'py4j')))))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", ["sparkcnn.worker.jobs", "sparkcnn.worker.trainer"])
def test_worker_modules_import_no_pyspark(module):
    loaded = _loaded_after(module)
    assert module in loaded
    assert not [m for m in loaded if m.split(".")[0] in ("pyspark", "py4j")], loaded
