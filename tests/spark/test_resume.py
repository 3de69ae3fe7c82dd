"""Checkpoints and resume: SIGKILLed driver, bit-identical weights, refused damaged checkpoints."""

import glob
import hashlib
import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest


def _start(args) -> subprocess.Popen:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.Popen([sys.executable, "-m", "sparkcnn.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _finish(p: subprocess.Popen, check=True) -> subprocess.CompletedProcess:
    out, err = p.communicate(timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"exit {p.returncode}: {err[-2000:]}")
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _cli(args, check=True):
    return _finish(_start(args), check)


def _weights(run_dir):
    import keras

    model = keras.saving.load_model(os.path.join(run_dir, "model.keras"))
    return [w.numpy() for w in model.weights]


# checkpoint.every_rounds=2: the first checkpoint follows round 1 (r0000002). The driver is
# SIGKILLed after round 2, one recorded round past it: a resume starts from that checkpoint,
# reruns round 2 and must not record it twice.
KILL_ROUND = 2
FIRST_CHECKPOINT = "r0000002"


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    """On Spark local[2]: an uninterrupted run, and one whose driver is SIGKILLed after round
    ``KILL_ROUND``. Tests resume or damage copies of the killed run, never the run itself, so
    none depends on what another did before it."""
    out = tmp_path_factory.mktemp("resume")
    common = ["train", "--no-progress", "--set", f"data.path={tiny_data}", "--set", "engine.master=local[2]",
              "--set", "run.deterministic=true", "--set", "train.epochs=2", "--set", "train.batch_size=32",
              "--set", "train.steps_per_round=5", "--set", "checkpoint.every_rounds=2",
              "--set", "compression.method=threshold", "--set", "compression.density=0.02",
              "--set", "compression.density_down=0.05"]
    # both at once: each is mostly start-up latency (JVM, TF in the workers), and deterministic
    clean = _start([*common, "--set", f"run.out_dir={out / 'clean'}"])
    killed = _start([*common, "--set", f"run.out_dir={out / 'killed'}",
                     "--set", f"chaos.kill_driver_round={KILL_ROUND}"])
    clean, killed = _finish(clean), _finish(killed, check=False)
    total = json.loads(clean.stdout)["rounds"]
    assert total > KILL_ROUND + 1, f"{total} rounds: the kill after round {KILL_ROUND} would not be mid-run"
    assert killed.returncode == -9, killed.stderr[-2000:]
    (run_dir,) = glob.glob(str(out / "killed" / "*"))
    with open(os.path.join(run_dir, "checkpoints", "LATEST")) as fh:
        assert fh.read().strip() == FIRST_CHECKPOINT
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        records = [json.loads(line) for line in fh]
    assert [r["round"] for r in records if r["kind"] == "round"] == list(range(KILL_ROUND + 1))
    return json.loads(clean.stdout)["run_dir"], run_dir


def _copy(run_dir, tmp_path) -> str:
    """A copy of a run directory for one test; the same name, so the same run id."""
    import shutil

    copy = tmp_path / os.path.basename(run_dir)
    shutil.copytree(run_dir, copy)
    return str(copy)


def test_resume_after_sigkill_is_bit_identical(runs, tmp_path):
    clean_dir, killed = runs
    killed_dir = _copy(killed, tmp_path)
    assert not os.path.exists(os.path.join(killed_dir, "model.keras"))
    resumed = _cli(["train", "--no-progress", "--resume", killed_dir, "--set", "chaos.kill_driver_round=-1"])
    summary = json.loads(resumed.stdout)
    assert summary["run_dir"] == killed_dir
    for a, b in zip(_weights(clean_dir), _weights(killed_dir)):
        assert np.array_equal(a, b)
    with open(os.path.join(killed_dir, "metrics.jsonl")) as fh:
        records = [json.loads(line) for line in fh]
    rounds = [r["round"] for r in records if r["kind"] == "round"]
    assert rounds == list(range(summary["rounds"]))  # none duplicated (KILL_ROUND reran), none missing
    assert [r["epoch"] for r in records if r["kind"] == "epoch"] == [0, 1]


def test_flipped_byte_in_checkpoint_is_refused(runs, tmp_path):
    import pathlib

    _, killed = runs
    copy = pathlib.Path(_copy(killed, tmp_path))
    latest = open(copy / "checkpoints" / "LATEST").read().strip()
    target = copy / "checkpoints" / latest / "arrays.npz"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    before = {p: hashlib.sha256(open(p, "rb").read()).hexdigest()
              for p in glob.glob(str(copy / "**" / "*"), recursive=True) if os.path.isfile(p)}
    p = _cli(["train", "--no-progress", "--resume", str(copy)], check=False)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert "arrays.npz" in lines[-1] and "SHA-256" in lines[-1]
    after = {q: hashlib.sha256(open(q, "rb").read()).hexdigest()
             for q in glob.glob(str(copy / "**" / "*"), recursive=True) if os.path.isfile(q)}
    assert after == before  # nothing written, nothing removed


def test_ctrl_c_checkpoints_the_rounds_done_and_resume_finishes(tiny_cfg):
    """Ctrl-C between rounds: a checkpoint holds exactly the recorded rounds; --resume completes
    the run with no round missing or repeated."""
    from sparkcnn.backends.inprocess import LocalBackend
    from sparkcnn.train import train

    class CtrlCAfter:
        def __init__(self, round_):
            self.round_ = round_

        def round(self, rec, total):
            if rec["round"] == self.round_:
                raise KeyboardInterrupt

        def epoch(self, *a, **k):
            pass

        def close(self):
            pass

    cfg = tiny_cfg.replace(compression__method="threshold", compression__density=0.05)
    run_dir = os.path.join(cfg.run.out_dir, "ctrl-c")
    with pytest.raises(KeyboardInterrupt):
        train(cfg, backend=LocalBackend("ctrl-c"), progress=CtrlCAfter(2), run_dir=run_dir)
    ckpts = sorted(os.listdir(os.path.join(run_dir, "checkpoints")))
    assert "r0000003" in ckpts  # rounds 0..2 kept; round 2 is no regular checkpoint round
    assert not os.path.exists(os.path.join(run_dir, "model.keras"))
    summary = train(cfg, backend=LocalBackend("ctrl-c"), run_dir=run_dir, resume=True)
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        records = [json.loads(line) for line in fh]
    assert [r["round"] for r in records if r["kind"] == "round"] == list(range(summary["rounds"]))
    assert os.path.exists(os.path.join(run_dir, "model.keras"))


def test_resume_before_any_checkpoint_starts_the_run_over(tiny_cfg):
    """A driver that died before its first checkpoint: --resume reruns the same run id from
    round 0, and the metrics file holds each round once."""
    from sparkcnn.backends.inprocess import LocalBackend
    from sparkcnn.train import train

    class CrashAt:
        def round(self, rec, total):
            if rec["round"] == 1:
                raise RuntimeError("driver lost")

        def epoch(self, *a, **k):
            pass

        def close(self):
            pass

    run_dir = os.path.join(tiny_cfg.run.out_dir, "crash")
    with pytest.raises(RuntimeError):
        train(tiny_cfg, backend=LocalBackend("crash"), progress=CrashAt(), run_dir=run_dir)
    assert not os.path.exists(os.path.join(run_dir, "checkpoints"))
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        assert [json.loads(line)["round"] for line in fh] == [0, 1]
    summary = train(tiny_cfg, backend=LocalBackend("crash"), run_dir=run_dir, resume=True)
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        records = [json.loads(line) for line in fh]
    assert [r["round"] for r in records if r["kind"] == "round"] == list(range(summary["rounds"]))
    assert summary["test_accuracy"] > 0.3


def test_async_resume_after_sigkill_trains_every_step_once(tiny_data, tmp_path):
    """Async: the driver is SIGKILLed at a seeded random job after the first checkpoint (end of
    epoch 0); --resume completes the run, every (block, epoch, step) is recorded once and the
    samples trained add up to epochs x training rows (24-image batches divide each block)."""
    epochs, rows = 3, 1200
    common = ["train", "--no-progress", "--set", f"data.path={tiny_data}", "--set", "engine.master=inprocess",
              "--set", "engine.mode=async", "--set", f"train.epochs={epochs}", "--set", "train.batch_size=24",
              # one step per job: the job count is the same in every run, whatever the machine's speed
              # (jobs sized by time gave the killed run fewer jobs than the probe's kill index)
              "--set", "scheduler.target_job_seconds=0.001", "--set", "compression.method=threshold",
              "--set", "compression.density=0.05", "--set", "compression.density_down=0.05"]
    probe = json.loads(_cli([*common, "--set", f"run.out_dir={tmp_path / 'probe'}"]).stdout)
    with open(os.path.join(probe["run_dir"], "metrics.jsonl")) as fh:
        records = [json.loads(line) for line in fh]
    first_epoch = next(i for i, r in enumerate(records) if r["kind"] == "epoch")
    later = [r["round"] for r in records[first_epoch + 2:] if r["kind"] == "round"][:-1]
    seed = int(os.environ.get("SPARKCNN_TEST_SEED", random.Random().randrange(1 << 16)))
    kill_job = random.Random(seed).choice(later)
    killed = _cli([*common, "--set", f"run.out_dir={tmp_path / 'killed'}",
                   "--set", f"chaos.kill_driver_round={kill_job}"], check=False)
    assert killed.returncode == -9, (seed, kill_job, killed.stderr[-2000:])
    (run_dir,) = glob.glob(str(tmp_path / "killed" / "*"))
    assert os.path.isdir(os.path.join(run_dir, "checkpoints")), f"seed {seed}: killed before a checkpoint"
    resumed = json.loads(_cli(["train", "--no-progress", "--resume", run_dir,
                               "--set", "chaos.kill_driver_round=-1"]).stdout)
    assert resumed["run_dir"] == run_dir and os.path.exists(os.path.join(run_dir, "model.keras"))
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        records = [json.loads(line) for line in fh]
    jobs = [r for r in records if r["kind"] == "round"]
    keys = [(r["block"], r["block_epoch"], r["block_step"]) for r in jobs]
    assert len(keys) == len(set(keys)), f"seed {seed}: a step recorded twice"
    assert sum(r["samples"] for r in jobs) == epochs * rows, f"seed {seed}"
    assert [r["epoch"] for r in records if r["kind"] == "epoch"] == list(range(epochs))
    assert len({r["round"] for r in jobs}) == len(jobs)
