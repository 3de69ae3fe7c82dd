"""Scheduling policy (pure tier): table-driven inputs -> expected decisions."""

from __future__ import annotations

import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkcnn.errors import BadInput
from sparkcnn.scheduler import (
    AsyncPolicy,
    BlockSpeed,
    DecisionKind,
    ExecutorSample,
    pipeline_depth,
    size_sync_steps,
    task_slots,
)

SUBMIT, HOLD = DecisionKind.SUBMIT, DecisionKind.HOLD


# -- sync: steps per block --------------------------------------------------------------

@pytest.mark.parametrize("speeds, base, bounds, expected", [
    pytest.param({0: 100.0, 1: 100.0, 2: 100.0}, 10, {}, {0: 10, 1: 10, 2: 10}, id="equal-speeds"),
    pytest.param({0: 100.0, 1: 100.0, 2: 50.0}, 10, {}, {0: 10, 1: 10, 2: 5}, id="one-2x-slower-half-steps"),
    pytest.param({0: 200.0, 1: 100.0, 2: 100.0}, 10, {}, {0: 20, 1: 10, 2: 10}, id="one-2x-faster-double"),
    # median of 100 and 50 is 75: 10 * 100/75 = 13.3 -> 13, 10 * 50/75 = 6.7 -> 7
    pytest.param({0: 100.0, 1: 50.0}, 10, {}, {0: 13, 1: 7}, id="two-blocks-median-between"),
    pytest.param({0: 100.0, 1: None, 2: 50.0, 3: 100.0}, 10, {}, {0: 10, 1: 10, 2: 5, 3: 10},
                 id="unknown-gets-base"),
    pytest.param({0: None, 1: None}, 7, {}, {0: 7, 1: 7}, id="all-unknown"),
    pytest.param({0: 0.0, 1: 100.0, 2: 100.0}, 10, {}, {0: 10, 1: 10, 2: 10}, id="zero-speed-is-unknown"),
    pytest.param({0: 400.0, 1: 100.0, 2: 1.0}, 10, {"min_steps": 2, "max_steps": 30},
                 {0: 30, 1: 10, 2: 2}, id="clamped-both-ends"),
    pytest.param({0: 100.0, 1: 100.0, 2: 1.0}, 10, {}, {0: 10, 1: 10, 2: 1}, id="never-below-one"),
    pytest.param({0: None}, 50, {"max_steps": 20}, {0: 20}, id="unknown-clamped"),
    pytest.param({0: 100.0, 1: 100.0, 2: 25.0}, 10, {}, {0: 10, 1: 10, 2: 3}, id="half-rounds-up"),
    pytest.param({}, 10, {}, {}, id="no-blocks"),
])
def test_size_sync_steps(speeds, base, bounds, expected):
    assert size_sync_steps(speeds, base, **bounds) == expected


@given(st.dictionaries(st.integers(0, 63), st.floats(1.0, 1e5), min_size=1, max_size=16),
       st.integers(1, 200))
@settings(max_examples=200, deadline=None)
def test_sync_task_times_match(speeds, base):
    """Unclamped, every task lasts base steps at the median speed, within half a step."""
    steps = size_sync_steps(speeds, base)
    ordered = sorted(speeds, key=speeds.get)
    assert [steps[k] for k in ordered] == sorted(steps.values())  # faster never gets fewer
    ref = statistics.median(speeds.values())
    for k, s in speeds.items():
        if steps[k] > 1:  # 1 may be the min_steps clamp
            assert abs(steps[k] / s - base / ref) <= 0.5 / s + 1e-9


@pytest.mark.parametrize("kwargs, field", [
    ({"base_steps": 0}, "base_steps"),
    ({"base_steps": 10, "min_steps": 0}, "min_steps"),
    ({"base_steps": 10, "min_steps": 5, "max_steps": 4}, "max_steps"),
    ({"base_steps": True}, "base_steps"),
])
def test_size_sync_steps_rejects(kwargs, field):
    with pytest.raises(BadInput, match=f"`{field}` must be"):
        size_sync_steps({0: 1.0}, **kwargs)


@pytest.mark.parametrize("mode, pipeline, depth", [
    ("sync", False, 1), ("sync", True, 2), ("async", False, 1), ("async", True, 1),
])
def test_pipeline_depth(mode, pipeline, depth):
    assert pipeline_depth(mode, pipeline) == depth


def test_pipeline_depth_rejects_mode():
    with pytest.raises(BadInput, match=r"`engine.mode` must be one of sync, async, got 'ring'"):
        pipeline_depth("ring", False)


