"""engine.apply.apply_deltas: decode once, reject per payload, one weighted apply (pure numpy tier)."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkcnn.compression import SparseDelta, Sparsifier, decode, encode, sparse_sum, weighted_sum
from sparkcnn.server.apply import Applied, apply_deltas
from sparkcnn.guard import DivergenceGuard
from sparkcnn.ps import ParameterServer
from tests.native_env import compiled

LAYOUT = (40, 3000, 7, 2000)  # small tensors go whole, big ones sparse
P = sum(LAYOUT)


def bits(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


def make_ps(seed: int = 0) -> ParameterServer:
    w = np.random.default_rng(seed).standard_normal(P).astype(np.float32)
    return ParameterServer(w, LAYOUT, density_down=0.1, sparsifier=Sparsifier("topk", dense_below=0))


def payload(rng, *, dense=(0, 2), density=0.02, scale=1e-2, value_dtype="float16") -> bytes:
    """A block's delta: the tensors in ``dense`` whole, the others at ``density``."""
    offsets = np.concatenate([[0], np.cumsum(LAYOUT)])
    parts = []
    for t, n in enumerate(LAYOUT):
        local = np.arange(n) if t in dense else np.sort(rng.choice(n, max(1, int(density * n)), replace=False))
        parts.append(local + offsets[t])
    idx = np.concatenate(parts)
    return encode(SparseDelta(P, idx, rng.standard_normal(idx.size) * scale), LAYOUT, value_dtype=value_dtype)


def expected_W(W0: np.ndarray, payloads, samples, factors, good) -> np.ndarray:
    """The reference: decode each good payload, weighted_sum in payload order, then W0 - G."""
    total = sum(samples[k] for k in good)
    G = weighted_sum([decode(payloads[k], LAYOUT) for k in good],
                     [factors[k] * samples[k] / total for k in good], P)
    return W0 - G


