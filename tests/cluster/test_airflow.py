"""The Airflow DAG (pipelines/airflow_dag.py) under real Airflow, in subprocesses (tests/airflow_run.py).

One DAG run through Airflow's own ``dag.test()``: prepare -> train -> evaluate, each
task's spark-submit argv built and run by the Spark provider's hook, against the
shared standalone cluster (local[2] where the suite has none), its runs root on S3
(moto's server on loopback, authentication on, tests/s3server.py). Its first train
try is SIGKILLed after a checkpoint (``chaos.kill_driver_round``); Airflow retries it
and the retry resumes the same run directory from its checkpoint on S3; evaluate
writes its report there and returns metrics.json as its XCom. A second run, with a
local runs root and a bad config, fails train at once, without a retry.
"""

import json
import os
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.s3server import BUCKET, s3_server

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUNNER = os.path.join(ROOT, "tests", "airflow_run.py")
KILL_AFTER = 1  # round index; checkpoints every 2 rounds, so round 1 ends with one
RUNS_PREFIX = "airflow"  # the killed-then-retried run's runs root: s3://runs/airflow


def _runner(env, *args, log=None, timeout=900) -> dict:
    p = subprocess.run([sys.executable, RUNNER, *args], env=env, capture_output=True, text=True,
                       timeout=timeout)
    out = p.stdout + p.stderr
    if log:
        with open(log, "w") as fh:
            fh.write(out)
    results = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    assert p.returncode == 0 and results, f"exit {p.returncode}:\n{out[-4000:]}"
    return json.loads(results[-1][len("RESULT "):])


