"""The run directory's storage (sparkcnn.runfs) on a second kind of store: ``ftp://`` through
fsspec, against a real FTP server on loopback (tests/ftpserver.py). Every operation a run needs,
whole-file replacement with no temporary file left behind, and the one-line refusals."""

import os

import pytest

from sparkcnn import runfs
from sparkcnn.errors import BadInput
from tests.ftpserver import ftp_server


@pytest.fixture()
def ftp(tmp_path):
    root = tmp_path / "ftp-root"
    root.mkdir()
    with ftp_server(str(root)) as url:
        yield url, root


def test_a_run_directory_on_ftp_reads_and_writes_like_a_local_one(ftp):
    url, root = ftp
    run = runfs.join(f"{url}/runs", "r1")
    runfs.check(run)  # reachable, with these credentials
    assert not runfs.isdir(run) and runfs.listdir(run) == []
    runfs.makedirs(run)
    runfs.write_text(runfs.join(run, "config.yaml"), "train: {}\n")
    runfs.write_bytes(runfs.join(run, "checkpoints", "r0000002", "weights.npz"), b"\x00" * 70_000)
    runfs.write_text(runfs.join(run, "metrics.jsonl"), '{"round": 0}\n')
    runfs.write_text(runfs.join(run, "metrics.jsonl"), '{"round": 0}\n{"round": 1}\n')  # replaced whole
    assert runfs.isdir(run) and runfs.isfile(runfs.join(run, "config.yaml"))
    assert runfs.listdir(run) == ["checkpoints", "config.yaml", "metrics.jsonl"]
    assert runfs.read_text(runfs.join(run, "metrics.jsonl")) == '{"round": 0}\n{"round": 1}\n'
    assert runfs.read_bytes(runfs.join(run, "checkpoints", "r0000002", "weights.npz")) == b"\x00" * 70_000
    on_disk = sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)
    assert on_disk == ["runs/r1/checkpoints/r0000002/weights.npz", "runs/r1/config.yaml",
                       "runs/r1/metrics.jsonl"]  # no temporary file left beside them
    with pytest.raises(FileNotFoundError):
        runfs.read_bytes(runfs.join(run, "summary.json"))
    runfs.remove(runfs.join(run, "config.yaml"))
    assert not runfs.exists(runfs.join(run, "config.yaml"))
    runfs.rmtree(runfs.join(run, "checkpoints"))
    assert runfs.listdir(run) == ["metrics.jsonl"]


def test_a_wrong_password_or_an_unreachable_server_is_one_line_naming_the_uri(ftp):
    url, _ = ftp
    wrong = url.replace(":s3cret@", ":wrong@") + "/runs"
    masked = r"^run directory ftp://sparkcnn:\*\*\*@127\.0\.0\.1:\d+/runs: cannot access it"
    with pytest.raises(BadInput, match=masked) as e:
        runfs.check(wrong)
    assert "\n" not in str(e.value) and "wrong" not in str(e.value)  # one line, the password masked
    port = int(url.rsplit(":", 1)[1])
    closed = url.replace(f":{port}", f":{port + 1 if port < 65535 else port - 1}") + "/runs"
    with pytest.raises(BadInput, match="cannot access it"):
        runfs.check(closed)


@pytest.mark.parametrize("store", ["local", "ftp"])
def test_replace_dir_puts_the_new_set_in_place_of_the_old(store, tmp_path, request):
    """What evaluate's --out does: the whole new set replaces the old one, files the new set
    lacks go with the old, and the temporary directory is gone after."""
    base = str(tmp_path / "base") if store == "local" else request.getfixturevalue("ftp")[0] + "/base"
    out, tmp = runfs.join(base, "evaluation"), runfs.join(base, "evaluation.tmp-1")
    runfs.makedirs(base)
    for path, text in [("metrics.json", "old"), ("predictions/part-00000.parquet", "old0"),
                       ("predictions/part-00001.parquet", "old1")]:
        runfs.makedirs(os.path.dirname(runfs.join(out, path)))
        runfs.write_text(runfs.join(out, path), text)
    new = {"confusion_matrix.png": "png", "metrics.json": "new", "predictions/part-00000.parquet": "new0"}
    for path, text in new.items():
        runfs.makedirs(os.path.dirname(runfs.join(tmp, path)))
        runfs.write_text(runfs.join(tmp, path), text)
    assert runfs.files(tmp) == sorted(new)
    runfs.replace_dir(tmp, out, last="metrics.json")
    assert {p: runfs.read_text(runfs.join(out, p)) for p in runfs.files(out)} == new
    assert not runfs.exists(tmp) and runfs.files(tmp) == []
    assert runfs.listdir(base) == ["evaluation"]
