"""Training on real Spark masters: a standalone cluster (a lost worker) and
local[2,4] (task retries: injected task failures, killed Python workers).

One SparkContext per process, and the rest of the suite holds a local[2] one, so every
driver here is ``tests/cluster_driver.py`` in a subprocess; the tests read its run
directories (summary.json, metrics.jsonl, model.keras). Each driver trains several runs
in one session, so JVM, executor and TensorFlow start-up are paid once per master. The
local[2,4] driver is started before the cluster's and trains beside the cluster tests
(much of either driver's time is start-up latency). A failed or killed task attempt costs
a fresh Python worker (PySpark exits a worker after a task error), i.e. a TensorFlow
import, so the chaos seeds below are chosen for few, but enough, faults.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from sparkcnn.backends.inprocess import LocalBackend
from sparkcnn.metrics import read_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DRIVER = os.path.join(REPO, "tests", "cluster_driver.py")
DRIVER_TIMEOUT_S = 600  # per driver; ~2-5 min on a loaded 2-core machine

BATCH = 32
COMMON = [f"train.batch_size={BATCH}", "train.lr=0.05", "train.lr_warmup_epochs=0",
          "train.lr_schedule=constant"]

# local[2,4]: two slots, a task may fail 4 times. 1 epoch = 3 rounds x 2 blocks. With seed 234
# the reproducible chaos draws (sparkcnn.worker.chaos.strikes per (seed, round, block, stream))
# fail the first attempt of (round, block) (0, 0), (1, 1), (2, 0) at p = 0.1 and kill the
# Python worker of (1, 0) at p = 0.2: retries in rounds > 0 restore the state the previous
# round saved. Spark's Python daemon preloads TensorFlow (see cluster_driver.py).
LOCAL_MASTER = "local[2,4]"
SEED, FAIL_P, KILL_P = 234, 0.1, 0.2
LOCAL_H = 6
LOCAL_CONF = {"spark.python.daemon.module": "tests.cluster_driver"}
LOCAL = COMMON + [f"engine.master={LOCAL_MASTER}", "train.epochs=1", f"train.steps_per_round={LOCAL_H}",
                  f"run.seed={SEED}", "run.deterministic=true", "compression.method=threshold",
                  "compression.density=0.05"]
LOCAL_RUNS = {"sync-clean": [], "sync-flaky": [f"chaos.fail_task_probability={FAIL_P}"],
              "sync-killed": [f"chaos.kill_worker_probability={KILL_P}"]}

# standalone cluster, 2 workers of 1 core. The sync run has 4 blocks (two per executor slot,
# as on any cluster with more blocks than cores) and loses worker 0 after KILL_AFTER rounds.
LOST_BLOCKS = 4
LOST_EPOCHS = 3  # 9 rounds: the kill after the 4th lands mid-run however fast the machine is
LOST = COMMON + [f"data.num_blocks={LOST_BLOCKS}", f"train.epochs={LOST_EPOCHS}", "train.steps_per_round=3"]
KILL_AFTER = 4  # rounds recorded before the kill: 3 rounds per epoch, so mid-epoch


class Driver:
    """A ``cluster_driver.py`` subprocess training ``runs`` (name -> overrides) under ``root``."""

    def __init__(self, root, data: str, runs: dict[str, list[str]], master=None, cluster=None, conf=None):
        self.root = root
        self.run_dirs = {name: str(root / "runs" / name) for name in runs}
        self.out = str(root / "driver.json")
        spec = {"master": master, "cluster": cluster, "conf": conf or {}, "out": self.out,
                "runs": [{"run_dir": self.run_dirs[name], "overrides": [f"data.path={data}", *ov]}
                         for name, ov in runs.items()]}
        (root / "spec.json").write_text(json.dumps(spec))
        # under spark-submit these would attach the driver to this process's JVM
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_GATEWAY_")}
        env.setdefault("PYSPARK_PYTHON", sys.executable)
        # the Python daemon Spark starts must find tests.cluster_driver
        env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
        self.log_path = root / "driver.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, DRIVER, str(root / "spec.json")], cwd=root, env=env,
                                     stdout=self._log, stderr=subprocess.STDOUT)
        self.started = time.monotonic()
        self.rc = None

    def rounds_done(self, name: str) -> int:
        path = os.path.join(self.run_dirs[name], "metrics.jsonl")
        if not os.path.exists(path):
            return 0
        with open(path, encoding="utf-8") as fh:
            return sum('"kind": "round"' in line for line in fh)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_text()[-chars:]

    def wait(self) -> dict:
        """Wait for the driver; its per-run results by name (exit, error, failed_attempts)."""
        if self.rc is None:
            try:
                self.rc = self.proc.wait(max(1.0, DRIVER_TIMEOUT_S - (time.monotonic() - self.started)))
            except subprocess.TimeoutExpired:
                self.stop()
                pytest.fail(f"driver still running after {DRIVER_TIMEOUT_S} s\n{self.log_tail()}")
            finally:
                self._log.close()
            print(f"\ndriver {self.root.name}: rc {self.rc} in {time.monotonic() - self.started:.0f} s")
        assert os.path.exists(self.out), f"driver rc {self.rc}, no results\n{self.log_tail()}"
        with open(self.out, encoding="utf-8") as fh:
            by_dir = {r["run_dir"]: r for r in json.load(fh)}
        return {name: by_dir.get(d) for name, d in self.run_dirs.items()}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self._log.close()


def _run(driver: Driver, results: dict, name: str):
    """(summary, round records, epoch records) of one finished run; fails with the driver log if not."""
    res = results[name]
    assert res is not None, f"run {name} never finished (driver rc {driver.rc})\n{driver.log_tail()}"
    assert res["exit"] == 0, f"run {name}: exit {res['exit']}: {res['error']}\n{driver.log_tail()}"
    run_dir = driver.run_dirs[name]
    with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as fh:
        summary = json.load(fh)
    records = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    return (summary, [r for r in records if r["kind"] == "round"],
            [r for r in records if r["kind"] == "epoch"])


def _sync_rounds(data: str, epochs: int, steps_per_round: int, blocks: int = 2) -> int:
    """Rounds of a sync run: ceil(steps of the largest block / H) per epoch."""
    from sparkcnn.data.parquet_io import read_meta

    n = read_meta(os.path.join(data, "train")).num_rows
    steps = -(-n // blocks) // BATCH  # the largest block: ceil(n / blocks) rows (round-robin placement)
    return epochs * math.ceil(steps / steps_per_round)


def _assert_each_round_applied_once(summary: dict, rounds: list[dict], expected: int, blocks: int = 2):
    """Sync rounds 0..expected-1, each recorded once, each applying every block's delta once."""
    assert [r["round"] for r in rounds] == list(range(expected))
    assert summary["rounds"] == expected
    assert all(r["blocks"] == blocks and r["rejected"] == 0 for r in rounds), \
        [(r["round"], r["blocks"], r["rejected"]) for r in rounds]
    assert [r["version"] for r in rounds] == list(range(1, expected + 1))  # one update per round
    assert summary["duplicates_dropped"] == 0 and summary["rejected_deltas"] == 0


