"""bench/throughput.py: a stream case's speed counts only if the same run trained."""

from bench.throughput import ACCURACY_GATE, trained


def test_a_case_far_below_the_jobs_transports_accuracy_did_not_train():
    assert ACCURACY_GATE == 0.05
    assert not trained({"test_accuracy": 0.095}, 0.80)  # the per-round downlink's collapse
    assert not trained({"test_accuracy": 0.7499}, 0.80)
    assert trained({"test_accuracy": 0.7501}, 0.80) and trained({"test_accuracy": 0.86}, 0.80)
    assert not trained({"test_accuracy": None}, 0.80) and not trained({}, 0.80)  # no evaluation: unknown
    assert trained({"test_accuracy": 0.5}, None)  # no reference measured: judged by nothing else
