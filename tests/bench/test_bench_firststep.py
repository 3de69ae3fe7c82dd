"""bench/firststep.py: the first round record read from a run directory as it is being written,
its arguments checked, and one real start-up of the CLI on the tiny dataset."""

import importlib
import json
import os

import pytest

fs = importlib.import_module("bench.firststep")


def test_the_first_round_record_is_read_and_a_line_being_written_waits(tmp_path):
    run = tmp_path / "run-1"
    run.mkdir()
    assert fs._first_record(str(tmp_path)) is None  # no metrics yet
    metrics = run / "metrics.jsonl"
    metrics.write_text('{"kind": "round", "round": 0, "first_step_s": 12.5')  # half a line
    assert fs._first_record(str(tmp_path)) is None
    metrics.write_text('{"kind": "round", "round": 0, "first_step_s": 12.5}\n'
                       '{"kind": "round", "round": 1}\n')
    assert fs._first_record(str(tmp_path)) == {"kind": "round", "round": 0, "first_step_s": 12.5}


@pytest.mark.parametrize("argv, message", [(["--runs", "0"], "--runs must be >= 1, got 0"),
                                           (["--data", "."], "not a prepared dataset")])
def test_bad_arguments_exit_2_naming_them(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        fs.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_one_start_up_of_the_cli_on_the_tiny_dataset(capsys, tiny_data):
    conf = os.path.join(fs.ROOT, "conf", "fashion_mnist.yaml")
    out = fs.main(["--data", tiny_data, "--runs", "1", "--config", conf,
                   "--set", "train.batch_size=32", "--set", "train.steps_per_round=2"])
    (run,) = out["each"]
    # from the child's start (after the bench's clock started) to its first step, before the
    # round that holds it ended and its record was seen
    assert 0 < run["first_step_s"] < run["first_record_s"]
    assert out["median_first_step_s"] == run["first_step_s"]
    assert json.loads(capsys.readouterr().out)["benchmark"] == "firststep"
