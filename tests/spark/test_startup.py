"""A run's start-up on the in-process backend: the first step's time in the records."""

import time

from sparkcnn.backends.inprocess import LocalBackend
from sparkcnn.clock import process_started
from sparkcnn.train import build_engine


def _engine(cfg, run_id):
    return build_engine(cfg, LocalBackend(run_id), run_id)[0]


def test_the_first_round_records_when_its_first_step_ended_after_the_process_started(tiny_cfg):
    engine = _engine(tiny_cfg.replace(run__deterministic=True), "t-first-step")
    before = time.time() - process_started()  # the process's age before the round: its steps come later
    first, second = engine.run_round(0), engine.run_round(1)
    assert before < first["first_step_s"] <= time.time() - process_started()
    assert "first_step_s" not in second  # the start-up is the engine's first exchange only
    assert engine.server.summary(1.0)["first_step_s"] == first["first_step_s"]
