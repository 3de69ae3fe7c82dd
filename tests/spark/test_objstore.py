"""Run directories on an object store: a real S3 server (moto's standalone server) on loopback.

The server enforces authentication: only its first requests (creating an IAM user, its
policy and its access key) go unchecked, every later one must be signed with that key.
A driver writing its run to ``s3://`` is SIGKILLed mid-run; ``--resume s3://...`` from a
fresh local directory finishes it with every round recorded once. Bad credentials and a
missing bucket are refused in one line, with nothing written. The driver's configuration
is the AWS convention (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_ENDPOINT_URL``, ``AWS_REGION``), nothing else.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.s3server import BUCKET, s3_server

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# checkpoint.every_rounds=2: checkpoint r0000002 follows round 1; the driver is SIGKILLed after
# round KILL_ROUND, one round past it, so the resume reruns round 2 and must not record it twice
KILL_ROUND = 2


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """moto's server on a free loopback port, authentication enforced, bucket ``runs`` made
    with the IAM key it issued; stopped at the end of the module."""
    with s3_server(str(tmp_path_factory.mktemp("s3"))) as server:
        yield server


def _cli(args, env, cwd, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sparkcnn.cli", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def _records(s3, prefix) -> list[dict]:
    return [json.loads(line) for line in s3.read(f"{prefix}/metrics.jsonl").decode().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def resumed(s3, tiny_data, tmp_path_factory):
    """A run on s3:// whose driver is SIGKILLed after round ``KILL_ROUND``, then resumed with
    ``--resume s3://...`` from another, empty working directory: (summary, the killed run's
    records, its LATEST, the resume's working directory)."""
    uri, prefix = f"s3://{BUCKET}/exp/kill-resume", "exp/kill-resume"
    first, second = tmp_path_factory.mktemp("driver-1"), tmp_path_factory.mktemp("driver-2")
    killed = _cli(["train", "--no-progress", "--run-dir", uri, "--set", f"data.path={tiny_data}",
                   "--set", "engine.master=inprocess", "--set", "train.epochs=2", "--set", "train.batch_size=32",
                   "--set", "train.steps_per_round=5", "--set", "checkpoint.every_rounds=2",
                   "--set", "compression.method=threshold", "--set", "compression.density=0.05",
                   "--set", "compression.density_down=0.05", "--set", f"chaos.kill_driver_round={KILL_ROUND}"],
                  s3.env(), first)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert os.listdir(first) == []  # the driver wrote nothing locally
    latest = s3.read(f"{prefix}/checkpoints/LATEST").decode()
    records = _records(s3, prefix)
    resumed = _cli(["train", "--no-progress", "--resume", uri, "--set", "chaos.kill_driver_round=-1"],
                   s3.env(), second)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return json.loads(resumed.stdout), records, latest, second


def test_killed_run_resumes_from_s3_with_every_round_once(s3, resumed):
    summary, before, latest, cwd = resumed
    prefix = "exp/kill-resume"
    assert summary["run_dir"] == f"s3://{BUCKET}/{prefix}" and summary["run_id"] == "kill-resume"
    # what the killed driver left: LATEST naming the first checkpoint, the records it covers
    assert latest == "r0000002\n"
    rounds_before = [r["round"] for r in before if r["kind"] == "round"]
    assert rounds_before == list(range(len(rounds_before))) and 2 <= len(rounds_before) <= KILL_ROUND + 1
    after = _records(s3, prefix)
    rounds = [r["round"] for r in after if r["kind"] == "round"]
    print(f"S3 resume: {summary['rounds']} rounds {rounds}")
    assert summary["rounds"] > KILL_ROUND + 1
    assert rounds == list(range(summary["rounds"]))  # each round once: the rerun round 2 not twice
    assert [r["epoch"] for r in after if r["kind"] == "epoch"] == [0, 1]
    assert after[:2] == before[:2]  # rounds 0 and 1 came from the checkpoint, not trained again
    keys = s3.keys(prefix + "/")
    for name in ("config.yaml", "metrics.jsonl", "model.keras", "summary.json", "report.md"):
        assert f"{prefix}/{name}" in keys
    assert json.loads(s3.read(f"{prefix}/summary.json"))["rounds"] == summary["rounds"]
    # the newest checkpoints only (keep=2), each whole: a manifest for every one
    ckpts = {k.split("/")[3] for k in keys if k.startswith(f"{prefix}/checkpoints/r")}
    assert len(ckpts) == 2 and all(f"{prefix}/checkpoints/{c}/manifest.json" in keys for c in ckpts)
    assert os.listdir(cwd) == []


