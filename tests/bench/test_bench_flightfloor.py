"""bench/flightfloor.py measures every wire candidate's server CPU per message and reply latency
in one run, counts each message the server answered, and exits 2 on bad input."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WIRES = ["flight", "zmq", "socket-threads", "socket-selector"]


def _run(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "bench", "flightfloor.py"), *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_every_wire_is_measured_at_its_paced_rates_side_by_side():
    proc = _run("--reps", "1", "--rates", "40", "--seconds", "0.5", "--fanout", "3x20", "--load", "1")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["wires"] == WIRES and out["load_processes"] == 1
    assert [(c["wire"], c["streams"], c["rate_per_stream"]) for c in out["cases"]] == \
        [(w, 2, 40.0) for w in WIRES] + [(w, 3, 20.0) for w in WIRES]
    for c in out["cases"]:
        (rep,) = c["repetitions"]
        want = 40 if c["streams"] == 2 else 30  # 2 streams x 40/s x 0.5 s; 3 x 20/s x 0.5 s
        assert rep["messages"] == rep["answered"] == want and rep["refused"] == 0, c["wire"]
        assert rep["server_cpu_ms_per_message"] > 0 and rep["client_cpu_ms_per_message"] > 0
        assert 0 < c["reply_ms_p50"] <= c["reply_ms_p99"] and c["reply_ms_p99_each"] == [rep["reply_ms_p99"]]
        assert c["messages_per_s"] < 3 * want  # paced over about half a second, not back to back
    assert set(out["against_flight"]) == set(WIRES[1:])
    for rows in out["against_flight"].values():
        assert len(rows) == 2 and rows[0]["server_cpu_ms_per_message"] > 0
    # one repetition is too few to judge a wire better (bench/targets.py's rule)
    assert out["judged"] is False and set(out["better_than_flight"].values()) == {None}
    assert out["machine"]["wall_s"] > 0 and isinstance(out["machine"]["shared"], bool)
    assert out["provenance"]["git_commit"]


def test_back_to_back_and_one_wire_and_bad_input_exits_2():
    proc = _run("--reps", "1", "--rates", "0", "--fanout", "", "--wires", "socket-threads",
                "--min-messages", "50")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    (case,) = out["cases"]
    assert case["repetitions"][0]["answered"] == 2 * 300 and out["against_flight"] == {}
    for bad_args in (["--rates", "fast"], ["--rates", "-5"], ["--load", "-1"], ["--wires", "grpc"],
                     ["--fanout", "64"], ["--reps", "0"]):
        bad = _run(*bad_args)
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and bad.stdout == "", bad_args
        assert bad_args[1] in bad.stderr or bad_args[0] in bad.stderr
