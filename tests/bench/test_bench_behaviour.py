"""bench/behaviour.py's report logic on made-up results: thresholds, both verdicts, run order."""

import importlib

import numpy as np
import pytest

bh = importlib.import_module("bench.behaviour")


def run(acc, rate, code=0):
    return {"exit_code": code, "test_accuracy": acc, "images_per_s": rate}


def test_accuracy_within_and_beyond_three_tenths_of_a_point():
    assert bh.compare_accuracy(0.8800, 0.8830)["ok"]  # 30 of 10 000 test images: exactly 0.3 points
    assert bh.compare_accuracy(0.8830, 0.8800)["diff_points"] == pytest.approx(0.3)
    bad = bh.compare_accuracy(0.8800, 0.8831)
    assert not bad["ok"] and bad["diff_points"] == pytest.approx(0.31)
    assert not bh.compare_accuracy(None, 0.88)["ok"]


def test_images_per_s_within_ten_percent_either_way():
    assert bh.compare_rate(1000.0, 1100.0)["within_10pct"]
    assert bh.compare_rate(1000.0, 900.0)["within_10pct"]
    slow = bh.compare_rate(1000.0, 899.0)
    assert not slow["within_10pct"] and slow["ratio"] == pytest.approx(0.899)
    assert not bh.compare_rate(1000.0, 1101.0)["within_10pct"]
    assert not bh.compare_rate(None, 1000.0)["within_10pct"]


def test_weights_allclose_at_rtol_1e6_with_atol_0():
    base = [np.array([[1.0, -2.0], [0.5, 0.0]], np.float32), np.array([3.0], np.float32)]
    same = bh.compare_weights(base, [w.copy() for w in base])
    assert same["allclose"] and same["bitwise_equal"] and same["max_rel_diff"] == 0.0

    near = [base[0] * np.float32(1 + 5e-7), base[1]]  # float32 rounding keeps it under 1e-6
    r = bh.compare_weights(base, near)
    assert r["allclose"] and not r["bitwise_equal"] and 0 < r["max_rel_diff"] <= 1e-6

    far = [base[0], base[1] * np.float32(1 + 1e-5)]
    r = bh.compare_weights(base, far)
    assert not r["allclose"] and r["max_rel_diff"] == pytest.approx(1e-5, rel=0.05)

    off_zero = [np.array([[1.0, -2.0], [0.5, 1e-30]], np.float32), base[1]]  # atol = 0: no slack at 0
    r = bh.compare_weights(base, off_zero)
    assert not r["allclose"] and r["max_rel_diff"] == float("inf")
    assert bh.json_safe({"w": [r]})["w"][0]["max_rel_diff"] == "inf"  # strict JSON has no Infinity

    assert not bh.compare_weights(base, base[:1])["allclose"]


def test_variant_verdicts_from_aggregated_runs():
    base = bh.aggregate([run(0.880, 1000.0), run(0.882, 1040.0), run(None, None, code=1)])
    assert base["finished"] == 2 and base["test_accuracy"] == pytest.approx(0.881)
    assert base["images_per_s"] == pytest.approx(1020.0)

    ok = bh.compare_variant(False, base, bh.aggregate([run(0.883, 980.0)]))
    assert ok["passed"] and "weights" not in ok
    assert bh.summary_line("sync-dense", ok).endswith("-> ok")

    slow = bh.compare_variant(False, base, bh.aggregate([run(0.881, 900.0)]))
    assert not slow["passed"] and slow["accuracy"]["ok"]
    worse = bh.compare_variant(False, base, bh.aggregate([run(0.877, 1020.0)]))
    assert not worse["passed"] and worse["images_per_s"]["within_10pct"]
    failed = bh.compare_variant(False, base, bh.aggregate([run(None, None, code=3)]))
    assert not failed["passed"] and bh.summary_line("sync-sparse", failed).endswith("-> FAIL")


def test_deterministic_variant_is_judged_by_its_weights():
    a, b = bh.aggregate([run(0.85, 1000.0)]), bh.aggregate([run(0.85, 700.0)])
    assert bh.compare_variant(True, a, b, {"allclose": True, "max_rel_diff": 1e-7})["passed"]
    assert not bh.compare_variant(True, a, a, {"allclose": False, "max_rel_diff": 1e-3})["passed"]
    assert not bh.compare_variant(True, a, a, None)["passed"]


def test_run_order_alternates_by_variant_and_repeat():
    assert [bh.order_for(i, 0)[0] for i in range(4)] == ["base", "head", "base", "head"]
    assert [bh.order_for(i, 1)[0] for i in range(4)] == ["head", "base", "head", "base"]


def test_the_report_names_no_path_of_the_machine_that_ran_it():
    import os

    from bench._common import ROOT
    from bench.behaviour import portable

    report = {"runs": [{"command": f"sparkcnn train --set data.path={ROOT}/data/fashion-mnist "
                                   "--set run.out_dir=/var/tmp/sparkcnn-behaviour-runs-x/sync-dense/base-r0",
                        "summary": os.path.join(ROOT, "runs", "a", "summary.json")}],
              "index": "https://pypi.org/simple", "n": 3}
    out = portable(report)
    assert out["runs"][0]["command"] == ("sparkcnn train --set data.path=data/fashion-mnist "
                                         "--set run.out_dir=<tmp>/base-r0")
    assert out["runs"][0]["summary"] == "runs/a/summary.json"
    assert out["index"] == "https://pypi.org/simple" and out["n"] == 3


def test_accuracy_bound_widens_to_two_standard_deviations_of_the_base():
    """A base whose repetitions spread by 0.4 points admits a head 0.7 points away, not 0.9."""
    assert bh.compare_accuracy(0.8800, 0.8870, base_sd=0.004)["ok"]
    wide = bh.compare_accuracy(0.8800, 0.8890, base_sd=0.004)
    assert not wide["ok"] and wide["max_points"] == pytest.approx(0.8)
    assert bh.compare_accuracy(0.8800, 0.8831, base_sd=0.0001)["max_points"] == 0.3  # never below 0.3
    agg = bh.aggregate([run(0.880, 1000.0), run(0.884, 1040.0)])
    assert agg["test_accuracy_sd"] == pytest.approx(0.00282843, abs=1e-7)
