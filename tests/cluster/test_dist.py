"""Packaging: ``python -m sparkcnn``, ``make dist``, and the README's spark-submit recipe on a
real standalone cluster whose Python has sparkcnn's dependencies but not sparkcnn, so the
package reaches driver and executors through ``--py-files`` alone."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import zipfile

import pytest
import yaml

from sparkcnn.metrics import read_jsonl
from tests.cluster_env import (AUDIT_DIR, REPO, audit_conf, audit_installs, clean_env, event_log_tasks, refused_opens,
                               spark_submit_route_a)

SUBMIT_TIMEOUT_S = 600  # one spark-submit: JVMs, executors, TensorFlow import, 1 epoch of tiny data


def _run(argv, **kw):
    return subprocess.run(argv, capture_output=True, text=True, timeout=kw.pop("timeout", 120), **kw)


def test_python_m_sparkcnn_is_the_sparkcnn_script():
    script = os.path.join(os.path.dirname(sys.executable), "sparkcnn")
    seen = {}
    for args in (("--help",), ("train", "--help"), ("train", "--no-such-option")):
        module = _run([sys.executable, "-m", "sparkcnn", *args], cwd=REPO)
        console = _run([script, *args], cwd=REPO)
        seen[args] = (module.returncode, module.stdout, module.stderr)
        assert seen[args] == (console.returncode, console.stdout, console.stderr), args
    code, out, _ = seen[("--help",)]
    assert code == 0 and out.startswith("usage: sparkcnn") and "train" in out
    code, _, err = seen[("train", "--no-such-option")]
    assert code == 2 and "sparkcnn: error: unrecognized arguments: --no-such-option" in err


def test_make_dist_builds_a_wheel_and_a_py_files_zip(dist, executor_python, tmp_path):
    wheels = glob.glob(os.path.join(dist, "sparkcnn-*-py3-none-any.whl"))
    assert len(wheels) == 1, os.listdir(dist)
    with zipfile.ZipFile(wheels[0]) as whl, zipfile.ZipFile(os.path.join(dist, "sparkcnn.zip")) as z:
        names = z.namelist()
        assert names == [n for n in whl.namelist() if n.startswith("sparkcnn/")]  # the package alone
        assert any(n.endswith(".dist-info/entry_points.txt") for n in whl.namelist())
    for module in ("__init__", "__main__", "cli", "train", "transport/tasks", "worker/jobs"):
        assert f"sparkcnn/{module}.py" in names
    assert not any("__pycache__" in n or n.startswith("tests/") for n in names)
    # the zip alone makes sparkcnn importable where it is not installed
    zipped = _run([executor_python, "-m", "sparkcnn", "--help"], cwd=tmp_path,
                  env=clean_env(PYTHONPATH=os.path.join(dist, "sparkcnn.zip")))
    assert zipped.returncode == 0 and "usage: sparkcnn" in zipped.stdout, zipped.stderr[-2000:]
    assert zipped.stdout == _run([sys.executable, "-m", "sparkcnn", "--help"], cwd=REPO).stdout


def test_executor_python_has_the_dependencies_but_not_sparkcnn(executor_python, tmp_path):
    env = clean_env()
    missing = _run([executor_python, "-c", "import sparkcnn"], cwd=tmp_path, env=env)
    assert missing.returncode != 0 and "No module named 'sparkcnn'" in missing.stderr, missing.stderr
    found = _run([executor_python, "-c", "import importlib.util as u; print([m for m in ('pyspark', 'tensorflow', "
                  "'keras', 'numba', 'pyarrow', 'yaml') if u.find_spec(m) is None])"], cwd=tmp_path, env=env)
    assert found.returncode == 0 and found.stdout.strip() == "[]", found.stdout + found.stderr


def test_train_job_without_sparkcnn_says_how_to_ship_it(executor_python, tmp_path):
    proc = _run([executor_python, os.path.join(REPO, "pipelines", "train_job.py"), "--config", "x.yaml"],
                cwd=tmp_path, env=clean_env())
    assert proc.returncode == 1 and "--py-files dist/sparkcnn.zip" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


HOOK_PROBE = r"""
import gzip, json, os, sys
import pyarrow as pa, pyarrow.dataset as ds, pyarrow.parquet as pq
outside, inside = sys.argv[1], sys.argv[2]
probes = {
    "open": lambda: open(os.path.join(outside, "x.parquet"), "rb"),
    "gzip idx": lambda: gzip.open(os.path.join(outside, "t10k-images-idx3-ubyte.gz")),
    "cifar": lambda: open(os.path.join(outside, "data_batch_1"), "rb"),
    "os.open png": lambda: os.open(os.path.join(outside, "a.PNG"), os.O_RDONLY),
    "ParquetFile": lambda: pq.ParquetFile(os.path.join(outside, "x.parquet")),
    "read_table dir": lambda: pq.read_table(outside),
    "dataset": lambda: ds.dataset(outside),
    "memory_map": lambda: pa.memory_map(os.path.join(outside, "x.parquet")),
    "allowed dir": lambda: pq.read_table(os.path.join(inside, "x.parquet")),
    "not data": lambda: open(os.path.join(outside, "notes.txt")),
}
out = {}
for name, probe in probes.items():
    try:
        probe()
        out[name] = "opened"
    except Exception as e:
        out[name] = type(e).__name__
