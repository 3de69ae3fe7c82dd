"""The cost model on held-out links (bench/linkmodel.py): its fit, its verdict and its refusals."""

import json

import pytest

from bench import linkmodel

BETA = 4e-9  # seconds per shaped byte


def _cell(images_per_s, per_step, transport, h, blocks=2, batch=64, accuracy=0.8):
    return {"images_per_s": images_per_s, "bytes_up_per_step": per_step / 2, "bytes_down_per_step": per_step / 2,
            "blocks": blocks, "batch_size": batch, "steps_per_round": h, "transport": transport,
            "test_accuracy": accuracy}


def _links(beta=BETA, bend=None):
    """A links run whose every shaped cell is what the model says for ``beta`` (``bend``: a factor
    on one held-out cell's measured images/s)."""
    unshaped = {"stream-asgd": _cell(5000.0, 1.8e6, "stream", 1),
                "stream-gs-asgd-ms": _cell(5800.0, 6e4, "stream", 1),
                "jobs-sync-dense": _cell(4100.0, 1.8e5, "jobs", 10)}
    rates = {"unshaped": unshaped}
    for rate in ("1gbit", "100mbit", "20mbit"):
        rates[rate] = {}
        for v, c in unshaped.items():
            base = {**linkmodel.cell_inputs(c, v), "images_per_s": c["images_per_s"]}
            rates[rate][v] = {**c, "images_per_s": linkmodel.predict(base, beta, rate)[0]}
    if bend:
        (rate, v), f = bend
        rates[rate][v]["images_per_s"] *= f
    checks = {f"{r}/{v}_trained": {"passed": True} for r, cells in rates.items() for v in cells}
    return {"rates": rates, "checks": checks, "provenance": {"git_commit": "x"}}


def test_a_run_the_model_describes_is_fitted_back_and_its_held_out_cells_predicted():
    out = linkmodel.validate(_links())
    assert out["fit"]["beta_ns_per_byte"] == pytest.approx(BETA * 1e9, rel=1e-3)
    held = [c for c in out["cells"] if c["role"] == "held out"]
    assert {(c["rate"], c["variant"]) for c in held} == {(r, v) for r in ("100mbit", "20mbit")
                                                          for v in ("stream-asgd", "stream-gs-asgd-ms", "jobs-sync-dense")}
    assert out["max_abs_held_out_error"] < 1e-3 and out["passed"] is True
    # dense pushes at 100 Mbit/s wait for the wire; the sparse ones compute
    bound = {(c["rate"], c["variant"]): c["bound"] for c in out["cells"]}
    assert bound[("100mbit", "stream-asgd")] == "wire" and bound[("100mbit", "stream-gs-asgd-ms")] == "cpu"
    assert bound[("20mbit", "jobs-sync-dense")] == "cpu + wire"


def test_a_held_out_cell_off_by_more_than_a_quarter_fails_the_target():
    out = linkmodel.validate(_links(bend=(("20mbit", "stream-gs-asgd-ms"), 1.4)))
    assert out["passed"] is False
    assert out["max_abs_held_out_error"] == pytest.approx(1 - 1 / 1.4, rel=1e-3)
    # the bent cell was held out: the fit did not move
    assert out["fit"]["beta_ns_per_byte"] == pytest.approx(BETA * 1e9, rel=1e-3)


def test_a_cell_that_did_not_train_fails_the_target():
    doc = _links()
    doc["checks"]["100mbit/stream-asgd_trained"]["passed"] = False
    out = linkmodel.validate(doc)
    assert out["max_abs_held_out_error"] < 1e-3 and out["passed"] is False


