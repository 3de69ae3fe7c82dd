"""The stream with ps.servers > 1: server processes that each serve a disjoint set of blocks, with a
Run of their own, over one copy of the weights in shared memory. Every step applied once, the
records in one order, every server serving its blocks, nothing left behind; a run whose server is
killed resumes from its last cut across the servers."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import time

import pytest

from sparkcnn.errors import BadInput
from sparkcnn.metrics import read_jsonl

from tests.procs import pids_running
from tests.spark.test_stream_shards import ROWS_PER_BLOCK, _cfg


def server_pids() -> list[int]:
    return pids_running("sparkcnn.transport.serverprocess")


def segments() -> set[str]:
    """The shared-memory segments of this machine (a run's must be gone after it)."""
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def check_exactly_once(run_dir: str, epochs: int, blocks: int, steps_per_pass: int) -> list[dict]:
    """Every (block, epoch, step) applied once, the records numbered 0, 1, ... in file order."""
    rounds = [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if r["kind"] == "round"]
    assert [r["round"] for r in rounds] == list(range(len(rounds)))
    assert len({(r["block"], r["seq"]) for r in rounds}) == len(rounds)
    steps = [(r["block"], r["block_epoch"], r["block_step"] + i) for r in rounds for i in range(r["steps"])]
    assert len(steps) == len(set(steps)) == epochs * blocks * steps_per_pass
    return rounds


@pytest.mark.spark
def test_two_servers_split_the_blocks_on_spark(spark, tiny_cfg):
    """K = 2 on local[2]: block 0's pushes go to server 0, block 1's to server 1 (their services
    each opened one stream per stage), every step applied once, the versions one sequence over
    both, the run learns, and no server process or segment is left."""
    from sparkcnn.backends.spark import SparkBackend
    from sparkcnn.train import train

    before = segments()
    summary = train(_cfg(tiny_cfg, ps__servers=2), backend=SparkBackend(spark, "t-servers"))
    rounds = check_exactly_once(summary["run_dir"], 2, 2, ROWS_PER_BLOCK // 32)
    assert summary["test_accuracy"] > 0.6 and summary["rejected_deltas"] == 0
    assert summary["duplicates_dropped"] == 0
    assert len(summary["ps_address"].split(",")) == 2
    assert summary["stream"]["streams"] == 2 * 2 and summary["stream"]["messages"] >= len(rounds)
    assert max(r["version"] for r in rounds) == len(rounds)  # one version counter, bumped once per push
    assert server_pids() == [] and segments() <= before


def test_two_servers_in_process(tiny_cfg):
    """The same in process (blocks in turn): the servers' Runs move only their blocks' cursors,
    and the driver's merged cursors end every block's passes."""
    from sparkcnn.train import train

    summary = train(_cfg(tiny_cfg, engine__master="inprocess", ps__servers=2))
    check_exactly_once(summary["run_dir"], 2, 2, ROWS_PER_BLOCK // 32)
    assert summary["test_accuracy"] > 0.6
    assert server_pids() == []


def test_servers_config_is_checked(tiny_cfg):
    with pytest.raises(BadInput, match=r"^ps\.servers=2 needs engine\.transport=stream and engine\.mode"):
        tiny_cfg.replace(ps__servers=2)
    with pytest.raises(BadInput, match=r"^ps\.servers=2 and ps\.shards=2"):
        _cfg(tiny_cfg, ps__servers=2, ps__shards=2)
    with pytest.raises(BadInput, match=r"^ps\.servers=3 exceeds data\.num_blocks=2"):
        _cfg(tiny_cfg, ps__servers=3)
    with pytest.raises(BadInput, match=r"ps\.servers"):
        tiny_cfg.replace(ps__servers=0)


def test_a_run_whose_server_is_killed_resumes_losing_nothing(tiny_data, tmp_path):
    """K = 2, checkpoints every 2 exchanges (cuts across both servers inside the stages): the last
    server process is SIGKILLed mid epoch 2 (chaos.kill_shard_round). The run stops with an error
    (exit 1), no server process is left, and ``--resume`` completes every epoch with every step
    applied exactly once: the steps applied after the last cut are trained again from the blocks'
    states at it, none twice."""
    def cli(args, **kw):
        return subprocess.Popen([sys.executable, "-m", "sparkcnn", *args], stderr=subprocess.PIPE, text=True,
                                env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"), **kw)

    epochs, batch = 3, 24
    sets = [f"data.path={tiny_data}", "engine.master=local[2]", "engine.mode=async",
            "engine.transport=stream",
            f"train.epochs={epochs}", f"train.batch_size={batch}", "train.steps_per_round=1", "ps.servers=2",
            "train.lr_warmup_epochs=0", "compression.method=threshold", "compression.density=0.05",
            "compression.density_down=0.05", "engine.stream_timeout_s=20", "checkpoint.every_rounds=2",
            f"run.out_dir={tmp_path / 'runs'}"]
    common = ["-v", "train", "--no-progress", *[a for kv in sets for a in ("--set", kv)]]
    per_epoch = 2 * (ROWS_PER_BLOCK // batch)
    before = segments()
    run = cli([*common, "--set", f"chaos.kill_shard_round={per_epoch + per_epoch // 2}"])  # mid epoch 2
    rest = run.communicate(timeout=300)[1]
    assert run.returncode == 1, rest[-3000:]
    assert len(re.findall(r"checkpoint \S+ saved", rest)) >= 1, rest[-3000:]
    assert re.search(r"parameter server process 1", rest), rest[-3000:]
    deadline = time.monotonic() + 15
    while server_pids() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server_pids() == []
    (run_dir,) = glob.glob(str(tmp_path / "runs" / "*"))
    resumed = cli(["train", "--no-progress", "--resume", run_dir, "--set", "chaos.kill_shard_round=-1"])
    err = resumed.communicate(timeout=600)[1]
    assert resumed.returncode == 0, err[-3000:]
    after = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [r["epoch"] for r in after if r["kind"] == "epoch"] == list(range(epochs))
    check_exactly_once(run_dir, epochs, 2, ROWS_PER_BLOCK // batch)
    with open(os.path.join(run_dir, "summary.json")) as f:
        assert json.load(f)["test_accuracy"] > 0.6
    assert server_pids() == [] and segments() <= before
