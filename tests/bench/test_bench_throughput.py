"""bench/throughput.py: a stream case's speed counts only if the same run trained."""

from bench.throughput import ACCURACY_GATE, trained


def test_a_case_far_below_the_jobs_transports_accuracy_did_not_train():
    assert ACCURACY_GATE == 0.05
    assert not trained({"test_accuracy": 0.095}, 0.80)  # the per-round downlink's collapse
    assert not trained({"test_accuracy": 0.7499}, 0.80)
    assert trained({"test_accuracy": 0.7501}, 0.80) and trained({"test_accuracy": 0.86}, 0.80)
    assert not trained({"test_accuracy": None}, 0.80) and not trained({}, 0.80)  # no evaluation: unknown
    assert trained({"test_accuracy": 0.5}, None)  # no reference measured: judged by nothing else


def test_repeated_stream_cases_keep_every_repetitions_cpu_and_their_medians(monkeypatch):
    """The result is the repetition of median efficiency; the CPU figures are medians over all."""
    from bench import throughput

    runs = iter([  # images/s, its limits, the tasks' and the driver's CPU per exchange
        (900.0, 1.4, 0.80), (1000.0, 1.6, 1.30), (950.0, 1.5, 0.95), (980.0, 1.2, 0.90), (990.0, 1.3, 1.00)])

    def once(data, h, mode, extra, limit_steps, run_id):
        ips, task, driver = next(runs)
        return {"images_per_s": ips, "limit_before_after": [1000.0, 1000.0], "task_overhead_cpu_ms_per_step": task,
                "cpu_ms_per_round": {"driver": driver, "jvm": 0.1}, "run_id": run_id}

    monkeypatch.setattr(throughput, "_stream_once", once)
    out = throughput.measure_stream("data", 1, "async", [], limit_steps=10, reps=5)
    assert out["images_per_s"] == 980.0 and out["run_id"] == "bench-stream-async-h1-r3"  # the median ratio's run
    assert [r["driver_cpu_ms_per_exchange"] for r in out["repetitions"]] == [0.80, 1.30, 0.95, 0.90, 1.00]
    assert out["driver_cpu_ms_per_exchange_median"] == 0.95 and out["task_overhead_cpu_ms_per_step_median"] == 1.4