def test_model_and_summary_read_back_from_s3(s3, resumed, tmp_path):
    """The final model loads from the run directory's URI (sparkcnn's reader, as ``evaluate
    --model s3://...`` does), and the Airflow task reads the summary (its XCom) and the exit
    file from there."""
    summary = resumed[0]
    script = (
        "import json, sys\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "from sparkcnn import scoring, inference\n"
        "path = scoring.model_path(sys.argv[1])\n"
        "model = inference.load_model_bytes(inference.model_bytes(path), path)\n"
        "import sparkcnn_task, airflow_dag\n"
        "sparkcnn_task.write_exit_file(sys.argv[1] + '.exit/train.json', 'train', 0)\n"
        "print(json.dumps({'path': path, 'outputs': int(model.output_shape[-1]),\n"
        "                  'xcom': airflow_dag.read_json(sys.argv[1] + '/summary.json'),\n"
        "                  'code': airflow_dag._exit_code(sys.argv[1] + '.exit/train.json', RuntimeError())}))\n")
    p = subprocess.run([sys.executable, "-c", script, summary["run_dir"], os.path.join(ROOT, "pipelines")],
                       cwd=tmp_path, capture_output=True, text=True,
                       env=s3.env(AIRFLOW_HOME=str(tmp_path / "airflow")), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["path"] == summary["run_dir"] + "/model.keras" and got["outputs"] == len(summary["classes"])
    # summary.json is the summary the CLI printed, less the report written after it
    assert got["xcom"] == {k: v for k, v in summary.items() if k != "report"} and got["code"] == 0
    assert json.loads(s3.read("exp/kill-resume.exit/train.json")) == {"command": "train", "exit_code": 0}


@pytest.mark.parametrize("case", ["bad key", "missing bucket"])
@pytest.mark.parametrize("flag", ["--run-dir", "--resume"])
def test_bad_credentials_or_missing_bucket_exit_2_writing_nothing(s3, tiny_data, tmp_path, case, flag):
    uri = f"s3://{BUCKET}/refused/x" if case == "bad key" else "s3://no-such-bucket/x"
    env = s3.env(AWS_SECRET_ACCESS_KEY="not-the-secret") if case == "bad key" else s3.env()
    args = ["train", "--no-progress", flag, uri]
    if flag == "--run-dir":
        args += ["--set", f"data.path={tiny_data}", "--set", "engine.master=inprocess"]
    p = _cli(args, env, tmp_path)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
    assert lines[0].startswith("sparkcnn train: error: run directory " + uri)
    assert ("'no-such-bucket' does not exist" if case == "missing bucket" else "ACCESS_DENIED") in lines[0]
    assert s3.keys("refused/") == []
    assert BUCKET in [b["Name"] for b in s3.client().list_buckets()["Buckets"]]
    assert "no-such-bucket" not in [b["Name"] for b in s3.client().list_buckets()["Buckets"]]
    assert os.listdir(tmp_path) == []


@pytest.fixture()
def s3_env(s3, monkeypatch):
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    for k, v in s3.env().items():
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)
    return s3


