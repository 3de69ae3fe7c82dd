"""Route (b) of the README's spark-submit recipe, run as the README gives it: a virtual
environment made from ``make dist``'s wheel (its dependencies from the package index), packed
with venv-pack, and shipped with ``--archives ...#environment`` to a standalone cluster on
loopback whose own Python lacks TensorFlow and sparkcnn; the executors' Python workers run
``./environment/bin/python`` from the unpacked archive and train a tiny config to the end.

Which interpreter each process ran is recorded by ``tests/python_probe`` (on the executors'
``PYTHONPATH`` through ``spark-defaults.conf``, on the driver's through the test's
``spark-submit``). A 2 GB environment, a 0.5 GB archive that each executor unpacks: minutes,
so marked ``packaging`` and run by ``make test-packaging`` (``.ci/run``, after ``make test``).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.cluster_env import PROBE_DIR, REPO, clean_env, event_log_tasks, probe_records, readme_block

pytestmark = [pytest.mark.packaging, pytest.mark.cluster]

# venv + pip (cached: ~1 min) + venv-pack (~0.5 min) + the spark-submit run (~3 min) took 5 min on
# a loaded 2-core machine; below pytest's 1200 s, so this fails first, with the script's log
ROUTE_B_TIMEOUT_S = 1000
ARCHIVE = "dist/sparkcnn-env.tar.gz"


def _path_without(directory: str) -> str:
    """This PATH without ``directory`` (the project's virtual environment, whose python3 has all)."""
    return os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                           if p and os.path.realpath(p) != os.path.realpath(directory))


def _script(commands: list[str], master: str, overrides: list[str]) -> str:
    """The README's block as a bash script: its master replaced, ``overrides`` appended to the
    spark-submit command, the seconds at the end of each step appended to ``steps.log``."""
    lines = ["set -euo pipefail"]
    for c in commands:
        if c.startswith("spark-submit "):
            assert "spark://host:7077" in c, c
            c = c.replace("spark://host:7077", master) + "".join(f" --set {o}" for o in overrides)
        lines.append(c)
        if not c.startswith("#"):
            lines.append(f'echo "$SECONDS {c.split()[0]}" >> steps.log')
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def cluster():
    """2 workers of 1 core whose environment offers no TensorFlow: ``python3`` on their PATH is
    the machine's, not the project's, and it is their executors' default Python; no PYTHONPATH
    (a developer's, naming a checkout, would reach the Python workers' path)."""
    from sparkcnn.testing.standalone import StandaloneCluster

    machine = {"PATH": _path_without(os.path.dirname(sys.executable)), "PYSPARK_PYTHON": "python3",
               "PYTHONPATH": ""}
    with StandaloneCluster(workers=2, worker_env=machine).start(timeout=180) as c:
        yield c


