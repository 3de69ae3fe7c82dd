"""bench/flightfloor.py measures a real Flight exchange's server CPU per message and exits 2 on bad input."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "bench", "flightfloor.py"), *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_the_floor_is_measured_per_message_and_bad_input_exits_2():
    proc = _run("--messages", "200", "--reps", "2", "--streams", "2")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert [r["messages"] for r in out["repetitions"]] == [200, 200]
    assert all(r["server_cpu_ms_per_message"] > 0 for r in out["repetitions"])  # the server did work
    assert out["server_cpu_ms_per_message"] < 50  # a bare echo: far below a push's handling
    assert out["provenance"]["git_commit"]
    bad = _run("--reps", "0")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and bad.stdout == ""


def test_paced_cases_send_at_their_rate_and_bad_rates_exit_2():
    proc = _run("--messages", "100", "--reps", "1", "--rates", "0,40", "--seconds", "1", "--load", "1")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["load_processes"] == 1
    fast, paced = out["cases"]
    assert [fast["rate_per_stream"], paced["rate_per_stream"]] == [0.0, 40.0]
    assert paced["repetitions"][0]["messages"] == 80  # 2 streams x 40/s x 1 s
    assert paced["messages_per_s"] < 100 < fast["messages_per_s"]  # paced: ~80/s in all
    assert all(c["client_cpu_ms_per_message"] > 0 and c["server_cpu_ms_per_message"] > 0 for c in (fast, paced))
    assert out["server_cpu_ms_per_message"] == fast["server_cpu_ms_per_message"]
    for bad_args in (["--rates", "fast"], ["--rates", "-5"], ["--load", "-1"]):
        bad = _run(*bad_args)
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and bad.stdout == "", bad_args
        assert bad_args[1] in bad.stderr