def test_checkpoints_on_s3_are_whole_and_latest_comes_last(s3_env):
    """In-process: save, prune and load through the object store; a LATEST naming a
    checkpoint with an object missing is refused by name; re-saving the name LATEST holds
    goes beside it, not over it."""
    import numpy as np

    from sparkcnn.checkpoint import load_checkpoint, save_checkpoint
    from sparkcnn.errors import BadInput

    run = f"s3://{BUCKET}/ckpt/run"
    for i in range(3):
        save_checkpoint(run, f"r{i:07d}", arrays={"W": np.full(4, i, np.float32)}, state={"i": i},
                        blocks={0: {"residual": np.arange(3) + i}}, keep=2)
    assert s3_env.read("ckpt/run/checkpoints/LATEST") == b"r0000002\n"
    assert {k.split("/")[3] for k in s3_env.keys("ckpt/run/checkpoints/r")} == {"r0000001", "r0000002"}
    ck = load_checkpoint(run)
    assert ck.name == "r0000002" and ck.state == {"i": 2} and ck.arrays["W"].tolist() == [2.0] * 4
    assert ck.blocks[0]["residual"].tolist() == [2, 3, 4]

    again = save_checkpoint(run, "r0000002", arrays={"W": np.zeros(4, np.float32)}, state={"i": 9})
    assert again == f"{run}/checkpoints/r0000002.4" and load_checkpoint(run).state == {"i": 9}
    assert load_checkpoint(f"{run}/checkpoints/r0000002").state == {"i": 2}  # not overwritten

    s3_env.client().delete_object(Bucket=BUCKET, Key="ckpt/run/checkpoints/r0000002.4/arrays.npz")
    with pytest.raises(BadInput, match=r"r0000002\.4/arrays\.npz: missing"):
        load_checkpoint(run)


def test_metrics_on_s3_are_rewritten_whole_at_each_flush(s3_env):
    from sparkcnn.metrics import JsonlSink, read_jsonl

    path = f"s3://{BUCKET}/jsonl/metrics.jsonl"
    sink = JsonlSink(path)
    sink.write({"round": 0})
    assert s3_env.keys("jsonl/") == []  # buffered: an object store cannot append
    sink.flush()
    sink.write({"round": 1})
    assert read_jsonl(path) == [{"round": 0}]
    sink.close()
    assert read_jsonl(path) == [{"round": 0}, {"round": 1}]
    again = JsonlSink(path)  # a resumed run appends to what is stored
    again.write({"round": 2})
    again.close()
    assert [r["round"] for r in read_jsonl(path)] == [0, 1, 2]


def test_an_evaluation_on_s3_is_replaced_whole(s3_env):
    """evaluate's --out on S3 (the run's evaluation/ in the Airflow DAG): the new set in place of
    the old one, a prediction file the new set lacks gone with it, no temporary objects left."""
    from sparkcnn import runfs

    out, tmp = f"s3://{BUCKET}/evalrep/evaluation", f"s3://{BUCKET}/evalrep/evaluation.tmp-1"
    for path, text in [("metrics.json", "old"), ("predictions/part-00000.parquet", "old0"),
                       ("predictions/part-00001.parquet", "old1")]:
        runfs.write_text(f"{out}/{path}", text)
    new = {"confusion_matrix.png": "png", "metrics.json": "new", "predictions/part-00000.parquet": "new0"}
    for path, text in new.items():
        runfs.write_text(f"{tmp}/{path}", text)
    assert runfs.files(tmp) == sorted(new)
    runfs.replace_dir(tmp, out, last="metrics.json")
    objects = [k for k in s3_env.keys("evalrep/") if not k.endswith("/")]  # pyarrow's folder markers aside
    assert objects == sorted(f"evalrep/evaluation/{p}" for p in new)
    assert not s3_env.keys("evalrep/evaluation.tmp-1")
    assert {p: runfs.read_text(f"{out}/{p}") for p in new} == new


def test_evaluate_into_a_missing_bucket_exits_2_before_spark(s3_env, resumed, tiny_data, capsys):
    from sparkcnn.cli import main

    out = "s3://no-such-bucket/x/evaluation"
    code = main(["evaluate", "--model", resumed[0]["run_dir"], "--data", os.path.join(tiny_data, "test"),
                 "--out", out])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == [f"sparkcnn evaluate: error: --out {out}: bucket 'no-such-bucket' does not exist"]
    assert "no-such-bucket" not in [b["Name"] for b in s3_env.client().list_buckets()["Buckets"]]