print(json.dumps(out))
"""


def test_audit_hook_refuses_data_files_outside_the_allowed_directories(executor_python, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    outside, inside, work = tmp_path / "shared", tmp_path / "spark-local", tmp_path / "work"
    work.mkdir()
    for d in (outside, inside):
        d.mkdir()
        pq.write_table(pa.table({"x": [1]}), str(d / "x.parquet"))
    for name in ("t10k-images-idx3-ubyte.gz", "data_batch_1", "a.PNG", "notes.txt"):
        (outside / name).write_bytes(b"\x00" * 8)
    log = tmp_path / "audit.log"
    env = clean_env(PYTHONPATH=AUDIT_DIR, SPARKCNN_AUDIT_LOG=str(log), SPARK_LOCAL_DIRS=f"/nonexistent,{inside}")
    proc = _run([executor_python, "-c", HOOK_PROBE, str(outside), str(inside)], cwd=work, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out.pop("allowed dir") == "opened" and out.pop("not data") == "opened"
    assert set(out.values()) == {"DataOpenRefused"}, out
    assert len(refused_opens(log)) == len(out) and audit_installs(log) == [os.path.realpath(work)]


# -- the README's spark-submit recipe on a standalone cluster -----------------------------------

@pytest.fixture(scope="module")
def route_a_cluster(request):
    """Where route (a) runs: a 2-host test bed (two network namespaces behind links shaped to
    1 Gbit/s, the driver and master on the bridge), or, where this machine cannot build one,
    the loopback cluster; (cluster, test bed or None)."""
    from sparkcnn.testing.testbed import TestBed, unavailable_reason

    why = unavailable_reason()
    if why:
        print(f"route (a) on the loopback cluster: {why}")
        yield request.getfixturevalue("standalone_cluster"), None
        return
    with TestBed(hosts=2, rate="1gbit") as bed:
        yield bed.cluster, bed


def _submit(cluster, python: str, dist: str, data: str, root, extra_conf: dict | None = None, *args: str):
    """Run the README's route (a) command against ``cluster``; (process, runs dir, event log dir).

    Site settings of the test's cluster (the driver and executor interpreter, the driver's
    address, no UI, an event log) come from a ``spark-defaults.conf``, as on a real cluster,
    so the command runs as the README gives it; ``args`` are more ``--set`` overrides."""
    from sparkcnn.testing.standalone import FAST_START_JAVA_OPTS

    conf_dir, events, runs = root / "conf", root / "events", root / "runs"
    conf_dir.mkdir()
    events.mkdir()
    defaults = {"spark.pyspark.python": python, "spark.driver.host": cluster.host,
                "spark.driver.bindAddress": cluster.host,
                "spark.ui.enabled": "false", "spark.executor.extraJavaOptions": FAST_START_JAVA_OPTS,
                "spark.eventLog.enabled": "true", "spark.eventLog.dir": f"file://{events}",
                "spark.eventLog.compress": "false",
                # blocks are placed by the run's first job: start it once both executors are in, or
                # a slow registration leaves every block on the first (as a user's defaults would);
                # on standalone the ratio counts against spark.cores.max, and without it waits for none
                "spark.scheduler.minRegisteredResourcesRatio": "1.0",
                "spark.cores.max": str(cluster.workers * cluster.cores_per_worker),
                # and its tasks go to free executors at once: without it a block's storing task
                # waits 3 s for the host of the placement's input, which often finishes both
                "spark.locality.wait.node": "0",
                "spark.scheduler.maxRegisteredResourcesWaitingTime": "120s", **(extra_conf or {})}
    (conf_dir / "spark-defaults.conf").write_text("".join(f"{k} {v}\n" for k, v in defaults.items()))
    argv = spark_submit_route_a(cluster.master_url, os.path.join(dist, "sparkcnn.zip"),
                                "--set", f"data.path={data}", "--set", f"run.out_dir={runs}",
                                "--set", "train.epochs=1", "--set", "train.batch_size=32",
                                "--set", "train.steps_per_round=5", *args)
    import pyspark

    env = clean_env(SPARK_HOME=os.path.dirname(pyspark.__file__), SPARK_CONF_DIR=str(conf_dir),
                    SPARK_LOCAL_IP=cluster.host)
    proc = _run(argv, cwd=REPO, env=env, timeout=SUBMIT_TIMEOUT_S)
    return proc, runs, str(events)


@pytest.mark.cluster
@pytest.mark.parametrize("transport", ["jobs", "stream"])
def test_spark_submit_py_files_on_separate_hosts(route_a_cluster, executor_python, dist, tiny_data, tmp_path,
                                                  transport):
    """Route (a), on each transport, with executors on two other hosts whose Python lacks
    sparkcnn, under the audit hook: the data reaches the Python workers through Spark, which
    open no data file from its path. On the stream, every task reaches the parameter-server
    service on the driver's bridge address from its own host's address, never loopback."""
    (cluster, bed), log = route_a_cluster, tmp_path / "audit.log"
    proc, runs, events = _submit(cluster, executor_python, dist, tiny_data, tmp_path, audit_conf(log),
                                 "--set", f"engine.transport={transport}", "--set", "engine.mode=async")
    assert proc.returncode == 0, proc.stderr[-4000:]
    (summary_path,) = glob.glob(str(runs / "*" / "summary.json"))
    with open(summary_path, encoding="utf-8") as fh:
        summary = json.load(fh)
    assert summary["master"] == cluster.master_url and summary["epochs"] == 1
    assert summary.get("transport", "jobs") == transport
    # the executors that returned training results: "host:<local dir>", the executor's work
    # directory <worker dir>/<app id>/<executor id>, never the driver's, on each worker's host
    app_dir = os.path.realpath(os.path.join(cluster.workdir, "work", summary["app_id"]))
    dirs = {e.split(":", 1)[1] for e in summary["executors"]}
    assert len(dirs) == 2 and all(os.path.dirname(d) == app_dir for d in dirs), (app_dir, summary["executors"])
    # Spark's own record: both executors ran tasks, and nothing else did
    tasks = event_log_tasks(events, summary["app_id"])
    assert set(tasks) == {os.path.basename(d) for d in dirs} and all(n > 0 for n in tasks.values()), tasks
    hosts = event_log_tasks(events, summary["app_id"], hosts=True)  # each executor on its own host
    assert sorted(h for hs in hosts.values() for h in hs) == sorted(bed.host_addresses if bed else [cluster.host] * 2), hosts
    assert {os.path.realpath(d) for d in audit_installs(log)} == dirs  # the hook ran in both executors
    assert refused_opens(log) == []
    # async on a cluster: both blocks trained, every exchange applied once and none twice, within
    # the staleness bound, a whole pass over the data, and no block lost its state (no fault here)
    rounds = [r for r in read_jsonl(os.path.join(os.path.dirname(summary_path), "metrics.jsonl"))
              if r["kind"] == "round"]
    assert summary["mode"] == "async" and summary["duplicates_dropped"] == 0 and summary["state_resets"] == 0
    assert {r["block"] for r in rounds} == {0, 1} and len({r["round"] for r in rounds}) == len(rounds)
    with open(os.path.join(os.path.dirname(summary_path), "config.yaml"), encoding="utf-8") as fh:
        bound = yaml.safe_load(fh)["ps"]["max_staleness"]
    bound = bound if transport == "jobs" else max(bound, 4 * 2)  # the stream's floor: 4 x blocks
    assert all(0 <= r["staleness"] <= bound for r in rounds), [r["staleness"] for r in rounds]
    assert sum(r["samples"] for r in rounds) >= 2 * (600 // 32) * 32
    assert summary["test_accuracy"] > 0.3
    if transport == "stream":
        assert summary["ps_address"].rsplit(":", 1)[0] == cluster.host
        assert summary["stream"]["streams"] >= 2 and summary["stream"]["unauthenticated_refused"] == 0
        if bed is not None:  # over the bridge: the tasks' own addresses, no loopback
            assert set(summary["ps_peers"]) == set(bed.host_addresses), summary["ps_peers"]
            assert cluster.host == bed.driver_host and not cluster.host.startswith("127.")
        else:
            assert set(summary["ps_peers"]) <= set(cluster.worker_hosts), summary["ps_peers"]


# the driver of the audit hook's own check on the cluster: no TensorFlow, no sparkcnn on executors
AUDIT_CLIENT = r"""
import json, os, sys
from sparkcnn.testing.standalone import FAST_START_JAVA_OPTS, StandaloneCluster, session

