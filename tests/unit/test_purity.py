"""The Spark-free layer stays Spark-free: importing every module of it in a fresh interpreter
pulls in neither pyspark (nor py4j) nor TensorFlow or Keras, nor the executor's ``sparkcnn.worker``,
so the driver's parameter server, exchange core, codec and scheduler load without a JVM or
TensorFlow. A failure names the module whose import pulled the package in."""

from __future__ import annotations

import importlib.util
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# every module in these packages, found on disk: a module added to them is covered without a change here
PACKAGES = ("sparkcnn.server", "sparkcnn.compression")
MODULES = ("sparkcnn.ps", "sparkcnn.protocol", "sparkcnn.streamwire", "sparkcnn.streamsocket", "sparkcnn.config",
           "sparkcnn.checkpoint", "sparkcnn.scheduler", "sparkcnn.staleness", "sparkcnn.guard", "sparkcnn.replica")
FORBIDDEN = ("pyspark", "py4j", "tensorflow", "keras")
WORKER = "sparkcnn.worker"

# One fresh interpreter imports the modules in turn. A finder first on sys.meta_path sees each
# forbidden module the first time it is looked up, and charges it to the innermost sparkcnn module
# running at that moment (the one whose code asked for it), and to the layer module being imported.
PROBE = r"""
import importlib, json, sys

FORBIDDEN, WORKER = tuple(sys.argv[1].split(",")), sys.argv[2]
found, current = {}, None


def kind(name):
    if name == WORKER or name.startswith(WORKER + "."):
        return WORKER
    return name.split(".")[0] if name.split(".")[0] in FORBIDDEN else None


class Watch:
    def find_spec(self, name, path=None, target=None):
        if kind(name):  # charged to the innermost sparkcnn module running (not to the worker's own imports)
            frame = sys._getframe(1)
            while frame is not None and not frame.f_globals.get("__name__", "").startswith("sparkcnn"):
                frame = frame.f_back
            if frame is not None and kind(frame.f_globals["__name__"]) == WORKER == kind(name):
                return None
            culprit = frame.f_globals["__name__"] if frame is not None else current
            found.setdefault(f"{culprit} (importing {current})", set()).add(kind(name))
        return None


sys.meta_path.insert(0, Watch())
for current in sys.argv[3:]:
    importlib.import_module(current)
unseen = sorted({kind(m) for m in sys.modules if kind(m)} - set().union(*found.values()))
if unseen:
    found["(not seen by the finder)"] = unseen
print(json.dumps({k: sorted(v) for k, v in found.items()}))
"""


def _package_modules(package: str) -> list[str]:
    """``package`` and every module and subpackage under it, found without importing any of them."""
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.submodule_search_locations, f"{package} is not a package"
    names = [package]
    for info in pkgutil.iter_modules(spec.submodule_search_locations, package + "."):
        names.extend(_package_modules(info.name) if info.ispkg else [info.name])
    return names


def _pulled_in(modules: list[str]) -> dict[str, list[str]]:
    """Which sparkcnn module pulled in which forbidden package when ``modules`` were imported."""
    proc = subprocess.run([sys.executable, "-c", PROBE, ",".join(FORBIDDEN), WORKER, *modules], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_spark_free_layer_imports_neither_spark_nor_tensorflow():
    discovered = {package: _package_modules(package) for package in PACKAGES}
    for package, names in discovered.items():
        assert len(names) > 1, f"no module found in {package}"
    modules = [name for names in discovered.values() for name in names] + list(MODULES)
    bad = _pulled_in(modules)
    assert not bad, "\n".join(f"{culprit} imports {', '.join(found)}" for culprit, found in bad.items())