def _chaos_set(rounds: int, stream: int, p: float, blocks: int = 2) -> set[tuple[int, int]]:
    """(round, block) whose first attempt chaos fails (stream 0) or kills (stream 1): the
    worker's own reproducible draw."""
    from sparkcnn.worker.chaos import strikes

    return {(t, k) for t in range(rounds) for k in range(blocks) if strikes(SEED, t, k, stream, p)}


def _same_weights(run_a: str, run_b: str) -> list[str]:
    """Paths of the weights that differ (bit for bit) between two runs' model.keras."""
    import keras

    a = keras.saving.load_model(os.path.join(run_a, "model.keras"))
    b = keras.saving.load_model(os.path.join(run_b, "model.keras"))
    assert [w.shape for w in a.weights] == [w.shape for w in b.weights]
    return [wa.path for wa, wb in zip(a.weights, b.weights) if not np.array_equal(np.asarray(wa), np.asarray(wb))]


def _selected(request, fixture: str) -> bool:
    return any(fixture in getattr(item, "fixturenames", ()) for item in request.session.items)


class _DriverUI:
    """The REST API of a driver's Spark UI on loopback (``spark.ui.port`` = ``port``): which of a
    run's jobs are running, and how many of their tasks."""

    def __init__(self, port: int, app_name: str):
        self.port, self.app_name = port, app_name
        self.app = None  # .../applications/<id>, once the UI answers
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def _get(self, url: str):
        """The JSON at ``url``; OSError or ValueError while no UI answers there. A port nobody
        listens on yet can answer with our own request: the ports probed are in the ephemeral
        range, and a connect whose source port is the same one opens a TCP connection to itself."""
        try:
            with self._opener.open(url, timeout=5) as r:
                return json.load(r)
        except http.client.HTTPException as e:  # BadStatusLine, RemoteDisconnected: not a UI
            raise ValueError(f"{url}: {e!r}") from None

    def _find(self) -> None:
        # Spark binds the next port up when the chosen one was taken in the meantime
        for port in range(self.port, self.port + 17):
            base = f"http://127.0.0.1:{port}/api/v1/applications"
            try:
                apps = [a for a in self._get(base) if a.get("name") == self.app_name]
            except (OSError, ValueError):
                continue
            if apps:
                self.app = f"{base}/{apps[0]['id']}"
                return

    def running_jobs(self, group: str) -> list[dict]:
        """The running jobs of job group ``group``; [] while the UI is not up."""
        if self.app is None:
            self._find()
        if self.app is None:
            return []
        try:
            return [j for j in self._get(f"{self.app}/jobs?status=running") if j.get("jobGroup") == group]
        except (OSError, ValueError):
            return []