cluster = StandaloneCluster.attach(os.environ["SPARKCNN_CLUSTER"])
spark = session(cluster, "audit-hook", conf={"spark.executor.extraJavaOptions": FAST_START_JAVA_OPTS,
                                             "spark.task.maxFailures": "1", **json.loads(sys.argv[2])})
sc, outside = spark.sparkContext, sys.argv[1]

def spark_dirs(_):
    import pyarrow as pa, pyarrow.parquet as pq
    rows = []
    for d in (os.getcwd(), os.environ["SPARK_LOCAL_DIRS"].split(",")[0]):
        path = os.path.join(d, f"audit-{os.getpid()}.parquet")
        pq.write_table(pa.table({"x": [1, 2]}), path)
        with open(path, "rb") as fh:
            rows.append((pq.read_table(path).num_rows, len(fh.read(4))))
    yield rows

def read_open(_):
    with open(outside, "rb") as fh:
        yield len(fh.read(4))

def read_arrow(_):
    import pyarrow.parquet as pq
    yield pq.ParquetFile(outside).metadata.num_rows

out = {"spark_dirs": sc.parallelize(range(2), 2).mapPartitions(spark_dirs).collect()}
for name, fn in (("open", read_open), ("arrow", read_arrow)):
    try:
        out[name] = sc.parallelize([0], 1).mapPartitions(fn).collect()
    except Exception as e:
        out[name] = str(e)
