"""bench/throughput.py: a stream case's speed counts only if the same run trained, judged against
its own variant's reference; every case divides by the run's one compute limit."""

from bench.throughput import ACCURACY_GATE, reference_key, trained


def test_a_case_far_below_its_own_variants_accuracy_did_not_train():
    assert ACCURACY_GATE == 0.05
    assert not trained({"test_accuracy": 0.095}, 0.80)  # the per-round downlink's collapse
    assert not trained({"test_accuracy": 0.7499}, 0.80)
    assert trained({"test_accuracy": 0.7501}, 0.80) and trained({"test_accuracy": 0.86}, 0.80)
    assert not trained({"test_accuracy": None}, 0.80) and not trained({}, 0.80)  # no evaluation: unknown


def test_no_reference_is_no_pass_and_every_repetition_is_gated():
    assert not trained({"test_accuracy": 0.9}, None)  # never a silent pass
    reps = [{"test_accuracy": a} for a in (0.80, 0.81, 0.10, 0.80, 0.79)]
    assert not trained({"test_accuracy": 0.80, "repetitions": reps}, 0.80)  # one repetition collapsed
    reps[2]["test_accuracy"] = 0.78
    assert trained({"test_accuracy": 0.80, "repetitions": reps}, 0.80)
    assert reference_key("async", 1, True) == "async-h1-sparse" != reference_key("async", 10, True)


def test_repeated_stream_cases_keep_every_repetitions_cpu_accuracy_and_their_medians(monkeypatch):
    """The result is the repetition of median images/s; the CPU figures are medians over all."""
    from bench import throughput

    runs = iter([  # images/s, the tasks' and the driver's CPU per exchange, test accuracy
        (900.0, 1.4, 0.80, 0.81), (1000.0, 1.6, 1.30, 0.80), (950.0, 1.5, 0.95, 0.79), (980.0, 1.2, 0.90, 0.82),
        (990.0, 1.3, 1.00, 0.80)])

    def once(data, h, mode, extra, limit_steps, run_id):
        assert limit_steps == 0  # no limit of its own: the run's one limit divides every case
        ips, task, driver, acc = next(runs)
        return {"images_per_s": ips, "task_overhead_cpu_ms_per_step": task, "test_accuracy": acc,
                "cpu_ms_per_round": {"driver": driver, "jvm": 0.1}, "run_id": run_id}

    monkeypatch.setattr(throughput, "_stream_once", once)
    out = throughput.measure_stream("data", 1, "async", [], reps=5)
    assert out["images_per_s"] == 980.0 and out["run_id"] == "bench-stream-async-h1-r3"  # the median's run
    assert [r["driver_cpu_ms_per_exchange"] for r in out["repetitions"]] == [0.80, 1.30, 0.95, 0.90, 1.00]
    assert [r["test_accuracy"] for r in out["repetitions"]] == [0.81, 0.80, 0.79, 0.82, 0.80]
    assert out["driver_cpu_ms_per_exchange_median"] == 0.95 and out["task_overhead_cpu_ms_per_step_median"] == 1.4


def test_the_run_limit_is_measured_once_with_its_repetitions(monkeypatch):
    from bench import throughput

    sums = iter([(5000.0, 5100.0), (5500.0, 5600.0), (4000.0, 4100.0), (5200.0, 5300.0), (5300.0, 5200.0)])

    def limit(engine, steps):
        a, b = next(sums)
        return [{"images_per_s": a, "step_ms": 10.0}, {"images_per_s": b, "step_ms": 11.0}]

    monkeypatch.setattr(throughput, "_limit_in_workers", limit)
    lim = throughput.measure_limit_once(None, 10)
    assert lim["repetitions"] == [10100.0, 11100.0, 8100.0, 10500.0, 10500.0]
    assert lim["images_per_s"] == 10500.0 and lim["step_ms"] == [10.0, 11.0]