def _path_safe(run_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", run_id)


def _env(root, master: str = "local[2]") -> dict:
    """Environment of an Airflow installation in ``root``: sqlite DB, DAG folder, the
    ``spark_default`` connection to ``master``, the runs root as a Variable, Spark on loopback."""
    conf_dir = root / "spark-conf"
    conf_dir.mkdir(exist_ok=True)
    fast_jvm = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"  # start-up over throughput, as in the cluster tests
    (conf_dir / "spark-defaults.conf").write_text(
        "spark.driver.host 127.0.0.1\nspark.driver.bindAddress 127.0.0.1\nspark.ui.enabled false\n"
        f"spark.executor.cores 1\nspark.cores.max 2\nspark.driver.extraJavaOptions {fast_jvm}\n"
        f"spark.executor.extraJavaOptions {fast_jvm}\n")
    env = dict(os.environ)
    env.pop("PYSPARK_SUBMIT_ARGS", None)
    env.update({
        "AIRFLOW_HOME": str(root / "home"),
        "AIRFLOW__CORE__DAGS_FOLDER": os.path.join(ROOT, "pipelines"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{root / 'airflow.db'}",
        "AIRFLOW_CONN_SPARK_DEFAULT": json.dumps({"conn_type": "spark", "host": master}),
        "AIRFLOW_VAR_SPARKCNN_RUNS_ROOT": str(root / "runs"),
        "PATH": os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""),  # spark-submit
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_CONF_DIR": str(conf_dir),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "TF_CPP_MIN_LOG_LEVEL": "2",
    })
    return env


@pytest.fixture(scope="module")
def airflow_root(tmp_path_factory):
    return tmp_path_factory.mktemp("airflow")


@pytest.fixture(scope="module")
def cluster_master(request) -> str:
    try:
        return request.getfixturevalue("standalone_cluster").master_url
    except pytest.FixtureLookupError:  # a suite without the shared cluster
        return "local[2]"


@pytest.fixture(scope="module")
def raw_data(airflow_root):
    from sparkcnn.data.synthetic import make_fake_fashion

    return make_fake_fashion(str(airflow_root / "raw"), 600, 200, seed=3)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with s3_server(str(tmp_path_factory.mktemp("s3"))) as server:
        yield server


@pytest.fixture(scope="module")
def killed_then_retried(airflow_root, cluster_master, raw_data, s3):
    """One DAG run with its runs root on S3, whose first train try is SIGKILLed after round
    KILL_AFTER's checkpoint: (result, run directory URI, its key prefix, the runner's log).
    Airflow, spark-submit and the drivers reach the store through the AWS variables only."""
    data = str(airflow_root / "data")
    overrides = ["train.epochs=1", "train.batch_size=32", "train.steps_per_round=3",  # 3 rounds
                 "checkpoint.every_rounds=2", f"chaos.kill_driver_round={KILL_AFTER}"]
    conf = {"raw": raw_data, "data": data, "runs_root": f"s3://{BUCKET}/{RUNS_PREFIX}",
            "overrides": overrides}
    log = airflow_root / "killed_then_retried.log"
    result = _runner(s3.env(_env(airflow_root, cluster_master)), "run", json.dumps(conf), log=log)
    prefix = f"{RUNS_PREFIX}/sparkcnn/{_path_safe(result['run_id'])}"
    return result, f"s3://{BUCKET}/{prefix}", prefix, log.read_text()


def test_dagbag_loads_the_dag(airflow_root):
    info = _runner(_env(airflow_root), "dagbag")
    assert info["import_errors"] == {}
    assert "sparkcnn" in info["dag_ids"]
    tasks = info["tasks"]
    assert tasks["prepare"]["downstream"] == ["train"] and tasks["train"]["downstream"] == ["evaluate"]
    for t in tasks.values():
        assert "SparkSubmitOperator" in t["bases"] and t["retries"] >= 1


@pytest.mark.slow
@pytest.mark.cluster
def test_killed_train_is_retried_and_resumes_the_same_run_on_s3(killed_then_retried, cluster_master, s3):
    result, run_dir, prefix, log = killed_then_retried
    assert result["state"] == "success", result
    tasks = result["tasks"]
    assert tasks["prepare"] == {"state": "success", "try_number": 1}
    assert tasks["train"] == {"state": "success", "try_number": 2}  # SIGKILLed once, then retried
    assert tasks["evaluate"] == {"state": "success", "try_number": 1}
    # both tries ran the hook's spark-submit argv with the same --run-dir, derived from the DAG run
    submits = [line for line in log.splitlines() if "Spark-Submit cmd" in line and " train " in line]
    assert len(submits) == 2 and all(f"--run-dir {run_dir} " in s for s in submits), submits
    keys = s3.keys(f"{RUNS_PREFIX}/")
    name = run_dir.rsplit("/", 1)[1]
    assert {k.split("/")[2] for k in keys} == {name, name + ".exit"}  # the run and its exit codes only
    assert not [k for k in keys if ".tmp-" in k or ".old-" in k]  # no temporary left behind
    for task in ("train", "evaluate"):  # the exit codes the operator read, on S3 too
        assert json.loads(s3.read(f"{prefix}.exit/{task}.json")) == {"command": task, "exit_code": 0}
    # the retry resumed from the first try's checkpoint on S3: rounds up to it kept, the rest run anew
    assert s3.read(f"{prefix}/checkpoints/LATEST").strip().startswith(b"r")
    assert any(k.startswith(f"{prefix}/checkpoints/r") and k.endswith("/manifest.json") for k in keys)
    rounds = [r for r in map(json.loads, s3.read(f"{prefix}/metrics.jsonl").decode().splitlines())
              if r["kind"] == "round"]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    first_try = {p for r in rounds[:KILL_AFTER + 1] for p in r["task_pids"].values()}
    second_try = {p for r in rounds[KILL_AFTER + 1:] for p in r["task_pids"].values()}
    assert first_try and second_try and not first_try & second_try
    # summary.json reaches XCom
    summary = result["xcom"]["train.return_value"]
    assert summary == json.loads(s3.read(f"{prefix}/summary.json"))
    assert summary["run_dir"] == run_dir and summary["rounds"] == 3
    assert summary["master"] == cluster_master
    # evaluate wrote its report beside the run on S3, and metrics.json is its XCom
    metrics = result["xcom"]["evaluate.return_value"]
    assert metrics == json.loads(s3.read(f"{prefix}/evaluation/metrics.json"))
    assert metrics["out"] == f"{run_dir}/evaluation" and metrics["samples"] == 200
    assert sum(map(sum, metrics["confusion_matrix"])) == 200
    # the model evaluate scored is the one train finished with: the same accuracy on the same split
    assert abs(metrics["test_accuracy"] - summary["test_accuracy"]) <= 0.02, (metrics, summary)
    assert metrics["test_accuracy"] > 0.2  # 10 classes: well above chance after 9 steps
    assert s3.read(f"{prefix}/evaluation/confusion_matrix.png")[:8] == b"\x89PNG\r\n\x1a\n"
    parts = [k for k in keys if k.startswith(f"{prefix}/evaluation/predictions/") and k.endswith(".parquet")]
    preds = pa.concat_tables(pq.read_table(pa.BufferReader(s3.read(k))) for k in parts)
    assert preds.num_rows == 200 and {"label", "prediction", "probability", "loss"} <= set(preds.column_names)


def test_bad_config_fails_train_without_retry(airflow_root, raw_data):
    from sparkcnn.data.prepare import prepare

    data = str(airflow_root / "data-bad-config")
    prepare("idx", raw_data, data)  # here rather than by the DAG's prepare task, marked done below
    conf = {"raw": raw_data, "data": data, "overrides": ["train.no_such_key=1"]}
    result = _runner(_env(airflow_root), "run", json.dumps(conf), "prepare")  # fails before Spark starts
    tasks = result["tasks"]
    assert result["state"] == "failed"
    assert tasks["train"] == {"state": "failed", "try_number": 1}  # retries=2, none used
    assert tasks["evaluate"]["state"] == "upstream_failed"
    run_dir = os.path.join(airflow_root, "runs", "sparkcnn", _path_safe(result["run_id"]))
    assert not os.path.exists(run_dir)  # bad input: nothing written
    with open(f"{run_dir}.exit/train.json") as fh:
        assert json.load(fh) == {"command": "train", "exit_code": 2}


def test_train_refuses_run_dir_with_resume(capsys):
    from sparkcnn.cli import main

    assert main(["train", "--resume", "a", "--run-dir", "b"]) == 2
    assert "--resume and --run-dir" in capsys.readouterr().err


def test_pyspark_is_not_overlaid_by_pyspark_client():
    """The Spark provider requires pyspark-client, a subset of pyspark whose files would replace
    pyspark's own with an older release; `make setup` installs the provider without it."""
    from importlib import metadata

    metadata.version("apache-airflow-providers-apache-spark")
    with pytest.raises(metadata.PackageNotFoundError):
        metadata.version("pyspark-client")