spark.stop()
print(json.dumps(out))
"""


@pytest.mark.cluster
def test_audit_hook_refuses_data_opens_on_the_cluster_executors(standalone_cluster, executor_python,
                                                                 tiny_data, tmp_path):
    """The hook the no-shared-path tests rely on, in the cluster's executors: files in Spark's
    work and local directories open; a Parquet file from a path fails the task, through
    open() and through pyarrow alike, and is logged."""
    log = tmp_path / "audit.log"
    outside = sorted(glob.glob(os.path.join(tiny_data, "train", "**", "*.parquet"), recursive=True))[0]
    env = clean_env(SPARKCNN_CLUSTER=standalone_cluster.to_json(), PYSPARK_PYTHON=executor_python)
    proc = _run([sys.executable, "-c", AUDIT_CLIENT, outside, json.dumps(audit_conf(log))], cwd=tmp_path,
                env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["spark_dirs"] == [[[2, 4], [2, 4]]] * 2  # (rows, bytes) in the work and the local dir
    for name in ("open", "arrow"):
        assert "DataOpenRefused" in out[name] and outside in out[name], out[name][-2000:]
    refused = refused_opens(log)
    assert refused == [f"open {outside}", f"pyarrow.parquet.ParquetFile {outside}"], refused
    assert len({os.path.dirname(os.path.realpath(d)) for d in audit_installs(log)}) == 1  # one app
