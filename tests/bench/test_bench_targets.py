"""bench/targets.py: the project's rule for judging a target, in code."""

from bench import targets as tg


def test_speed_needs_five_repetitions_and_accuracy_two_seeds():
    assert tg.judge(tg.SPEED, 1, True) == (tg.NOT_JUDGED, "1 repetition (needs 5)")
    assert tg.judge(tg.SPEED, 3, True)[0] == tg.NOT_JUDGED
    assert tg.judge(tg.SPEED, 5, True)[0] == tg.HOLDS and tg.judge(tg.SPEED, 5, False)[0] == tg.MISSES
    assert tg.judge(tg.ACCURACY, 1, True) == (tg.NOT_JUDGED, "1 seed (needs 2)")
    assert tg.judge(tg.ACCURACY, 2, False)[0] == tg.MISSES
    assert tg.judge(tg.SPEED, None, True)[0] == tg.NOT_JUDGED  # repetitions not recorded
    assert tg.judge(tg.SPEED, 5, None)[0] == tg.NOT_JUDGED  # no verdict recorded


def test_a_tail_latency_misses_when_one_repetition_is_over_the_bound():
    assert tg.judge(tg.TAIL, 5, None, [True] * 5)[0] == tg.HOLDS
    verdict, evidence = tg.judge(tg.TAIL, 5, None, [True, False, False, True, True])
    assert verdict == tg.MISSES and "2 over the bound" in evidence
    assert tg.judge(tg.TAIL, 5, None, [True])[0] == tg.NOT_JUDGED  # each repetition's figure missing


def test_psload_holds_on_its_median_but_misses_on_its_tail():
    case = {"workers": 64, "shards": 1, "pushes_per_s": 1050.0, "refused": 0, "repetitions": 5,
            "reply_ms": {"p99": 5.1}, "each": [{"reply_ms": {"p99": p}} for p in (3.2, 136.4, 93.5, 5.1, 4.2)]}
    doc = {"cases": [case], "target": {"pushes_per_s": 1000.0, "p99_ms": 50.0, "at_workers": 64, "met": True}}
    (t,) = tg.of_psload(doc)
    assert t.verdict == tg.MISSES and "136.4" in t.figure


def test_a_throughput_efficiency_without_one_run_limit_is_not_judged():
    case = {"efficiency_vs_limit": 0.95, "test_accuracy": 0.8, "trained": True, "repetitions": [{}] * 5}
    thr = {"stream": {"async_h10": case}, "targets": {"stream.async_h10.efficiency_vs_limit": ">= 0.93"},
           "targets_met": {"stream.async_h10.efficiency_vs_limit": True}}
    assert tg.of_throughput(thr)[0].verdict == tg.NOT_JUDGED
    thr["compute_limit"] = {"images_per_s": 11000.0, "repetitions": [10900.0, 11000.0, 11100.0, 11050.0, 10950.0]}
    assert tg.of_throughput(thr)[0].verdict == tg.HOLDS
    case["trained"] = False
    assert tg.of_throughput(thr)[0].verdict == tg.MISSES
    case.update(trained=True, test_accuracy=None)
    (t,) = tg.of_throughput(thr)
    assert t.verdict == tg.NOT_JUDGED and "test accuracy missing" in t.figure


def test_summary_counts_every_verdict():
    ts = [tg.Target("a", "1", tg.HOLDS, ""), tg.Target("b", "2", tg.MISSES, ""),
          tg.Target("c", "3", tg.NOT_JUDGED, ""), tg.Target("d", "4", tg.NOT_JUDGED, "")]
    assert tg.summary(ts) == "1 hold, 1 miss, 2 not judged, of 4"


def _servers_run(cpu_two: float, reps: int = 5) -> dict:
    """A psload result with K = 1 and K = 2 server processes at N = 16 and 64, K = 1 at 0.6 ms."""
    from bench import psload

    def case(n, s, cpu):
        return {"workers": n, "shards": 1, "servers": s, "server_cpu_ms_per_push": cpu, "refused": 0,
                "repetitions": reps}

    by = {(1, s, n): case(n, s, 0.6 if s == 1 else cpu_two) for n in (16, 64) for s in (1, 2)}
    return {"cases": list(by.values()), "servers_target": psload.servers_target(by)}