# -- drivers -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def local_driver(tiny_data, tmp_path_factory):
    """The local[2,4] driver, started (not waited for): clean, flaky and killed runs in turn."""
    driver = Driver(tmp_path_factory.mktemp("local24"), tiny_data,
                    {name: LOCAL + extra for name, extra in LOCAL_RUNS.items()}, master=LOCAL_MASTER,
                    conf=LOCAL_CONF)
    yield driver
    driver.stop()


@pytest.fixture(scope="module")
def local_runs(local_driver):
    return local_driver.wait()


@pytest.fixture(scope="module")
def cluster_runs(request, tiny_data, tmp_path_factory):
    """Standalone cluster (2 workers, 1 core each); one driver trains the 4-block sync run, during
    which worker 0 (worker and executor JVMs) is SIGKILLed. (Async on a cluster: route (a) in
    tests/cluster/test_dist.py, on hosts of their own.)"""
    from sparkcnn.testing.standalone import StandaloneCluster, free_ports

    if _selected(request, "local_runs"):
        request.getfixturevalue("local_driver")  # start it first: it trains beside this one
    with StandaloneCluster(workers=2).start(timeout=180) as cluster:
        # the driver's UI, on loopback (SPARK_LOCAL_IP), says when the round's tasks run; its
        # status store updated on every event (liveUpdate.period 0), not every 100 ms
        (ui_port,) = free_ports(1)
        ui = _DriverUI(ui_port, "sparkcnn-cluster-tests")
        driver = Driver(tmp_path_factory.mktemp("cluster"), tiny_data,
                        {"sync-lost-worker": LOST}, cluster=cluster.to_json(),
                        conf={"spark.ui.enabled": "true", "spark.ui.port": str(ui_port),
                              "spark.ui.liveUpdate.period": "0"})
        kill = {"pids": [], "at_round": None, "active_tasks": 0, "jobs": []}
        try:
            deadline = driver.started + DRIVER_TIMEOUT_S
            while driver.proc.poll() is None and time.monotonic() < deadline:
                if driver.rounds_done("sync-lost-worker") < KILL_AFTER:
                    # polled from the start: the UI's first answers take a second or two, about
                    # what the rounds after KILL_AFTER take each
                    ui.running_jobs("sparkcnn-sync-lost-worker")
                    time.sleep(0.2)
                    continue
                if "before" not in kill:
                    with pytest.MonkeyPatch.context() as mp:
                        mp.setenv("COLUMNS", "80")  # as in a terminal, or under pytest
                        kill["narrow"] = cluster.executor_pids()
                    kill["before"] = cluster.executor_pids()
                    kill["worker"] = cluster.worker_pids()[0]
                # the next round's job is running and so are tasks of it (~0.1 s each, in a
                # round of ~1 s: which executor runs one at the kill is not up to the test)
                jobs = ui.running_jobs("sparkcnn-sync-lost-worker")
                active = sum(j["numActiveTasks"] for j in jobs)
                if not active:
                    time.sleep(0.05)
                    continue
                kill["pids"] = cluster.kill_worker(0)
                kill["gone"] = cluster.worker_pids()[0] is None
                kill["at_round"] = driver.rounds_done("sync-lost-worker")
                kill["active_tasks"], kill["jobs"] = active, [j.get("description") for j in jobs]
                break
            kill["ui"] = ui.app
            results = driver.wait()
        finally:
            driver.stop()
    return driver, results, kill


