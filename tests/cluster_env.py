"""What cluster acceptance tests give their executors, and what they read back.

- :func:`deps_only_python`: an interpreter that has sparkcnn's dependencies but not sparkcnn,
  for executors (and drivers) that must receive the package through ``spark-submit``.
- :func:`audit_conf`: Spark settings that install ``tests/audit_hook/sitecustomize.py`` in
  the executors' Python workers; it fails a task that opens a data file outside Spark's own
  directories (see that file). :func:`refused_opens` reads what it refused,
  :func:`audit_installs` where it was installed (proof that it ran at all).
- :func:`spark_submit_route_a`: the README's ``--py-files`` spark-submit command, as argv;
  :func:`readme_block`: a whole fenced block of the README (route (b)'s, run as a script).
- :func:`probe_records`: which Python each process ran, written by
  ``tests/python_probe/sitecustomize.py`` (on ``PYTHONPATH``, like the audit hook).
- :func:`event_log_tasks`: successful tasks per executor, from a Spark event log.

Usage, with the session-scoped fixtures ``standalone_cluster`` and ``executor_python`` of
``tests/conftest.py``; one SparkContext per process, so the driver runs in a subprocess
(``tests/cluster/test_dist.py``'s ``AUDIT_CLIENT`` is a complete example)::

    log = tmp_path / "audit.log"
    env = clean_env(SPARKCNN_CLUSTER=standalone_cluster.to_json(),
                    PYSPARK_PYTHON=sys.executable)  # executors' Python (a plain-Python driver
                                                    # reads only this variable for it)
    # in the subprocess:
    #   spark = session(StandaloneCluster.attach(os.environ["SPARKCNN_CLUSTER"]), "no-shared-path",
    #                   conf=audit_conf(log))
    #   ... SparkCNNClassifier().fit(df) ...
    assert refused_opens(log) == [] and audit_installs(log)  # nothing refused, and the hook ran

With ``PYSPARK_PYTHON=executor_python`` instead, the executors lack sparkcnn and need it
shipped (``spark.submit.pyFiles`` or ``sc.addPyFile`` of ``make dist``'s zip).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import subprocess
import sys
import sysconfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AUDIT_DIR = os.path.join(REPO, "tests", "audit_hook")  # holds the hook's sitecustomize.py
PROBE_DIR = os.path.join(REPO, "tests", "python_probe")  # holds the interpreter probe's sitecustomize.py


def deps_only_python(root: str) -> str:
    """A virtual environment at ``root`` that sees this interpreter's packages but not sparkcnn.

    ``python -m venv`` plus a ``.pth`` file whose lines are this environment's site-packages
    directories. Python adds such plain lines to ``sys.path`` but does not process the
    ``.pth`` files found in those directories, among them the editable install's finder,
    so ``import sparkcnn`` fails there (outside the repository root) while TensorFlow,
    pyspark and numba import. Returns the new interpreter's path.
    """
    python = os.path.join(root, "bin", "python")
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", root], check=True)
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ours = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    with open(os.path.join(site, "sparkcnn_deps.pth"), "w", encoding="utf-8") as fh:
        fh.write("".join(f"{p}\n" for p in ours))
    return python


def clean_env(**extra: str) -> dict:
    """This process's environment without what would hand a child our packages or our JVM."""
    drop = ("PYTHONPATH", "PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "PYSPARK_SUBMIT_ARGS", "SPARK_CONF_DIR")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("PYSPARK_GATEWAY_")}
    env.update(extra)
    return env


def audit_conf(log_path, allow: tuple[str, ...] = ()) -> dict[str, str]:
    """Spark settings that install the audit hook in the executors' Python workers.

    Refusals are appended to ``log_path`` (one ``<pid> <what> <path>`` line each); ``allow``
    adds directories where data files may be opened besides Spark's own. Other
    ``spark.executorEnv.PYTHONPATH`` entries must be merged by the caller.
    """
    conf = {"spark.executorEnv.PYTHONPATH": AUDIT_DIR, "spark.executorEnv.SPARKCNN_AUDIT_LOG": str(log_path)}
    if allow:
        conf["spark.executorEnv.SPARKCNN_AUDIT_ALLOW"] = os.pathsep.join(map(str, allow))
    return conf


def _audit_lines(log_path) -> list[tuple[str, str, str]]:
    if not os.path.exists(log_path):
        return []
    with open(log_path, encoding="utf-8") as fh:
        return [tuple(line.rstrip("\n").split(" ", 2)) for line in fh if line.strip()]


def refused_opens(log_path) -> list[str]:
    """The hook's refusals logged to ``log_path``, ``"<what> <path>"`` each (``[]`` when none)."""
    return [f"{what} {path}" for _, what, path in _audit_lines(log_path) if what != "installed"]


def audit_installs(log_path) -> list[str]:
    """Working directories of the processes that installed the hook (executors' Python
    daemons and workers: the executor's work directory)."""
    return [path for _, what, path in _audit_lines(log_path) if what == "installed"]


def probe_records(log_path) -> list[dict]:
    """One record per process that started with the probe on its path (see PROBE_DIR)."""
    if not os.path.exists(log_path):
        return []
    with open(log_path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _readme_blocks() -> list[list[str]]:
    """The README's fenced blocks, each as its lines with continuation lines joined."""
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as fh:
        blocks = re.findall(r"^```[a-z]*\n(.*?)^```", fh.read(), re.DOTALL | re.MULTILINE)
    return [[c.strip() for c in re.sub(r"\\\n\s*", " ", b).splitlines()] for b in blocks]


def readme_block(marker: str) -> list[str]:
    """The one fenced block of the README that contains ``marker``, as its non-empty lines
    (comments kept: route (b)'s block runs as a shell script)."""
    found = [b for b in _readme_blocks() if any(marker in c for c in b)]
    assert len(found) == 1, f"README: expected one block with {marker!r}, found {len(found)}"
    return [c for c in found[0] if c]


def readme_commands(marker: str) -> list[str]:
    """The README's fenced shell commands that contain ``marker``, continuation lines joined."""
    return [c for b in _readme_blocks() for c in b if marker in c]


def spark_submit_route_a(master: str, zip_path: str, *args: str) -> list[str]:
    """The README's ``--py-files`` spark-submit command as argv: its master replaced by
    ``master``, ``dist/sparkcnn.zip`` by ``zip_path``, ``spark-submit`` by pyspark's own, and
    ``args`` appended (e.g. ``--set`` overrides)."""
    import pyspark

    found = [c for c in readme_commands("--py-files dist/sparkcnn.zip") if c.startswith("spark-submit ")]
    assert len(found) == 1, f"README: expected one spark-submit command with --py-files, found {found}"
    argv = shlex.split(found[0])
    assert "--master" in argv, found[0]
    argv[argv.index("--master") + 1] = master
    argv[argv.index("--py-files") + 1] = zip_path
    argv[0] = os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-submit")
    return argv + list(args)


def event_log_tasks(event_dir: str, app_id: str, hosts: bool = False) -> dict:
    """Executor id -> successful tasks, from the Spark event log of ``app_id`` in ``event_dir``
    (one file, or Spark 4's rolling ``eventlog_v2_<app id>/events_<n>_...`` files; not compressed).
    With ``hosts``: executor id -> the set of host addresses its tasks ran on."""
    paths = glob.glob(os.path.join(event_dir, app_id)) + sorted(
        glob.glob(os.path.join(event_dir, f"eventlog_v2_{app_id}", "events_*")),
        key=lambda p: int(os.path.basename(p).split("_")[1]))
    assert paths, f"no event log of {app_id} in {event_dir}: {os.listdir(event_dir)}"
    tasks: dict = {}
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                event = json.loads(line)
                if event.get("Event") == "SparkListenerTaskEnd" and \
                        event.get("Task End Reason", {}).get("Reason") == "Success":
                    executor = event["Task Info"]["Executor ID"]
                    if hosts:
                        tasks.setdefault(executor, set()).add(event["Task Info"]["Host"])
                    else:
                        tasks[executor] = tasks.get(executor, 0) + 1
    return tasks
