"""Trackers on real short trainings (in-process backend): an MLflow file store read back
through MlflowClient, TensorBoard event files read back through TensorFlow."""

import glob
import json
import os
import pathlib
import sys

import pytest

from sparkcnn import config
from sparkcnn.backends.inprocess import LocalBackend
from sparkcnn.errors import BadInput
from sparkcnn.metrics import read_jsonl
from sparkcnn.tracking import flat_params

EXPERIMENT = "sparkcnn-tests"


def _cfg(tiny_data, out_dir, *extra):
    return config.load(None, [f"data.path={tiny_data}", f"run.out_dir={out_dir}", "train.epochs=2",
                              "train.batch_size=32", "train.steps_per_round=5", "train.lr_warmup_epochs=0",
                              "train.lr_schedule=constant", f"tracking.mlflow_experiment={EXPERIMENT}", *extra])


@pytest.fixture(scope="module")
def tracked(tiny_data, tmp_path_factory):
    """One training with both trackers on; MLflow's server is a file store from MLFLOW_TRACKING_URI."""
    from sparkcnn.train import train

    root = tmp_path_factory.mktemp("tracked")
    uri = (root / "mlruns").as_uri()
    cfg = _cfg(tiny_data, root / "runs", "tracking.mlflow=true", "tracking.tensorboard=true")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        mp.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 takes file stores only when asked
        summary = train(cfg, backend=LocalBackend("t-tracked"))
    records = read_jsonl(os.path.join(summary["run_dir"], "metrics.jsonl"))
    return cfg, summary, uri, records


def _client(uri):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _runs(client):
    exp = client.get_experiment_by_name(EXPERIMENT)
    assert exp is not None, f"experiment {EXPERIMENT!r} missing"
    return client.search_runs([exp.experiment_id])


def test_mlflow_run_has_params_metrics_and_artifacts(tracked, tmp_path):
    cfg, summary, uri, records = tracked
    client = _client(uri)
    runs = _runs(client)
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.tags["sparkcnn.run_id"] == summary["run_id"]
    assert run.data.params == flat_params(cfg.replace(engine__transport="jobs"))  # as resolved for the run
    assert run.data.params["train.epochs"] == "2" and run.data.params["tracking.mlflow"] == "True"

    epochs = [r for r in records if r["kind"] == "epoch"]
    hist = client.get_metric_history(run.info.run_id, "epoch/test_accuracy")
    assert [(m.step, m.value) for m in sorted(hist, key=lambda m: m.step)] == \
        [(e["epoch"], pytest.approx(e["test_accuracy"])) for e in epochs]
    rounds = [r for r in records if r["kind"] == "round"]
    loss = client.get_metric_history(run.info.run_id, "round/loss")
    assert sorted(m.step for m in loss) == [r["round"] for r in rounds]
    assert {m.step: m.value for m in loss} == {r["round"]: pytest.approx(r["loss"]) for r in rounds}

    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"model.keras", "summary.json", "config.yaml"} <= names
    got = pathlib.Path(client.download_artifacts(run.info.run_id, "summary.json", str(tmp_path)))
    assert json.loads(got.read_text()) == json.loads(
        pathlib.Path(summary["run_dir"], "summary.json").read_text())
    model = pathlib.Path(client.download_artifacts(run.info.run_id, "model.keras", str(tmp_path)))
    assert model.read_bytes() == pathlib.Path(summary["run_dir"], "model.keras").read_bytes()


