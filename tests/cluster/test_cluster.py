"""Cluster tier: a real standalone master + 2 workers on loopback, driven from a subprocess.

One SparkContext per process, and the other tests hold a local[2] one, so every driver
here runs in its own Python process (``CLIENT`` below) and reaches the cluster through
``StandaloneCluster.attach``. The tests share one cluster and run in file order: the
fault test kills worker 0, the last test stops the cluster and checks nothing is left.
"""

import json
import os
import subprocess
import sys
import time

import pytest

from sparkcnn.testing.standalone import StandaloneCluster, _alive, _processes, port_open

pytestmark = pytest.mark.cluster

CHAOS = "SPARKCNN_CHAOS_SLOW"

# the driver: runs both scenarios in one session (executor start-up dominates), prints JSON
CLIENT = r"""
import json, os, subprocess, sys, threading, time
from pyspark import TaskContext
from sparkcnn.testing.standalone import EXECUTOR, FAST_START_JAVA_OPTS, StandaloneCluster, session

def executor_jvm():
    # walk up from this Python worker to the executor JVM that forked it
    pid = os.getpid()
    while pid > 1:
        ppid, args = subprocess.run(["ps", "-o", "ppid=,args=", "-p", str(pid)], capture_output=True,
                                    text=True).stdout.strip().split(None, 1)
        if EXECUTOR in args:
            return pid
        pid = int(ppid)
    return None

def task(scratch, seconds):
    def run(it):
        ctx = TaskContext.get()
        jvm = executor_jvm()
        open(os.path.join(scratch, f"{ctx.partitionId()}-{ctx.attemptNumber()}-{jvm}"), "w").close()
        time.sleep(seconds)
        yield ctx.partitionId(), ctx.attemptNumber(), os.getpid(), jvm, os.environ.get("SPARKCNN_CHAOS_SLOW")
    return run

scratch = sys.argv[1]
cluster = StandaloneCluster.attach(os.environ["SPARKCNN_CLUSTER"])
t0 = time.monotonic()
spark = session(cluster, "test-cluster", conf={"spark.executor.extraJavaOptions": FAST_START_JAVA_OPTS})
sc = spark.sparkContext
out = {"session_s": time.monotonic() - t0, "executors": cluster.executor_pids()}

t0 = time.monotonic()
out["env_rows"] = sc.parallelize(range(4), 4).mapPartitions(task(os.path.join(scratch, "env"), 0.5)).collect()
out["env_job_s"] = time.monotonic() - t0

# lose worker 0 (worker and executor JVMs) while one of its tasks runs
t0 = time.monotonic()
victims, marks, box = set(cluster.executor_pids()[0]), os.path.join(scratch, "kill"), {}
job = threading.Thread(target=lambda: box.update(
    rows=sc.parallelize(range(4), 4).mapPartitions(task(marks, 2.0)).collect()))
job.start()
while not any(int(f.rsplit("-", 1)[1]) in victims for f in os.listdir(marks)):
    if time.monotonic() - t0 > 60:
        sys.exit(f"no task started on worker 0's executors {victims}: {os.listdir(marks)}")
    time.sleep(0.1)
out["killed"] = cluster.kill_worker(0)
job.join(120)
out["kill_rows"], out["kill_job_s"] = box.get("rows"), time.monotonic() - t0
spark.stop()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def cluster():
    c = StandaloneCluster(workers=2, per_worker_env={1: {CHAOS: "2.0"}})
    t0 = time.monotonic()
    with c.start(timeout=80):
        print(f"\ncluster start {time.monotonic() - t0:.1f} s")
        yield c


@pytest.fixture(scope="module")
def driven(cluster, tmp_path_factory):
    """Run CLIENT against the cluster once; both scenario tests read its report."""
    scratch = tmp_path_factory.mktemp("cluster-client")
    for sub in ("env", "kill"):
        (scratch / sub).mkdir()
    # under spark-submit these would attach the client to this process's JVM
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_GATEWAY_")}
    env["SPARKCNN_CLUSTER"] = cluster.to_json()
    proc = subprocess.run([sys.executable, "-c", CLIENT, str(scratch)], env=env, capture_output=True,
                          text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:] + "\n" + cluster.log_tail()
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"session {out['session_s']:.1f} s, env job {out['env_job_s']:.1f} s, "
          f"kill job {out['kill_job_s']:.1f} s")
    return out


def test_two_executors_and_per_worker_env(driven):
    executors = {int(i): pids for i, pids in driven["executors"].items()}
    assert all(len(pids) == 1 for pids in executors.values()), executors
    rows = driven["env_rows"]
    assert {jvm for _, _, _, jvm, _ in rows} == {executors[0][0], executors[1][0]}  # both served
    assert len({pid for _, _, pid, _, _ in rows}) >= 2  # in two Python workers
    for _, _, _, jvm, chaos in rows:  # the extra env reached worker 1's executor only
        assert chaos == ("2.0" if jvm == executors[1][0] else None)


def test_job_survives_a_lost_worker(cluster, driven):
    killed, rows = driven["killed"], driven["kill_rows"]
    assert killed and not any(_alive(p) for p in killed)
    assert rows is not None and sorted(r[0] for r in rows) == list(range(4))  # every block, once
    assert max(r[1] for r in rows) >= 1  # the task lost with worker 0 ran again
    assert set(killed).isdisjoint(r[3] for r in rows)
    assert cluster.worker_pids()[0] is None and cluster.worker_pids()[1] is not None


def test_stop_leaves_nothing(cluster):
    pids = [cluster.master_pid(), *cluster.worker_pids().values(),
            *(p for ps in cluster.executor_pids().values() for p in ps)]
    pids = [p for p in pids if p]
    assert pids and all(_alive(p) for p in pids)  # master, worker 1 (after the fault test)
    ports, workdir = cluster.ports, cluster.workdir
    assert any(port_open(p) for p in ports)
    t0 = time.monotonic()
    cluster.stop()
    print(f"cluster stop {time.monotonic() - t0:.1f} s")
    cluster.stop()  # idempotent
    assert not any(_alive(p) for p in pids)
    assert not any(port_open(p) for p in ports)
    assert not os.path.exists(workdir)


def test_start_timeout_names_the_logs_and_cleans_up():
    c = StandaloneCluster(workers=1)
    with pytest.raises(RuntimeError, match="timed out waiting for the master") as err:
        c.start(timeout=0.5)
    assert "deploy.master.Master-1" in str(err.value)  # the daemon log tail is in the message
    assert not os.path.exists(c.workdir)
    assert not any(c.workdir in args for _, _, _, args in _processes())


def test_per_worker_env_must_name_a_worker():
    with pytest.raises(ValueError, match=r"per_worker_env names workers \[2\]"):
        StandaloneCluster(workers=2, per_worker_env={2: {CHAOS: "2"}})
    with pytest.raises(ValueError, match=r"worker_gpus names workers \[1\]"):
        StandaloneCluster(workers=1, worker_gpus={1: ["0"]})
