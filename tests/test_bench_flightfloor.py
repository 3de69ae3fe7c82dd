"""bench/flightfloor.py measures a real Flight exchange's server CPU per message and exits 2 on bad input."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