def test_tensorboard_scalars_read_back(tracked):
    import tensorflow as tf

    _, summary, _, records = tracked
    files = glob.glob(os.path.join(summary["run_dir"], "tensorboard", "events.out.tfevents.*"))
    assert len(files) == 1
    scalars: dict = {}
    for event in tf.compat.v1.train.summary_iterator(files[0]):
        for v in event.summary.value:
            scalars.setdefault(v.tag, {})[event.step] = float(tf.make_ndarray(v.tensor))
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert scalars["epoch/test_accuracy"] == {e["epoch"]: pytest.approx(e["test_accuracy"]) for e in epochs}
    assert scalars["epoch/test_loss"] == {e["epoch"]: pytest.approx(e["test_loss"]) for e in epochs}
    rounds = [r for r in records if r["kind"] == "round"]
    assert scalars["round/loss"] == {r["round"]: pytest.approx(r["loss"]) for r in rounds}
    assert scalars["round/bytes_up"] == {r["round"]: pytest.approx(r["bytes_up"]) for r in rounds}
    assert "round/round" not in scalars and "epoch/epoch" not in scalars  # ids are steps, not values


def test_interrupted_run_is_killed_then_resumed_in_the_same_mlflow_run(tiny_data, tmp_path, monkeypatch):
    from sparkcnn.train import train

    class CtrlCAfter:
        def round(self, rec, total):
            if rec["round"] == 2:
                raise KeyboardInterrupt

        def epoch(self, rec):
            pass

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    cfg = _cfg(tiny_data, tmp_path / "runs", "tracking.mlflow=true")
    run_dir = os.path.join(cfg.run.out_dir, "t-ctrl-c")
    with pytest.raises(KeyboardInterrupt):
        train(cfg, backend=LocalBackend("t-ctrl-c"), progress=CtrlCAfter(), run_dir=run_dir)
    client = _client(uri)
    (run,) = _runs(client)
    assert run.info.status == "KILLED"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "round/loss")) == [0, 1, 2]
    assert client.list_artifacts(run.info.run_id) == []  # no outputs from a run that did not finish

    summary = train(cfg, backend=LocalBackend("t-ctrl-c"), run_dir=run_dir, resume=True)
    (resumed,) = _runs(client)
    assert resumed.info.run_id == run.info.run_id and resumed.info.status == "FINISHED"
    steps = {m.step for m in client.get_metric_history(run.info.run_id, "round/loss")}
    assert steps == set(range(summary["rounds"]))
    assert [m.step for m in client.get_metric_history(run.info.run_id, "epoch/test_accuracy")] == [0, 1]
    assert "model.keras" in {a.path for a in client.list_artifacts(run.info.run_id)}


def test_missing_mlflow_is_bad_input_before_anything_is_written(tiny_data, tmp_path, monkeypatch):
    from sparkcnn.train import train

    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow now raises ImportError
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    cfg = _cfg(tiny_data, tmp_path / "runs", "tracking.mlflow=true")
    with pytest.raises(BadInput, match=r"^tracking\.mlflow=true needs MLflow"):
        train(cfg, backend=LocalBackend("t-no-mlflow"))
    assert not (tmp_path / "runs").exists()


def test_file_store_mlflow_refuses_is_bad_input_before_anything_is_written(tiny_data, tmp_path, monkeypatch):
    from sparkcnn.train import train

    try:
        from mlflow.environment_variables import MLFLOW_ALLOW_FILE_STORE  # noqa: F401
    except ImportError:
        pytest.skip("this MLflow takes file stores without being asked")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    cfg = _cfg(tiny_data, tmp_path / "runs", "tracking.mlflow=true")
    with pytest.raises(BadInput, match=r"^tracking\.mlflow=true: .*MLFLOW_ALLOW_FILE_STORE=true$"):
        train(cfg, backend=LocalBackend("t-file-store"))
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mlruns").exists()


def test_the_engine_knows_no_tracker():
    """Tracking is a sink: nothing in the server, the transports or the backends names a tracking package."""
    root = pathlib.Path(__file__).resolve().parents[2] / "sparkcnn"
    paths = [p for layer in ("server", "transport", "backends") for p in (root / layer).glob("*.py")]
    assert len(paths) > 10
    for path in paths:
        text = path.read_text().lower()
        assert "mlflow" not in text and "tensorboard" not in text and "tf.summary" not in text, path.name