def test_the_servers_target_holds_within_ten_percent_and_misses_beyond_it():
    (t,) = tg.of_servers(_servers_run(0.65))
    assert t.verdict == tg.HOLDS and "N = 16: 1.083x" in t.figure and "10 %" in t.name
    (t,) = tg.of_servers(_servers_run(0.67))
    assert t.verdict == tg.MISSES and "N = 64: 1.117x" in t.figure
    assert tg.of_servers(_servers_run(0.6, reps=3))[0].verdict == tg.NOT_JUDGED


def test_psload_judges_its_load_target_on_one_server_and_the_servers_target_beside_it():
    doc = _servers_run(0.62)
    doc["target"] = {"pushes_per_s": 1000.0, "p99_ms": 50.0, "at_workers": 64, "met": True}
    for c in doc["cases"]:  # only the K = 1 case at N = 64 may decide the load target
        good = c["servers"] == 1 and c["workers"] == 64
        c.update(pushes_per_s=1050.0 if good else 10.0, reply_ms={"p99": 5.0 if good else 500.0},
                 each=[{"reply_ms": {"p99": 5.0 if good else 500.0}}] * 5)
    load, servers = tg.of_psload(doc)
    assert load.verdict == tg.HOLDS and servers.verdict == tg.HOLDS
    assert tg.of_servers({"cases": doc["cases"]}) == []  # a run without K = 2 judges no servers target


def _floor_run(cpu: float, p99s: list[float]) -> dict:
    """A psload result with one server at 64 workers and 1,000 pushes/s offered."""
    from bench import psload

    each = [{"reply_ms": {"p99": p}} for p in p99s]
    case = {"workers": 64, "shards": 1, "servers": 1, "offered_pushes_per_s": 1000.0,
            "server_cpu_ms_per_push": cpu, "refused": 0, "repetitions": len(p99s), "each": each,
            "cpu_parts_ms_per_push": {"wire": 0.1, "accept_apply": cpu - 0.1}}
    return {"cases": [case], "cpu_target": psload.cpu_target({(1, 1, 64): case})}


def test_the_floor_target_needs_its_cpu_on_the_median_and_its_p99_in_every_repetition():
    (t,) = tg.of_cpu(_floor_run(0.19, [3.0] * 5))
    assert t.verdict == tg.HOLDS and "0.190 ms/push (median) = wire 0.100 + accept_apply 0.090" in t.figure
    assert tg.of_cpu(_floor_run(0.21, [3.0] * 5))[0].verdict == tg.MISSES
    (t,) = tg.of_cpu(_floor_run(0.19, [3.0, 3.0, 12.0, 3.0, 3.0]))  # one repetition's tail over 10 ms
    assert t.verdict == tg.MISSES and "1 over the bound" in t.evidence
    assert tg.of_cpu(_floor_run(0.19, [3.0] * 3))[0].verdict == tg.NOT_JUDGED
    assert tg.of_cpu({"cases": []}) == []  # a run without that case judges nothing


# -- the CIFAR-10 seed table (accuracy-cifar10.json) ---------------------------------------------------

def _cifar() -> dict:
    """A small accuracy-cifar10.json: Keras 0.8600, the rows 0.855 down to 0.842 (one seed of the
    SAMomentum row collapsed), the longer run 0.905 over one seed."""
    import json
    import os

    path = os.path.join(os.path.dirname(__file__), "data", "accuracy-cifar10.json")
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def _set_mean(doc: dict, name: str, mean: float, collapsed: int = 0) -> None:
    row = next(r for r in doc["rows"] if r["name"] == name)
    row["test_accuracy_mean"], row["collapsed"] = mean, collapsed


