"""The records of K = 2 server processes (ps.servers): each server encodes its records once and
sends them in batches (serverprocess.Channel); the driver puts them in the order of their round
and writes each line as it is (servers.InOrder). metrics.jsonl then holds, byte for byte, what
one server writes for the same exchanges, and the history, the trackers and the progress bar
see the same records in the same order."""

from __future__ import annotations

import io
import json
import time

import numpy as np
import pytest

from sparkcnn.metrics import JsonlSink
from sparkcnn.server.records import Timings, Where
from sparkcnn.server.run import APPLIED, RunShape
from sparkcnn.tracking import FanOut
from sparkcnn.transport.serverprocess import Channel, read_record
from sparkcnn.transport.servers import InOrder
from tests.unit.fake_run import arrival, initial_weights, make_cfg, make_run, make_spec, random_payload

BLOCKS, PUSHES = 4, 6


class Tracker:
    """A tracker as FanOut sees one: records only, no encoded lines."""

    def __init__(self):
        self.records: list[dict] = []

    def write(self, record: dict) -> None:
        self.records.append(record)

    def close(self) -> None:
        pass


class Bar:
    """The progress bar's calls: (round shown, total)."""

    def __init__(self):
        self.shown: list[tuple[int, int]] = []

    def round(self, rec: dict, total: int) -> None:
        self.shown.append((rec["round"], total))


def _run(tmp_path, name: str, progress=None):
    cfg = make_cfg("async", h=1, blocks=BLOCKS, density_down=0.1, extra=("engine.transport=stream",))
    run = make_run(cfg, make_spec(cfg), initial_weights(3), RunShape({b: PUSHES for b in range(BLOCKS)},
                                                                     bsp=False, downlink_every=2))
    run.records._progress = progress
    tracker = Tracker()
    sink = FanOut(JsonlSink(str(tmp_path / name)), tracker)
    run.open_records(sink)
    return run, sink, tracker


def _one_server(tmp_path):
    """A K = 1 run's records of real exchanges (Run.accept, then Run.write as the push handler
    writes them), and the path of its metrics.jsonl."""
    run, sink, _ = _run(tmp_path, "one.jsonl")
    rng = np.random.default_rng(1)
    for seq in range(PUSHES):
        for b in range(BLOCKS):
            d = run.accept(arrival(b, seq, run.version, seq, 1, 0.05, random_payload(rng, "float16")))
            assert d.kind == APPLIED
            run.write(d, Timings(compute_s=0.01 * (b + 1), apply_s=1e-4 / 3, server_cpu_s=1 / 7),
                      Where(transport="stream"), progress_at=(d.record.round, BLOCKS * PUSHES))
    sink.close()
    return run.history, tmp_path / "one.jsonl"


def _sent(records: list[dict]) -> list[str]:
    """The lines a server's Channel sends for ``records``, each batch flushed by a control line."""
    out = io.StringIO()
    channel = Channel(out)
    for i, rec in enumerate(records):
        channel.write(rec)
        if i % 2:
            channel.send({"cut_begin": True})
    channel.flush()
    return [line for line in out.getvalue().splitlines(keepends=True) if not line.startswith("{")]


def test_two_servers_records_out_of_order_make_one_servers_file(tmp_path):
    history, one = _one_server(tmp_path)
    bar = Bar()
    run, sink, tracker = _run(tmp_path, "two.jsonl", bar)
    order = InOrder(run, 0)
    # server j serves the blocks b mod 2 = j; server 1's records all arrive first, then server 0's
    lines = [_sent([r for r in history if r["block"] % 2 == j]) for j in (1, 0)]
    written = []
    for line in lines[0] + lines[1]:
        written += order.take(*read_record(line))
    sink.close()

    assert written == list(range(BLOCKS * PUSHES)) and order.pending == 0
    assert (tmp_path / "two.jsonl").read_bytes() == one.read_bytes()  # the same bytes, in round order
    assert run.history == history == tracker.records  # each record read once, as one server wrote it
    assert [r["round"] for r in map(json.loads, (tmp_path / "two.jsonl").read_text().splitlines())] == written
    assert bar.shown == [(r, order.total) for r in written]


def test_a_record_is_held_until_the_ones_before_it_are_in(tmp_path):
    history, _ = _one_server(tmp_path)
    run, sink, _ = _run(tmp_path, "two.jsonl")
    order = InOrder(run, 0)
    late, *rest = _sent(history[:3])
    assert order.take(*read_record(rest[1])) == [] and order.take(*read_record(rest[0])) == []
    assert order.pending == 2 and run.history == []
    assert order.take(*read_record(late)) == [0, 1, 2]
    sink.close()


def test_a_channel_sends_records_before_a_control_line_and_late_ones_alone():
    out = io.StringIO()
    channel = Channel(out)
    channel.write({"round": 7, "loss": 0.5})
    channel.send({"cut_part": {}})
    assert out.getvalue() == '7 {"round": 7, "loss": 0.5}\n{"cut_part": {}}\n'
    channel.write({"round": 8, "loss": float("nan")})  # no control line follows: the flusher sends it
    deadline = time.monotonic() + 10
    while "\n8 " not in out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert out.getvalue().endswith('8 {"round": 8, "loss": NaN}\n')


@pytest.mark.parametrize("line", ["{\"round\": 1}\n", "x {}\n", "12\n", "-1 {}\n"])
def test_a_line_that_is_not_a_record_is_refused(line):
    with pytest.raises(ValueError, match="not a record line"):
        read_record(line)


def test_a_server_process_sends_its_records_and_keeps_no_history(tmp_path):
    """A server process's Run opens its records with keep=False: every record still goes to the
    channel, whole, but none stays in its history (the driver keeps the run's)."""
    cfg = make_cfg("async", h=1, blocks=BLOCKS, density_down=0.1, extra=("engine.transport=stream",))
    run = make_run(cfg, make_spec(cfg), initial_weights(3), RunShape({b: PUSHES for b in range(BLOCKS)},
                                                                     bsp=False, downlink_every=2))
    out = io.StringIO()
    channel = Channel(out)
    run.open_records(channel, keep=False)
    rng = np.random.default_rng(1)
    for b in range(BLOCKS):
        d = run.accept(arrival(b, 0, run.version, 0, 1, 0.05, random_payload(rng, "float16")))
        run.write(d, Timings(compute_s=0.01), Where(transport="stream"))
    channel.flush()
    sent = [read_record(line) for line in out.getvalue().splitlines(keepends=True)]
    assert [json.loads(line)["round"] for _, line in sent] == list(range(BLOCKS))
    assert run.history == []