def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, capsys):
    doc = _links()
    del doc["rates"]["20mbit"]
    src, out = tmp_path / "links.json", tmp_path / "out.json"
    src.write_text(json.dumps(doc))
    assert linkmodel.main(["--links", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "linkmodel: rate '20mbit' not measured (need unshaped, 1gbit, 100mbit, 20mbit)"
    assert not out.exists()
    doc = _links()
    del doc["rates"]["unshaped"]["stream-asgd"]["blocks"]
    src.write_text(json.dumps(doc))
    assert linkmodel.main(["--links", str(src)]) == 2
    assert "unshaped/stream-asgd: field 'blocks' missing" in capsys.readouterr().err
    assert linkmodel.main(["--reps", "0", "--out", str(out)]) == 2  # refused before any test bed starts
    assert capsys.readouterr().err.strip() == ("linkmodel: --train-rows must be >= 1000, --epochs and --reps >= 1, "
                                               "got 12000, 1, 0")
    assert not out.exists()


def test_a_run_read_from_a_file_is_judged_and_written_with_its_provenance(tmp_path, capsys):
    src, out = tmp_path / "links.json", tmp_path / "out.json"
    src.write_text(json.dumps(_links()))
    assert linkmodel.main(["--links", str(src), "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["passed"] is True and written["links_provenance"] == {"git_commit": "x"}
    assert "git_commit" in written["provenance"] and len(written["cells"]) == 12


def test_a_bursty_run_is_paced_slice_by_slice():
    """The warm-up's heavy first exchanges wait for the wire even where the mean would not: the
    same mean bytes, spread 10:1 over the run, predicts fewer images/s than spread evenly."""
    cell = _cell(5800.0, 6e4, "stream", 1)
    even = {**linkmodel.cell_inputs(cell, "even"), "images_per_s": 5800.0}
    heavy = [3.3e5] * 2 + [3e4] * 18  # the same mean, 6e4 bytes per exchange
    bursty = {**linkmodel.cell_inputs({**cell, "bytes_per_exchange_quantiles": heavy}, "bursty"),
              "images_per_s": 5800.0}
    assert sum(bursty["spread"]) / 20 == pytest.approx(6e4)
    p_even, b_even = linkmodel.predict(even, BETA, "100mbit")
    p_bursty, b_bursty = linkmodel.predict(bursty, BETA, "100mbit")
    assert b_even == "cpu" and b_bursty == "wire in 2 of 20 slices"
    t0 = 128 / 5800.0
    expect = 128 / ((18 * (t0 + BETA * 3e4) + 2 * 3.3e5 * 1514 / 1448 / 12.5e6) / 20)  # frames, not payload
    assert p_bursty == pytest.approx(expect) and p_bursty < p_even


def test_the_wire_term_counts_each_segments_headers():
    """A stream cell bound by its link everywhere moves its payload at the rate less the 66 bytes
    of headers each 1448-byte TCP segment carries: tbf meters frames, not payload."""
    cell = _cell(50000.0, 1e6, "stream", 1)  # 1 MB per exchange: the wire sets the pace at 20 Mbit/s
    base = {**linkmodel.cell_inputs(cell, "wire-bound"), "images_per_s": 50000.0}
    got, bound = linkmodel.predict(base, 0.0, "20mbit")
    assert bound == "wire" and got == pytest.approx(2 * 64 / (1e6 * 1514 / 1448 / 2.5e6), rel=1e-9)


def _round_trip_cell(server_first=0.008):
    """800 local steps of 2 blocks in a 10 s train wall: exchanges of 20 ms, two heavy slices first."""
    return {**_cell(800 * 64 / 10.0, 6e4, "stream", 1), "train_wall_s": 10.0, "steps": 800,
            "exchange_slices": {"bytes": [3e5] * 2 + [3e4] * 18, "period_s": [0.02] * 20,
                                "server_s": [server_first] * 2 + [0.002] * 18}}


def test_a_push_comes_back_after_the_servers_time_and_the_wire_both_ways():
    """With its exchanges in time order, a stream cell's reply must be back within the next
    exchange's compute: the driver's time on the push adds to the wire's, and the run's time
    outside its exchanges stays what it was."""
    cell = _round_trip_cell()
    base = {**linkmodel.cell_inputs(cell, "rt"), "images_per_s": cell["images_per_s"]}
    got, bound = linkmodel.predict(base, 0.0, "100mbit")
    rate_b = 12.5e6 * 1448 / 1514
    heavy = 0.008 + 3e5 / rate_b  # 33 ms against an exchange's 20 ms
    fixed = 10.0 - 400 * 0.02  # 400 exchanges per block
    expect = cell["images_per_s"] * 10.0 / (fixed + 400 * (2 * heavy + 18 * 0.02) / 20)
    assert bound == "wire in 2 of 20 slices" and got == pytest.approx(expect)
    # without the server's time the same bytes predict a faster run
    idle = _round_trip_cell(server_first=0.0)
    faster, _ = linkmodel.predict({**linkmodel.cell_inputs(idle, "rt"), "images_per_s": idle["images_per_s"]},
                                  0.0, "100mbit")
    assert faster == pytest.approx(cell["images_per_s"] * 10.0 / (fixed + 400 * (2 * 3e5 / rate_b + 18 * 0.02) / 20))
    assert faster > got
    # unshaped, the cell predicts itself
    assert linkmodel.predict(base, 0.0, "unshaped")[0] == cell["images_per_s"]


def test_exchange_slices_of_unequal_lengths_are_refused_naming_the_cell(tmp_path, capsys):
    doc = _links()
    doc["rates"]["unshaped"]["stream-gs-asgd-ms"].update(_round_trip_cell())
    doc["rates"]["unshaped"]["stream-gs-asgd-ms"]["exchange_slices"]["server_s"] = [0.002] * 19
    src = tmp_path / "links.json"
    src.write_text(json.dumps(doc))
    assert linkmodel.main(["--links", str(src)]) == 2
    assert capsys.readouterr().err.strip() == (
        "linkmodel: unshaped/stream-gs-asgd-ms: 'exchange_slices' needs three equal lists of numbers >= 0 "
        "(bytes, period_s, server_s)")
