"""Which Python a process runs, for the packaging tests (route (b): executors that must run the
interpreter of a shipped archive, not their own).

Installed by putting this directory on ``PYTHONPATH`` (for executors' Python workers:
``spark.executorEnv.PYTHONPATH``); Python imports ``sitecustomize`` at start-up, after its
site-packages are on ``sys.path``. When ``SPARKCNN_PROBE_LOG`` is set, each process appends one
JSON line there: its pid, interpreter (``sys.executable``, ``sys.prefix``), working directory,
where ``tensorflow`` and ``sparkcnn`` would be imported from (found, not imported: no cost, no
side effect) and the ``python3`` its ``PATH`` gives, i.e. the Python the machine would run.
Read with :func:`tests.cluster_env.probe_records`.
"""

import importlib.util
import json
import os
import shutil
import sys


def _origin(name: str):
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None else None


if os.environ.get("SPARKCNN_PROBE_LOG"):
    _record = {"pid": os.getpid(), "executable": sys.executable, "prefix": sys.prefix, "cwd": os.getcwd(),
               "tensorflow": _origin("tensorflow"), "sparkcnn": _origin("sparkcnn"),
               "python3": shutil.which("python3")}
    with open(os.environ["SPARKCNN_PROBE_LOG"], "a", encoding="utf-8") as _fh:
        _fh.write(json.dumps(_record) + "\n")