@st.composite
def rounds(draw):
    """Payloads of one round: float16 or float32 values, each tensor dense or sparse, any mix."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = draw(st.integers(1, 6))
    payloads = [payload(rng, dense=draw(st.sets(st.integers(0, 3))),
                        density=draw(st.sampled_from([0.001, 0.05, 0.5])),
                        value_dtype=draw(st.sampled_from(["float16", "float32"]))) for _ in range(n)]
    samples = draw(st.lists(st.integers(0, 500), min_size=n, max_size=n))
    factors = draw(st.lists(st.sampled_from([1.0, 0.05, 1 / 3, 0.125]), min_size=n, max_size=n))
    return payloads, samples, factors


@settings(max_examples=60, deadline=None)
@given(case=rounds(), threads=st.integers(1, 3), native=st.booleans())
def test_applied_weights_are_bitwise_the_reference(case, threads, native):
    payloads, samples, factors = case
    ps = make_ps()
    W0 = ps.W.copy()
    with compiled(native), mock.patch.object(sparse_sum, "PARALLEL_MIN_BYTES", 0):
        out = apply_deltas(ps, payloads, samples, factors, threads=threads)
    good = [k for k in range(len(payloads)) if samples[k] > 0]
    assert out == Applied(tuple(good), {})
    assert ps.version == (1 if good else 0)
    want = expected_W(W0, payloads, samples, factors, good) if good else W0
    assert np.array_equal(bits(ps.W), bits(want))


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:]


def test_corrupt_payloads_are_rejected_by_name_and_the_others_applied():
    rng = np.random.default_rng(1)
    payloads = [payload(rng) for _ in range(6)]
    nan = SparseDelta(P, np.array([3, 500]), np.array([0.1, np.nan], np.float32))
    payloads[1] = payloads[1][:-5]  # truncated
    payloads[2] = _flip(payloads[2], 0)  # magic
    payloads[4] = encode(nan, LAYOUT, unchecked_values=True)  # what a diverged worker could send
    samples, factors = [64, 64, 32, 100, 10, 50], [1.0] * 6
    ps = make_ps()
    W0 = ps.W.copy()
    out = apply_deltas(ps, payloads, samples, factors, guard=DivergenceGuard())
    assert out.applied == (0, 3, 5) and sorted(out.rejected) == [1, 2, 4]
    assert out.rejected[1].startswith("truncated delta")
    assert out.rejected[2].startswith("bad magic")
    assert out.rejected[4] == "delta tensor 1: value nan at index 460 is not a finite float16"
    assert ps.version == 1
    assert np.array_equal(bits(ps.W), bits(expected_W(W0, payloads, samples, factors, [0, 3, 5])))


def test_every_payload_rejected_leaves_weights_and_version():
    rng = np.random.default_rng(2)
    ps = make_ps()
    W0 = ps.W.copy()
    out = apply_deltas(ps, [payload(rng)[:10], b"", b"SKCD"], [1, 1, 1], [1.0] * 3)
    assert out.applied == () and sorted(out.rejected) == [0, 1, 2]
    assert ps.version == 0 and np.array_equal(bits(ps.W), bits(W0))


def test_guard_rejects_an_exploding_payload_by_its_norm_per_step():
    rng = np.random.default_rng(3)
    guard = DivergenceGuard(max_norm_factor=10, warmup=3)
    ps = make_ps()
    for _ in range(3):  # the guard's warm-up: three ordinary norms
        apply_deltas(ps, [payload(rng)], [64], [1.0], guard=guard, steps=[10])
    W0 = ps.W.copy()
    payloads = [payload(rng), payload(rng, scale=10.0), payload(rng, scale=10.0), payload(rng)]
    samples, factors = [64, 64, 64, 64], [0.5] * 4
    out = apply_deltas(ps, payloads, samples, factors, guard=guard, steps=[10, 10, 10_000, 10])
    # payload 2 is as large as 1 but over 1000x the steps: its norm per step is ordinary
    assert out.applied == (0, 2, 3) and list(out.rejected) == [1]
    assert out.rejected[1].startswith("norm per step") and "running median" in out.rejected[1]
    assert guard.rejected == 1 and ps.version == 4
    assert np.array_equal(bits(ps.W), bits(expected_W(W0, payloads, samples, factors, [0, 2, 3])))


def test_payloads_without_samples_are_skipped_not_rejected():
    rng = np.random.default_rng(4)
    guard = DivergenceGuard()
    payloads = [payload(rng), b"not even a delta", payload(rng)]
    samples, factors = [10, 0, 30], [1.0, 1.0, 2.0]
    ps = make_ps()
    W0 = ps.W.copy()
    out = apply_deltas(ps, payloads, samples, factors, guard=guard, steps=[1, 1, 1])
    assert out == Applied((0, 2), {})
    assert len(guard.state_dict()["norms"]) == 2  # the guard never saw the skipped one
    assert np.array_equal(bits(ps.W), bits(expected_W(W0, payloads, samples, factors, [0, 2])))
    before = ps.version
    assert apply_deltas(ps, payloads[1:2], [0], [1.0]) == Applied((), {})
    assert ps.version == before  # nothing to apply: no version bump


def test_arguments_must_match_the_payloads():
    with pytest.raises(ValueError, match="got 2 payloads but 1 samples"):
        apply_deltas(make_ps(), [b"", b""], [1], [1.0, 1.0])
    with pytest.raises(ValueError, match="got 1 payloads but 2 steps"):
        apply_deltas(make_ps(), [b""], [1], [1.0], steps=[1, 1])


@pytest.mark.parametrize("factor", [1.0, 1 / 6, 0.025])
def test_a_lone_sparse_payload_is_applied_in_place_bitwise(factor):
    """Async and the stream apply one payload at a time: one decode, no batch and no sum; a
    sparse one goes to W in place, bitwise what the summed path gives."""
    rng = np.random.default_rng(4)
    data = payload(rng, density=0.001)
    ps, W0 = make_ps(), make_ps().W.copy()
    with mock.patch("sparkcnn.server.apply.decode_batch", side_effect=AssertionError("batched")):
        assert apply_deltas(ps, [data], [64], [factor]) == Applied((0,), {})
    assert ps.version == 1
    assert np.array_equal(bits(ps.W), bits(expected_W(W0, [data], [64], [factor], [0])))
    dense = payload(rng, dense=(0, 1, 2, 3))  # every entry: a dense subtraction
    ps2 = make_ps()
    apply_deltas(ps2, [dense], [64], [factor])
    assert np.array_equal(bits(ps2.W), bits(expected_W(W0, [dense], [64], [factor], [0])))
