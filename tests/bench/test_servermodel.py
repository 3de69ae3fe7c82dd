"""bench/servermodel.py: the servers' model from psload's costs, its held-out check and its targets."""

import json

import pytest

from bench import servermodel as sm
from bench import targets as tg


def _psload(tmp_path, c16=0.7, c64=0.5, s2=0.6, d=0.1):
    def case(n, k, c):
        return {"workers": n, "shards": 1, "servers": k, "server_cpu_ms_per_push": c + (d if k == 2 else 0),
                "driver_cpu_ms_per_push": d if k == 2 else c,
                "server_process_cpu_ms_per_push": [c / 2, c / 2] if k == 2 else [],
                "capacity_pushes_per_s": 1000 / c if k == 1 else 1000 / max(d, c / 2),
                "bytes_per_push": {"up": 5000, "down": 30000}, "repetitions": 5}
    cases = [case(16, 1, c16), case(16, 2, s2 * c16 / c64), case(64, 1, c64), case(64, 2, s2)]
    path = tmp_path / "psload.json"
    path.write_text(json.dumps({"cases": cases, "provenance": {"commit": "abc"}}))
    return path


def _run(tmp_path, capsys, *argv):
    rc = sm.main(["--psload", str(_psload(tmp_path)), *argv])
    return rc, json.loads(capsys.readouterr().out) if rc == 0 else None


def test_the_model_splits_pushes_over_k_servers_and_grows_their_cost_linearly(tmp_path, capsys):
    rc, doc = _run(tmp_path, capsys, "--step-ms", "12", "--worker-ms", "2")
    assert rc == 0 and doc["fit"] == {"c_1_ms": 0.5, "s_2_ms": 0.6, "d_ms": 0.1, "at_workers": 64}
    by = doc["by_servers"]
    assert by["1"]["capacity_pushes_per_s"] == pytest.approx(2000.0)
    assert by["3"]["capacity_pushes_per_s"] == pytest.approx(3000 / 0.7)  # s(3) = 0.5 + 0.1 * 2
    assert set(by) == {str(k) for k in range(1, 8)}  # K <= cores - 1: the driver keeps a core
    # the workers bound it: 64 pushes per (12 + 2) ms at most, so S = 12 / 14 * 64 once the servers keep up
    assert by["7"]["speed_up"]["64"] == pytest.approx(12 / 14 * 64)
    assert doc["target"]["met"] and doc["best_servers"]["64"] == "4"  # the smallest K of the best
    v = doc["validation"]  # fitted at N = 16 (0.7 ms), checked against N = 64's measured capacities
    assert v["by_servers"]["1"]["error"] == pytest.approx(abs(1000 / 0.7 - 2000) / 2000)
    assert not v["passed"]  # 28.6 % off at K = 1
    held, speed = tg.of_servermodel(doc)[::-1], tg.of_servermodel(doc)[0]
    assert speed.verdict == tg.HOLDS and held[0].verdict == tg.MISSES and "28.6 %" in held[0].figure


def test_slow_workers_miss_the_target_and_few_repetitions_are_not_judged(tmp_path, capsys):
    rc, doc = _run(tmp_path, capsys, "--step-ms", "12", "--worker-ms", "4")  # 12 / 16 = 0.75 N at most
    assert rc == 0 and not doc["target"]["met"] and tg.of_servermodel(doc)[0].verdict == tg.MISSES
    doc["repetitions"] = 3
    assert tg.of_servermodel(doc)[0].verdict == tg.NOT_JUDGED


def test_a_psload_result_without_two_servers_at_two_n_exits_2(tmp_path, capsys):
    path = _psload(tmp_path)
    doc = json.loads(path.read_text())
    doc["cases"] = [c for c in doc["cases"] if c["workers"] == 64]
    path.write_text(json.dumps(doc))
    assert sm.main(["--psload", str(path), "--step-ms", "12"]) == 2
    assert "not a psload result with servers 1 and 2" in capsys.readouterr().err