# -- async: decisions -------------------------------------------------------------------

def ex(eid: str, cores: int = 2, running: int = 0) -> ExecutorSample:
    return ExecutorSample(eid, cores, running, 0)


def speeds(**by_block) -> dict[int, BlockSpeed]:
    """speeds(b0=(100.0, "e1")) -> {0: BlockSpeed(0, 100.0, "e1")}"""
    return {int(k[1:]): BlockSpeed(int(k[1:]), s, e) for k, (s, e) in by_block.items()}


POLICY = dict(batch_size=32, target_job_seconds=1.0, default_steps=20, max_staleness=8)

# id, policy overrides, applied base versions, decide() kwargs, expected (kind, block, steps)
CASES = [
    ("slot-filling", {}, {},
     dict(now_version=0, free_slots=2, idle_blocks=[0, 1, 2, 3], in_flight={}),
     [(SUBMIT, 0, 20), (SUBMIT, 1, 20), (HOLD, 2, 0), (HOLD, 3, 0)]),
    ("more-slots-than-blocks", {}, {},
     dict(now_version=0, free_slots=5, idle_blocks=[2, 0], in_flight={}),
     [(SUBMIT, 0, 20), (SUBMIT, 2, 20)]),
    ("no-free-slot", {}, {},
     dict(now_version=3, free_slots=0, idle_blocks=[1, 0], in_flight={2: 3}),
     [(HOLD, 0, 0), (HOLD, 1, 0)]),
    ("stalest-first", {}, {0: 5, 1: 2, 2: 7},
     dict(now_version=9, free_slots=2, idle_blocks=[0, 1, 2], in_flight={}),
     [(SUBMIT, 1, 20), (SUBMIT, 0, 20), (HOLD, 2, 0)]),
    ("never-applied-first", {}, {0: 0, 1: 1},
     dict(now_version=2, free_slots=1, idle_blocks=[0, 1, 2], in_flight={}),
     [(SUBMIT, 2, 20), (HOLD, 0, 0), (HOLD, 1, 0)]),
    ("locality-breaks-ties", {}, {},
     dict(now_version=0, free_slots=1, idle_blocks=[0, 1, 2], in_flight={},
          speeds=speeds(b0=(None, "e1"), b1=(None, "e2"), b2=(None, "e2")),
          executors=[ex("e1", 2, 2), ex("e2", 2, 1)]),
     [(SUBMIT, 1, 20), (HOLD, 0, 0), (HOLD, 2, 0)]),
    ("locality-uses-up-slots", {}, {},   # e2 has one free slot: block 1 takes it, 0 beats 2 by id
     dict(now_version=0, free_slots=2, idle_blocks=[0, 1, 2], in_flight={},
          speeds=speeds(b0=(None, "e1"), b1=(None, "e2"), b2=(None, "e2")),
          executors=[ex("e1", 2, 2), ex("e2", 2, 1)]),
     [(SUBMIT, 1, 20), (SUBMIT, 0, 20), (HOLD, 2, 0)]),
    ("staleness-before-locality", {}, {0: 1, 1: 4},
     dict(now_version=5, free_slots=1, idle_blocks=[0, 1], in_flight={},
          speeds=speeds(b0=(None, "e1"), b1=(None, "e2")), executors=[ex("e1", 1, 1), ex("e2")]),
     [(SUBMIT, 0, 20), (HOLD, 1, 0)]),
    ("bound-caps-jobs-in-flight", {"max_staleness": 2}, {},
     dict(now_version=10, free_slots=3, idle_blocks=[0, 1, 2], in_flight={5: 10, 6: 10}),
     [(SUBMIT, 0, 20), (HOLD, 1, 0), (HOLD, 2, 0)]),
    ("bound-zero-is-one-at-a-time", {"max_staleness": 0}, {},
     dict(now_version=0, free_slots=2, idle_blocks=[0, 1], in_flight={}),
     [(SUBMIT, 0, 20), (HOLD, 1, 0)]),
    ("straggler-at-bound-still-ok", {"max_staleness": 3}, {},   # tau_hat_0 = 3 + 0
     dict(now_version=10, free_slots=4, idle_blocks=[2, 3, 4], in_flight={0: 7, 1: 10}),
     [(SUBMIT, 2, 20), (SUBMIT, 3, 20), (HOLD, 4, 0)]),
    ("straggler-past-bound-holds-all", {"max_staleness": 3}, {},   # tau_hat_0 = 4 > 3
     dict(now_version=10, free_slots=4, idle_blocks=[3, 2], in_flight={0: 6, 1: 9}),
     [(HOLD, 2, 0), (HOLD, 3, 0)]),
    ("unbounded", {"max_staleness": None}, {},
     dict(now_version=100, free_slots=2, idle_blocks=[0, 1], in_flight={2: 0, 3: 1}),
     [(SUBMIT, 0, 20), (SUBMIT, 1, 20)]),
    # 1 s * 800 img/s / 32 img/step = 25 steps; 3200 -> 100 -> 60; 1 -> 0.03 -> 5; unknown -> 20
    ("job-sizing", {"min_steps": 5, "max_steps": 60}, {},
     dict(now_version=0, free_slots=4, idle_blocks=[0, 1, 2, 3], in_flight={},
          speeds=speeds(b0=(800.0, None), b1=(3200.0, None), b2=(1.0, None), b3=(None, None))),
     [(SUBMIT, 0, 25), (SUBMIT, 1, 60), (SUBMIT, 2, 5), (SUBMIT, 3, 20)]),
    ("job-sizing-target", {"target_job_seconds": 2.5}, {},   # 2.5 s * 64 / 32 = 5
     dict(now_version=0, free_slots=1, idle_blocks=[0], in_flight={}, speeds=speeds(b0=(64.0, "e1"))),
     [(SUBMIT, 0, 5)]),
]