# -- standalone cluster ------------------------------------------------------------------------

@pytest.mark.cluster
def test_lost_worker_mid_run_the_run_completes(cluster_runs, tiny_data):
    driver, results, kill = cluster_runs
    expected = _sync_rounds(tiny_data, epochs=LOST_EPOCHS, steps_per_round=3, blocks=LOST_BLOCKS)
    assert kill["pids"], (f"nothing killed: the run ended before its tasks were seen running "
                          f"(driver UI {kill['ui']})\n{driver.log_tail()}")
    assert kill["active_tasks"] >= 1 and kill["jobs"], kill  # killed while a round's tasks ran
    assert kill["at_round"] < expected, "the kill came after the last round"
    # worker 0's JVM and its executor's, SIGKILLed and gone
    assert kill["pids"] == [kill["worker"], *kill["before"][0]] and len(kill["pids"]) == 2, kill
    assert kill["gone"]
    summary, rounds, epochs = _run(driver, results, "sync-lost-worker")
    _assert_each_round_applied_once(summary, rounds, expected, blocks=LOST_BLOCKS)
    assert [e["epoch"] for e in epochs] == list(range(LOST_EPOCHS)) and summary["test_accuracy"] > 0.5
    print(f"killed after {kill['at_round']} rounds, {kill['active_tasks']} task(s) of {kill['jobs']} running; "
          f"failed task attempts: {results['sync-lost-worker']['failed_attempts']}")
    # blocks of the lost executor restart from a fresh state elsewhere: counted, not silent
    assert summary["state_resets"] >= 1
    assert summary["state_resets"] == sum(r["state_resets"] for r in rounds)
    late = [r for r in rounds if r["round"] > kill["at_round"]]  # empty when the kill hit the last round
    assert all(r["samples"] > 0 for r in late)


@pytest.mark.cluster
def test_blocks_keep_their_state_without_faults(cluster_runs):
    """No fault, no reset: a block's tasks run on the executor that holds its state (async on a
    cluster: tests/cluster/test_dist.py, route (a))."""
    driver, results, kill = cluster_runs
    _, rounds, _ = _run(driver, results, "sync-lost-worker")
    before_kill = [r for r in rounds if r["round"] < KILL_AFTER]
    assert sum(r["state_resets"] for r in before_kill) == 0


@pytest.mark.cluster
def test_cluster_helper_sees_executors_with_a_narrow_terminal(cluster_runs):
    """`ps` output is not cut at $COLUMNS, which would hide the JVM class names it looks for."""
    _, _, kill = cluster_runs
    assert kill["before"][1], kill  # found with a wide ps
    assert kill["narrow"] == kill["before"]


# -- async engine, in process: what the cluster runs showed, reproduced deterministically ------

def _async_engine(tiny_cfg, backend, **kw):
    from sparkcnn.train import build_engine

    cfg = tiny_cfg.replace(engine__mode="async", compression__method="threshold", compression__density=0.05, **kw)
    return build_engine(cfg, backend, backend.run_id)[0]


class _ViewBroadcast:
    """A broadcast that, like Spark's, cannot be used once the backend destroyed it."""

    def __init__(self, value):
        self._value, self.destroyed = value, False

    @property
    def value(self):
        if self.destroyed:
            raise RuntimeError("Attempted to use Broadcast after it was destroyed")
        return self._value


class _DestroyTrackingBackend(LocalBackend):
    """In-process blocks; ``unpersist`` destroys, as SparkBackend's does."""

    def broadcast(self, value):
        return _ViewBroadcast(value)

    def unpersist(self, bcast):
        bcast.destroyed = True


