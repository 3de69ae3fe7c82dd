"""A run directory on a second kind of store, ``ftp://`` through fsspec (a real FTP server on
loopback, tests/ftpserver.py), beside S3 (tests/spark/test_objstore.py): a deterministic run that
crashes after a checkpoint and resumes from the ``ftp://`` URI alone ends bit-identical to the same
run kept in a local folder, with every round recorded once."""

import json
import os

import numpy as np

from sparkcnn import runfs
from sparkcnn.backends.inprocess import LocalBackend
from tests.ftpserver import ftp_server
from tests.spark.test_augment import CrashAt


def _weights(path: str, tmp_path) -> list[np.ndarray]:
    import keras

    local = tmp_path / f"{abs(hash(path))}.keras"
    local.write_bytes(runfs.read_bytes(path))
    return [w.numpy() for w in keras.saving.load_model(str(local)).weights]


def test_a_run_on_ftp_crashes_resumes_and_matches_the_local_run(tiny_cfg, tmp_path):
    from sparkcnn.train import train

    root = tmp_path / "ftp-root"
    root.mkdir()
    cfg = tiny_cfg.replace(run__deterministic=True, checkpoint__every_rounds=2, train__epochs=1,
                           compression__method="threshold", compression__density=0.05)  # 4 rounds
    clean = train(cfg, backend=LocalBackend("ftp-clean"), run_dir=str(tmp_path / "local" / "ftp-run"))
    with ftp_server(str(root)) as url:
        run_dir = f"{url}/runs/ftp-run"
        try:
            train(cfg, backend=LocalBackend("ftp-run"), progress=CrashAt(2), run_dir=run_dir)
            raise AssertionError("the run did not crash")
        except RuntimeError as e:
            assert "driver lost" in str(e)
        assert runfs.read_text(f"{run_dir}/checkpoints/LATEST").strip() == "r0000002"
        resumed = train(cfg, backend=LocalBackend("ftp-run"), run_dir=run_dir, resume=True)
        assert resumed["rounds"] == clean["rounds"]
        records = [json.loads(line) for line in runfs.read_text(f"{run_dir}/metrics.jsonl").splitlines()]
        rounds = [r["round"] for r in records if r["kind"] == "round"]
        assert rounds == list(range(clean["rounds"]))  # every round once, the rerun one included
        summary = json.loads(runfs.read_text(f"{run_dir}/summary.json"))
        assert summary["test_accuracy"] == clean["test_accuracy"]
        for a, b in zip(_weights(os.path.join(clean["run_dir"], "model.keras"), tmp_path),
                        _weights(f"{run_dir}/model.keras", tmp_path), strict=True):
            assert np.array_equal(a, b)
    stored = sorted(os.listdir(root / "runs" / "ftp-run"))
    assert {"checkpoints", "config.yaml", "metrics.jsonl", "model.keras", "summary.json"} <= set(stored)
    assert not [n for n in stored if ".tmp-" in n]  # every file moved into place, no temporary left
