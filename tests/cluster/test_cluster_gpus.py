"""Cluster tier: GPUs placed by Spark, on a standalone worker that declares two fake GPU addresses.

One cluster for the module (1 worker, 2 cores, addresses ``0`` and ``1``); one driver process,
``tests/gpu_driver.py``, runs its applications in turn (see :data:`tests.gpu_driver.APPS`) and
reports, per application, the settings its session got, the GPU log lines, the run's outcome and
the assignment table: per round and block, the executor, the Python worker's pid, the addresses
of the task context and the ``CUDA_VISIBLE_DEVICES`` its TensorFlow trained with. The tests
read that report. ``python tests/gpu_driver.py`` prints the same tables on its own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests import gpu_driver

pytestmark = pytest.mark.cluster

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 600  # the driver's four applications: ~1-2 min quiet, several on a loaded 2-core machine


@pytest.fixture(scope="module")
def apps(tiny_data, tmp_path_factory):
    """The driver's report by application name; the cluster is stopped whatever happens."""
    from sparkcnn.testing.standalone import StandaloneCluster

    root = tmp_path_factory.mktemp("fake-gpus")
    t0 = time.monotonic()
    with StandaloneCluster(**gpu_driver.cluster_kwargs()).start(timeout=120) as cluster:
        spec = {"cluster": cluster.to_json(), "data": tiny_data, "root": str(root / "runs"),
                "out": str(root / "apps.json")}
        (root / "spec.json").write_text(json.dumps(spec))
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_GATEWAY_")}
        env.update(PYSPARK_PYTHON=sys.executable,
                   PYTHONPATH=os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p))
        with open(root / "driver.log", "w") as log:
            # its own process group: a timeout takes the driver's JVM down with it
            proc = subprocess.Popen([sys.executable, gpu_driver.__file__, str(root / "spec.json")], cwd=root,
                                    env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
                rc = "timeout"
        tail = (root / "driver.log").read_text(errors="replace")[-4000:]
        assert rc == 0 and os.path.exists(spec["out"]), f"driver: {rc}\n{tail}\n{cluster.log_tail()}"
    results = json.loads((root / "apps.json").read_text())
    print(f"\nfake-GPU cluster and its {len(results)} applications: {time.monotonic() - t0:.0f} s")
    for r in results:
        print(f"{r['app']} ({r['seconds']} s: {r['phases_s']}): {r['conf']} {r['error'] or ''}")
        for row in r["table"]:
            print("   ", json.dumps(row))
    return {r["app"]: r for r in results}


def _trained(app: dict) -> list[dict]:
    """The assignment rows of an application whose run finished: every (round, block), once."""
    assert app["exit"] == 0, app["error"]
    rows = app["table"]
    rounds = sorted({r["round"] for r in rows})
    assert len(rounds) >= 2 and rounds == list(range(len(rounds)))
    assert sorted((r["round"], r["block"]) for r in rows) == [(t, b) for t in rounds for b in range(gpu_driver.BLOCKS)]
    return rows


def test_more_than_one_gpu_per_task_is_refused_in_one_line_before_the_session(apps):
    app = apps["refused"]
    assert app["exit"] == 2
    assert app["error"] == ("spark.task.resource.gpu.amount=2: sparkcnn trains one model replica per task on one "
                            "GPU (no multi-GPU strategy); use 1, or a fraction to share a GPU between tasks")
    assert app["session"] is False and app["jobs"] == 0 and not app["run_dir_exists"]


def test_each_task_trains_on_exactly_the_addresses_spark_assigned_it(apps):
    for name in ("several", "shared"):
        for row in _trained(apps[name]):
            # the task context's addresses (Spark's) and what the task's TensorFlow read
            assert row["cuda_visible_devices"] == row["task_gpus"], (name, row)
            assert row["task_gpus"] in gpu_driver.ADDRESSES, (name, row)  # one address of the worker's


def test_tasks_of_one_executor_never_share_an_address_and_workers_are_not_reused(apps):
    app = apps["several"]
    # sparkcnn filled in what the caller left unset: the executor holds 2 addresses
    assert app["conf"] == {"spark.python.worker.reuse": "false", gpu_driver.GPU_EXEC: "2", gpu_driver.GPU_TASK: "1"}
    assert app["log"] == ["GPUs: spark.task.resource.gpu.amount=1 with 2 per executor: each task trains on its own "
                          "GPU address; Python workers not reused, each task starts its own TensorFlow"]
    rows = _trained(app)
    for t in {r["round"] for r in rows}:
        # a round's 2 tasks start together on the executor's 2 free slots and run side by side
        same_round = [r for r in rows if r["round"] == t]
        assert len({r["executor"] for r in same_round}) == 1
        assert sorted(r["task_gpus"] for r in same_round) == gpu_driver.ADDRESSES, same_round
    assert len({r["pid"] for r in rows}) == len(rows)  # a fresh Python worker (and TensorFlow) per task


def test_a_fraction_shares_one_address_in_reused_workers_and_says_so(apps):
    app = apps["shared"]
    assert app["conf"] == {"spark.python.worker.reuse": "true", gpu_driver.GPU_EXEC: "1", gpu_driver.GPU_TASK: "0.5"}
    assert app["log"] == ["GPUs shared: spark.task.resource.gpu.amount=0.5 with 1 per executor: up to 2 tasks "
                          "train on each GPU address at once; Python workers reused"]
    rows = _trained(app)
    for t in {r["round"] for r in rows}:  # both tasks of a round on the executor's one address
        assert len({r["task_gpus"] for r in rows if r["round"] == t}) == 1
    by_pid: dict[int, set] = {}
    for r in rows:
        by_pid.setdefault(r["pid"], set()).add((r["task_gpus"], r["cuda_visible_devices"]))
    reused = [pid for pid in by_pid if sum(r["pid"] == pid for r in rows) > 1]
    assert reused, rows  # some Python worker ran tasks of several rounds ...
    assert all(len(seen) == 1 for seen in by_pid.values()), by_pid  # ... each on one address throughout


def test_a_cpu_only_executor_trains_on_the_cpu_with_one_log_line(apps):
    app = apps["cpu"]
    assert app["conf"] == {"spark.python.worker.reuse": "true", gpu_driver.GPU_EXEC: None, gpu_driver.GPU_TASK: None}
    assert app["log"] == ["GPUs: none assigned (spark.task.resource.gpu.amount unset): TensorFlow trains on the CPU"]
    rows = _trained(app)
    assert all(r["task_gpus"] == "" and r["cuda_visible_devices"] == "" for r in rows), rows