def test_async_sparse_downlink_keeps_a_view_broadcast_one_job_ahead(tiny_cfg):
    """On the cluster: 'Task not serializable: Attempted to use Broadcast(4) after it was destroyed'."""
    engine = _async_engine(tiny_cfg, _DestroyTrackingBackend("t-view-bcast"), compression__density_down=0.05)
    slow = engine.order_for_block(0, 1)  # block 0's job is still queued or running
    fast = engine.order_for_block(1, 1)
    engine.on_result(fast, 1, *engine._job(fast, 1))  # block 1 finishes first: U moves on
    engine.order_for_block(1, 1)  # block 1's next job gets the new view
    assert slow.weights is not None and not slow.weights.destroyed  # block 0's job may yet read it


def test_async_sparse_downlink_keeps_a_view_broadcast_while_its_job_may_run(tiny_cfg):
    engine = _async_engine(tiny_cfg, _DestroyTrackingBackend("t-view-bcast-slow"), compression__density_down=0.05)
    slow = engine.order_for_block(0, 1)  # a slow executor's job, in flight throughout
    for _ in range(engine.cfg.ps.max_staleness):  # block 1 runs ahead as far as the policy allows
        fast = engine.order_for_block(1, 1)
        engine.on_result(fast, 1, *engine._job(fast, 1))
    assert engine.version - slow.base_version == engine.cfg.ps.max_staleness
    assert all(d.kind.name == "SUBMIT" for d in engine.policy.decide(engine.version, 1, [1], {0: 0}))
    engine.order_for_block(1, 1)
    assert not slow.weights.destroyed


def test_async_guard_accepts_a_long_job_after_short_ones(tiny_cfg):
    engine = _async_engine(tiny_cfg, LocalBackend("t-guard-steps"))
    for block, steps in [(0, 1), (1, 1)] * 3 + [(0, 12)]:  # guard warm-up: 5 norms
        order = engine.order_for_block(block, steps)
        rec = engine.on_result(order, block, *engine._job(order, block))
        assert rec["steps"] == steps
    assert engine.counters["rejected_deltas"] == 0


# -- local[2,4]: failed attempts are retried ---------------------------------------------------

@pytest.mark.spark
def test_failed_task_attempts_are_retried_and_change_nothing(local_driver, local_runs, tiny_data):
    expected = _sync_rounds(tiny_data, epochs=1, steps_per_round=LOCAL_H)
    failures = _chaos_set(expected, stream=0, p=FAIL_P)
    assert len(failures) >= 3 and any(t > 0 for t, _ in failures), failures  # the seed still bites
    clean, _, _ = _run(local_driver, local_runs, "sync-clean")
    flaky, rounds, _ = _run(local_driver, local_runs, "sync-flaky")
    assert local_runs["sync-clean"]["failed_attempts"] == 0
    assert local_runs["sync-flaky"]["failed_attempts"] == len(failures)
    injected = {(int(t), int(k)) for k, t in
                re.findall(r"chaos: injected failure of block (\d+) exchange (\d+)", local_driver.log_text())}
    assert injected == failures
    _assert_each_round_applied_once(flaky, rounds, expected)
    assert flaky["state_resets"] == 0  # the retries ran on the same executor and found the state
    # deterministic mode: the final weights are bit-identical to the run without failures
    assert _same_weights(local_driver.run_dirs["sync-clean"], local_driver.run_dirs["sync-flaky"]) == []
    assert flaky["test_accuracy"] == clean["test_accuracy"]


@pytest.mark.spark
def test_killed_python_worker_mid_task_the_run_completes(local_driver, local_runs, tiny_data):
    expected = _sync_rounds(tiny_data, epochs=1, steps_per_round=LOCAL_H)
    kills = _chaos_set(expected, stream=1, p=KILL_P)
    assert kills and any(t > 0 for t, _ in kills), kills  # the seed still kills a worker
    summary, rounds, _ = _run(local_driver, local_runs, "sync-killed")
    assert local_runs["sync-killed"]["failed_attempts"] == len(kills)
    _assert_each_round_applied_once(summary, rounds, expected)
    assert summary["state_resets"] == 0  # the previous round's state was spilled to the local dir
    # the killed attempts died before saving any state: the retries reproduce the clean run exactly
    assert _same_weights(local_driver.run_dirs["sync-clean"], local_driver.run_dirs["sync-killed"]) == []