@pytest.mark.parametrize("overrides, applied, call, expected",
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_async_decide(overrides, applied, call, expected):
    policy = AsyncPolicy(**{**POLICY, **overrides})
    for block, base in applied.items():
        policy.applied(block, base)
    got = policy.decide(**call)
    assert [(d.kind, d.block, d.steps) for d in got] == expected
    assert all(d.reason and "\n" not in d.reason for d in got)


def test_hold_reasons_say_why():
    policy = AsyncPolicy(**{**POLICY, "max_staleness": 3})
    held = policy.decide(10, 4, [2], {0: 6, 1: 9})
    assert held[0].reason.startswith("staleness: block 0 in flight is headed for tau=4 > max_staleness 3")
    assert policy.decide(0, 0, [2], {})[0].reason == "no free slot"
    local = policy.decide(0, 1, [1], {}, speeds(b1=(None, "e2")), [ex("e2")])[0]
    assert "local to e2" in local.reason


def test_speed_and_executor_remembered():
    policy = AsyncPolicy(**POLICY)
    policy.decide(0, 1, [0], {}, speeds(b0=(640.0, "e1")))
    # a later sample without a speed keeps the last one (20 steps = 1 s * 640 / 32)
    [d] = policy.decide(1, 1, [0], {}, speeds(b0=(None, None)))
    assert (d.kind, d.steps) == (SUBMIT, 20)
    assert policy.last_executor == {0: "e1"}


def test_applied_keeps_newest_base():
    policy = AsyncPolicy(**POLICY)
    policy.applied(0, 7)
    policy.applied(0, 5)  # a late duplicate does not make the block look staler
    assert policy.last_applied == {0: 7}


@given(st.integers(1, 12), st.integers(1, 12), st.integers(0, 10), st.integers(1, 60))
@settings(max_examples=150, deadline=None)
def test_async_bound_holds_and_slots_stay_busy(blocks, slots, bound, landings):
    """Equal-length jobs land in start order: tau never exceeds the bound, and
    min(slots, blocks, bound + 1) jobs are always in flight after decide()."""
    policy = AsyncPolicy(**{**POLICY, "max_staleness": bound})
    version, running = 0, []  # running: [(block, base)] in start order

    def fill() -> None:
        idle = [k for k in range(blocks) if k not in dict(running)]
        for d in policy.decide(version, slots - len(running), idle, dict(running)):
            if d.kind is SUBMIT:
                running.append((d.block, version))
        assert len(running) == min(slots, blocks, bound + 1)

    fill()
    for _ in range(landings):
        block, base = running.pop(0)
        assert version - base <= bound
        policy.applied(block, base)
        version += 1
        fill()


@pytest.mark.parametrize("build, match", [
    (lambda: ExecutorSample("e1", -1, 0, 0), r"`executor e1: cores` must be an int >= 0, got -1"),
    (lambda: ExecutorSample("", 1, 0, 0), r"`executor_id` must be a non-empty string"),
    (lambda: BlockSpeed(3, float("nan"), None), r"block 3: `images_per_s` must be a finite number"),
    (lambda: AsyncPolicy(32, 0.0, 10), r"`scheduler.target_job_seconds` must be > 0, got 0.0"),
    (lambda: AsyncPolicy(0, 1.0, 10), r"`batch_size` must be an int >= 1, got 0"),
    (lambda: AsyncPolicy(32, 1.0, 10, max_staleness=-1), r"`ps.max_staleness` must be an int >= 0"),
    (lambda: AsyncPolicy(**POLICY).decide(3, 1, [0], {0: 1}), r"blocks \[0\] are both idle and in flight"),
    (lambda: AsyncPolicy(**POLICY).decide(3, 1, [0], {1: 4}), r"block 1: base version 4 is ahead"),
    (lambda: AsyncPolicy(**POLICY).decide(3, -1, [0], {}), r"`free_slots` must be an int >= 0"),
    (lambda: ExecutorSample("e1", 1, 0, 0, -2), r"`executor e1: completed_tasks` must be an int >= 0"),
    (lambda: task_slots([], 0), r"`blocks` must be an int >= 1, got 0"),
])
def test_rejects_bad_input(build, match):
    with pytest.raises(BadInput, match=match):
        build()


def test_free_slots_of_busy_executor():
    assert ExecutorSample("e1", 2, 5, 1).free_slots == 0
    assert ExecutorSample("e1", 4, 1, 0).free_slots == 3


# -- async: live task slots from the load monitor's sample ---------------------------

# id, executors sampled (id, cores), blocks, engine.threads, expected slots
SLOTS = [
    ("sum-of-cores", [("e1", 2), ("e2", 2)], 8, 0, 4),
    ("executor-lost", [("e1", 2)], 8, 0, 2),
    ("executor-joined", [("e1", 2), ("e2", 2), ("e3", 4)], 8, 0, 8),
    ("capped-by-blocks", [("e1", 8)], 3, 0, 3),
    ("none-registered-yet", [], 4, 0, 1),
    ("threads-fixed", [("e1", 1)], 8, 5, 5),
]


@pytest.mark.parametrize("executors, blocks, threads, expected",
                         [c[1:] for c in SLOTS], ids=[c[0] for c in SLOTS])
def test_task_slots(executors, blocks, threads, expected):
    assert task_slots([ex(e, c) for e, c in executors], blocks, threads) == expected


# id, executors sampled (id, cores), blocks, scheduler.queue_depth, expected jobs in flight
QUEUED = [
    ("one-queued-past-two-slots", [("e1", 1), ("e2", 1)], 4, 1, 3),
    ("queue-capped-by-blocks", [("e1", 2)], 2, 1, 2),
    ("no-queue", [("e1", 2)], 4, 0, 2),
    ("deep-queue", [("e1", 2)], 8, 3, 5),
    ("queue-waits-for-first-executor", [], 4, 1, 1),
]


@pytest.mark.parametrize("executors, blocks, queued, expected",
                         [c[1:] for c in QUEUED], ids=[c[0] for c in QUEUED])
def test_task_slots_with_queued_jobs(executors, blocks, queued, expected):
    assert task_slots([ex(e, c) for e, c in executors], blocks, 0, queued) == expected


# id, executors sampled (id, cores, running), jobs in flight (block -> base), expected SUBMITs
SHRINK = [
    ("two-executors", [("e1", 2, 1), ("e2", 2, 0)], {0: 3}, [1, 2, 3]),
    ("one-lost-mid-run", [("e1", 2, 1)], {0: 3}, [1]),
    ("lost-leaves-none-free", [("e1", 1, 1)], {0: 3}, []),
    ("rejoined", [("e1", 2, 1), ("e3", 1, 0)], {0: 3}, [1, 2]),
]


@pytest.mark.parametrize("executors, in_flight, submitted",
                         [c[1:] for c in SHRINK], ids=[c[0] for c in SHRINK])
def test_fewer_sampled_slots_fewer_submissions(executors, in_flight, submitted):
    """What the engine does per decision: free = task_slots(sample) - jobs in flight."""
    sample = [ex(e, c, r) for e, c, r in executors]
    policy = AsyncPolicy(**POLICY)
    free = task_slots(sample, blocks=6) - len(in_flight)
    got = policy.decide(3, max(0, free), [1, 2, 3, 4, 5], in_flight, executors=sample)
    assert [d.block for d in got if d.kind is SUBMIT] == submitted
    assert all(d.reason == "no free slot" for d in got if d.kind is HOLD)