def test_cifar_targets_are_three_judged_on_two_seeds_and_the_long_run_on_one():
    keras_row, sparse, long = tg.of_accuracy_cifar(_cifar())
    # a row with a collapsed seed misses the 1.5-point bound, whatever its mean over the rest
    assert keras_row.verdict == tg.MISSES and "1 collapsed" in keras_row.figure
    assert "stream-asgd 0.8500 ± 0.0020 (-1.00 points)" in keras_row.figure
    assert sparse.verdict == tg.HOLDS and sparse.evidence == "2 seeds, mean"
    assert "(-0.20 points)" in sparse.figure and "(-0.25 points)" in sparse.figure
    # its own statement asks for one seed: 0.905 >= 0.90 holds on it
    assert long.verdict == tg.HOLDS and long.evidence == "1 seed, mean" and long.figure == "0.9050"
    assert "90 epochs at 2 blocks" in long.name and ">= 0.90" in long.name
    doc = _cifar()
    doc["long"]["test_accuracy_mean"] = 0.899
    assert tg.of_accuracy_cifar(doc)[2].verdict == tg.MISSES
    assert tg.of_folder({"accuracy-cifar10": _cifar()})["accuracy-cifar10"][1] == sparse
    assert tg.of_result("accuracy-cifar10", _cifar()) == [keras_row, sparse, long]


def test_cifar_bounds_hold_at_the_bound_and_miss_past_it():
    doc = _cifar()
    _set_mean(doc, "stream-gs-asgd-samomentum", 0.8450)  # 1.5 points under Keras, no collapse
    assert tg.of_accuracy_cifar(doc)[0].verdict == tg.HOLDS
    _set_mean(doc, "sync-dense", 0.8440)  # 1.6 points under
    assert tg.of_accuracy_cifar(doc)[0].verdict == tg.MISSES
    _set_mean(doc, "stream-gs-asgd-ms", 0.8460)  # 0.4 points under ASGD
    assert tg.of_accuracy_cifar(doc)[1].verdict == tg.MISSES
    _set_mean(doc, "stream-gs-asgd-ms", 0.8600)  # above ASGD: holds
    assert tg.of_accuracy_cifar(doc)[1].verdict == tg.HOLDS
    doc["long"]["seeds"], doc["long"]["test_accuracy_mean"] = [42, 43], 0.8990
    assert tg.of_accuracy_cifar(doc)[2].verdict == tg.MISSES
    doc["long"]["test_accuracy_mean"] = 0.9010
    assert tg.of_accuracy_cifar(doc)[2].verdict == tg.HOLDS


def test_cifar_targets_over_one_seed_or_parts_not_run_are_shown_not_judged():
    doc = _cifar()
    for r in [doc["keras"], *doc["rows"]]:
        r["seeds"] = [42]
    # one seed is too few, even for the row whose seed collapsed
    assert [t.evidence for t in tg.of_accuracy_cifar(doc)[:2]] == ["1 seed (needs 2)"] * 2
    parts = {**_cifar(), "keras": None, "rows": [], "long": None}  # --parts two-blocks
    assert [t.verdict for t in tg.of_accuracy_cifar(parts)] == [tg.NOT_JUDGED] * 3
    assert tg.of_accuracy_cifar({"rows": []}) == [] and tg.of_accuracy_cifar(None) == []


def test_the_first_step_target_is_judged_on_the_median_of_five_runs():
    def doc(firsts):
        from bench import firststep

        med = sorted(firsts)[len(firsts) // 2]
        return {"median_first_step_s": med, "each": [{"first_step_s": f} for f in firsts],
                "target": {"first_step_s_at_most": firststep.TARGET_S, "repetitions": len(firsts),
                           "met": med <= firststep.TARGET_S}}

    (t,) = tg.of_firststep(doc([18.0, 19.5, 21.0, 17.2, 30.0]))
    assert t.verdict == tg.HOLDS and "19.5 s (median; each: 18.0, 19.5, 21.0, 17.2, 30.0 s)" in t.figure
    assert tg.of_firststep(doc([22.0] * 5))[0].verdict == tg.MISSES
    assert tg.of_firststep(doc([12.0] * 3))[0].verdict == tg.NOT_JUDGED
    assert tg.of_firststep({"each": []}) == []
