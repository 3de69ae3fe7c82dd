"""bench/cifar_links.py: the slow-link rows, their medians, the model's prediction and the checks."""

import importlib

import pytest

cl = importlib.import_module("bench.cifar_links")
rows = importlib.import_module("bench.rows")
tg = importlib.import_module("bench.targets")


def test_the_rows_are_the_tables_asgd_and_gs_asgd_ms_at_two_blocks():
    assert set(cl.VARIANTS) == {"stream-asgd", "stream-gs-asgd-ms"}
    for name, v in cl.VARIANTS.items():
        assert "data.num_blocks=2" in v.sets and rows.file_value(v.config, "model.name") == "resnet20"
    assert rows.file_value(cl.VARIANTS["stream-asgd"].config, "compression.method") == "none"
    assert rows.file_value(cl.VARIANTS["stream-gs-asgd-ms"].config, "compression.density_down") == 0.01
    assert cl.RATES == ("unshaped", "100mbit", "10mbit") and (cl.TARGET_ACCURACY, cl.SPEEDUP) == (0.60, 3.0)


def _cell(t, ips=500.0, acc=0.65):
    return {"time_to_0_60_s": t, "images_per_s": ips, "test_accuracy": acc, "exposed_comm_ms_per_step": 1.0,
            "accuracy_per_epoch": [acc], "made": {"git_commit": "abc"}}


def test_medians_over_repetitions_and_none_when_one_never_reached():
    c = cl.repeated([_cell(300.0), _cell(100.0), _cell(200.0)])
    assert c["time_to_0_60_s"] == 200.0 and c["reps"] == 3 and len(c["repetitions"]) == 3
    assert cl.repeated([_cell(300.0), _cell(None)])["time_to_0_60_s"] is None


def _stream(t, up, down, ips=500.0):
    return {**_cell(t, ips), "bytes_up_per_step": up, "bytes_down_per_step": down, "blocks": 2, "batch_size": 128,
            "steps_per_round": 1, "transport": "stream"}


def test_the_model_slows_the_dense_row_behind_a_slow_link_and_the_speedup_is_judged_at_10mbit():
    cells = {"unshaped": {"stream-asgd": _stream(400.0, 1.1e6, 1.1e6), "stream-gs-asgd-ms": _stream(420.0, 2e3, 2e4)},
             "10mbit": {"stream-asgd": _stream(1800.0, 1.1e6, 1.1e6, 120.0),
                        "stream-gs-asgd-ms": _stream(500.0, 2e3, 2e4, 450.0)}}
    pred = cl.predicted(cells, beta=0.0)
    asgd, ms = pred["10mbit"]["stream-asgd"], pred["10mbit"]["stream-gs-asgd-ms"]
    # 2.2 MB an exchange at 1.25 MB/s (and tbf's framing): the wire, ~1.8 s an exchange of 256 images
    assert asgd["bound"] == "wire" and asgd["images_per_s"] == pytest.approx(256 / (2.2e6 * 1514 / 1448 / 1.25e6))
    assert ms["bound"] == "cpu" and ms["time_to_0_60_s"] == pytest.approx(420.0)
    checks = cl.checks_of(cells, pred, gate=0.5)
    speed = checks["gs_asgd_ms_0_60_speedup_at_10mbit"]
    assert speed["ratio"] == pytest.approx(3.6) and speed["passed"] and speed["predicted_ratio"] > 3
    assert all(checks[f"10mbit/{v}_trained"]["passed"] for v in cl.VARIANTS)
    cells["10mbit"]["stream-asgd"]["time_to_0_60_s"] = None  # ASGD never reached 0.60: no ratio, a miss
    assert not cl.checks_of(cells, pred, 0.5)["gs_asgd_ms_0_60_speedup_at_10mbit"]["passed"]
    judged = tg.of_links({"reps": 5, "checks": checks})
    assert [t.verdict for t in judged].count(tg.HOLDS) == len(checks)


@pytest.mark.parametrize("argv, message", [
    (["--reps", "0"], "--epochs and --reps must be >= 1, got 4, 0"),
    (["--rates", "unshaped,fast"], "--rates: "),
    (["--budget-min", "10"], "--budget-min needs --runs"),
    (["--data", "{tmp}/none"], "data <tmp>/none: no prepared dataset (make data-cifar10)"),
])
def test_bad_input_exits_2_with_one_line(argv, message, capsys, tmp_path):
    assert cl.main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