@pytest.fixture(scope="module")
def route_b(cluster, dist, tiny_data, tmp_path_factory):
    """Run the README's route (b) block in a fresh directory holding dist/ (the wheel),
    pipelines/ and conf/; (cluster, root, process, seconds, steps). The 2.5 GB pack-env and
    the archive are removed after the module's tests, the logs kept."""
    import pyspark

    from sparkcnn.testing.standalone import FAST_START_JAVA_OPTS

    root = tmp_path_factory.mktemp("route-b")
    (root / "dist").mkdir()
    (wheel,) = glob.glob(os.path.join(dist, "sparkcnn-*-py3-none-any.whl"))
    os.symlink(wheel, root / "dist" / os.path.basename(wheel))
    for d in ("pipelines", "conf"):
        os.symlink(os.path.join(REPO, d), root / d)
    # the machine's commands, as the README assumes them: python (this interpreter, which makes a
    # venv of its base Python) and the cluster's spark-submit, which puts the probe on the driver
    bin_dir, conf_dir, events = root / "bin", root / "spark-conf", root / "events"
    for d in (bin_dir, conf_dir, events):
        d.mkdir()
    spark_home = os.path.dirname(pyspark.__file__)
    for name, text in (("python", f'exec "{sys.executable}" "$@"'),
                       ("spark-submit", f'PYTHONPATH="{PROBE_DIR}" exec "{spark_home}/bin/spark-submit" "$@"')):
        (bin_dir / name).write_text(f"#!/bin/sh\n{text}\n")
        (bin_dir / name).chmod(0o755)
    probe_log = root / "probe.jsonl"
    # the cluster's site settings, as on a real one; nothing here names an interpreter
    defaults = {"spark.driver.host": cluster.host, "spark.driver.bindAddress": cluster.host,
                "spark.ui.enabled": "false", "spark.executor.extraJavaOptions": FAST_START_JAVA_OPTS,
                "spark.eventLog.enabled": "true", "spark.eventLog.dir": f"file://{events}",
                "spark.eventLog.compress": "false", "spark.executorEnv.PYTHONPATH": PROBE_DIR,
                "spark.executorEnv.SPARKCNN_PROBE_LOG": str(probe_log)}
    (conf_dir / "spark-defaults.conf").write_text("".join(f"{k} {v}\n" for k, v in defaults.items()))
    overrides = [f"data.path={tiny_data}", f"run.out_dir={root / 'runs'}", "train.epochs=1",
                 "train.batch_size=32", "train.steps_per_round=5"]
    script = _script(readme_block("--archives"), cluster.master_url, overrides)
    (root / "route_b.sh").write_text(script)
    env = clean_env(PATH=os.pathsep.join([str(bin_dir), _path_without(os.path.dirname(sys.executable))]),
                    SPARK_HOME=spark_home, SPARK_CONF_DIR=str(conf_dir), SPARK_LOCAL_IP=cluster.host,
                    SPARK_VERSION=pyspark.__version__, SPARKCNN_PROBE_LOG=str(probe_log))
    t0 = time.monotonic()
    with open(root / "route_b.log", "w") as log:
        # its own process group: on a timeout the driver JVM and its Python go with the script
        proc = subprocess.Popen(["bash", str(root / "route_b.sh")], cwd=root, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(ROUTE_B_TIMEOUT_S)
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
            if os.path.exists(root / "route_b.log"):
                print(_log_tail(root))
            raise
    seconds = time.monotonic() - t0
    steps, start = [], 0  # (command, seconds) of each step that finished
    for line in ((root / "steps.log").read_text().splitlines() if (root / "steps.log").exists() else []):
        end, name = line.split(None, 1)
        steps.append((name, int(end) - start))
        start = int(end)
    print(f"\nroute (b): {seconds:.0f} s in all; " + ", ".join(f"{n} {s} s" for n, s in steps))
    yield cluster, root, proc, seconds, steps
    shutil.rmtree(root / "pack-env", ignore_errors=True)
    (root / ARCHIVE).unlink(missing_ok=True)


def _log_tail(root, chars: int = 5000) -> str:
    return (root / "route_b.log").read_text(errors="replace")[-chars:]


def test_route_b_trains_on_executors_without_tensorflow(route_b):
    cluster, root, proc, seconds, _ = route_b
    assert proc.returncode == 0, _log_tail(root)
    archive = root / ARCHIVE
    print(f"archive {archive.stat().st_size / 1e6:.0f} MB")
    (summary_path,) = glob.glob(str(root / "runs" / "*" / "summary.json"))
    with open(summary_path, encoding="utf-8") as fh:
        summary = json.load(fh)
    assert summary["master"] == cluster.master_url and summary["epochs"] == 1
    assert summary["train_rows"] == 1200 and summary["test_accuracy"] > 0.3, summary
    # both executors trained, each in its own work directory <worker dir>/<app id>/<executor id>
    app_dir = os.path.realpath(os.path.join(cluster.workdir, "work", summary["app_id"]))
    dirs = {e.split(":", 1)[1] for e in summary["executors"]}
    assert len(dirs) == 2 and all(os.path.dirname(d) == app_dir for d in dirs), (app_dir, summary["executors"])
    tasks = event_log_tasks(str(root / "events"), summary["app_id"])
    assert set(tasks) == {os.path.basename(d) for d in dirs} and all(n > 0 for n in tasks.values()), tasks

    # the Python of every executor process: the archive's, unpacked in its work directory
    records = probe_records(root / "probe.jsonl")
    executors = [r for r in records if os.path.realpath(r["cwd"]).startswith(app_dir + os.sep)]
    assert {os.path.realpath(r["cwd"]) for r in executors} == dirs, records
    for r in executors:
        print(f"executor pid {r['pid']}: sys.prefix {r['prefix']}, tensorflow {r['tensorflow']}, "
              f"own python3 {r['python3']}")
        env_dir = os.path.join(os.path.realpath(r["cwd"]), "environment")
        assert os.path.realpath(r["prefix"]) == env_dir, r  # sys.prefix: the unpacked archive
        assert r["executable"] == os.path.join(r["cwd"], "environment", "bin", "python"), r
        for module in ("tensorflow", "sparkcnn"):  # imported from the archive, nowhere else
            assert r[module] and os.path.realpath(r[module]).startswith(env_dir + os.sep), r
    # ... while the executors' own python3 has neither
    own = {r["python3"] for r in executors}
    assert len(own) == 1 and None not in own, own
    python3 = own.pop()
    for module in ("tensorflow", "sparkcnn"):
        check = subprocess.run([python3, "-c", f"import {module}"],
                               capture_output=True, text=True, cwd=root, env=clean_env(PATH=os.environ["PATH"]))
        assert check.returncode != 0 and f"No module named '{module}'" in check.stderr, (module, check.stderr)
    # the driver ran pack-env's Python (PYSPARK_DRIVER_PYTHON), not this one
    drivers = [r for r in records if os.path.realpath(r["cwd"]) == os.path.realpath(root)]
    assert [os.path.realpath(r["prefix"]) for r in drivers] == [os.path.realpath(root / "pack-env")], records
    assert os.path.realpath(drivers[0]["sparkcnn"]).startswith(os.path.realpath(root / "pack-env") + os.sep)


def test_route_b_archive_leaves_spark_jars_to_the_cluster(route_b):
    """The README's venv-pack command keeps pyspark's jars out (the executors' JVM is the
    cluster's Spark), so the archive is about half the environment's size on disk."""
    _, root, proc, _, _ = route_b
    assert proc.returncode == 0, _log_tail(root)
    pack_env = root / "pack-env"
    jars = pack_env / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages" / \
        "pyspark" / "jars"
    assert len(list(jars.glob("spark-core_*.jar"))) == 1  # the driver's copy has them
    listing = subprocess.run(["tar", "tzf", str(root / ARCHIVE)], capture_output=True, text=True, timeout=300)
    assert listing.returncode == 0, listing.stderr
    names = listing.stdout.splitlines()
    assert any(re.search(r"site-packages/tensorflow/__init__\.py$", n) for n in names)
    assert any(re.search(r"site-packages/sparkcnn/cli\.py$", n) for n in names)
    assert any(re.search(r"site-packages/pyspark/__init__\.py$", n) for n in names)
    assert not any("/pyspark/jars/" in n for n in names)
