"""Pure-numpy tests of selection, error feedback, momentum, warm-up and sums."""

from __future__ import annotations

import math
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from sparkcnn.compression import (
    DGCMomentum,
    ErrorFeedback,
    SparseDelta,
    SparsificationAwareMomentum,
    Sparsifier,
    density_at,
    lr_at,
    make_policy,
    mask_momentum,
    quantise,
    server_scale,
    target_count,
    threshold_indices,
    topk_indices,
    weighted_sum,
)
from sparkcnn.compression import native, native_step
from sparkcnn.compression.feedback import quantise_at
from sparkcnn.errors import BadInput
from tests.native_env import compiled

FAST = settings(max_examples=60, deadline=None)

finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


# --------------------------------------------------------------------------- quantise / error feedback


@FAST
@given(
    a=arrays(np.float32, st.integers(0, 64), elements=finite_f32),
    dtype=st.sampled_from(["float16", "float32"]),
)
def test_quantise_remainder_is_exact(a, dtype):
    q = quantise(a, dtype)
    r = a - q
    # Representable on the wire …
    if dtype == "float16":
        assert np.array_equal(q.astype(np.float16).astype(np.float32), q)
    # … and a = q + r holds over the reals (fsum is exact for a 3-term zero test).
    for ai, qi, ri in zip(a.tolist(), q.tolist(), r.tolist()):
        assert math.fsum([qi, ri, -ai]) == 0.0
    assert np.array_equal(q + r, a)


def _dyadic(rng, size):
    """Multiples of 2**-10 below 2**10: every float32 sum of a few stays exact."""
    return (rng.integers(-(2**20), 2**20, size) * 2.0**-10).astype(np.float32)


@FAST
@given(
    seed=st.integers(0, 2**32 - 1),
    layout=st.lists(st.integers(0, 300), min_size=1, max_size=4).map(tuple),
    steps=st.integers(1, 6),
    dtype=st.sampled_from(["float16", "float32"]),
    method=st.sampled_from(["threshold", "topk", "none"]),
    density=st.sampled_from([0.01, 0.1, 0.5]),
)
def test_error_feedback_sent_plus_residual_equals_input(seed, layout, steps, dtype, method, density):
    rng = np.random.default_rng(seed)
    size = sum(layout)
    feedback = ErrorFeedback(layout, Sparsifier(method, dense_below=50, rng=rng), value_dtype=dtype)
    total_in = np.zeros(size, np.float64)
    total_sent = np.zeros(size, np.float64)
    for _ in range(steps):
        delta = _dyadic(rng, size)
        before = feedback.residual + delta  # what A holds before the send
        sent = feedback.step(delta, density, lr=0.1, weights=None)
        # Per step, bitwise: A_before == q + A_after at every coordinate.
        assert np.array_equal(sent.to_dense() + feedback.residual, before)
        total_in += delta
        total_sent += sent.to_dense()
    # Over the whole sequence, exactly (all quantities are exact dyadics).
    assert np.array_equal(total_sent + feedback.residual, total_in)


def test_error_feedback_float32_sends_leave_zero_residual():
    layout = (20_000, 10)
    fb = ErrorFeedback(layout, Sparsifier("threshold", dense_below=100), value_dtype="float32")
    x = np.random.default_rng(0).standard_normal(sum(layout)).astype(np.float32)
    sent = fb.step(x, 0.01, lr=0.1, weights=None)
    assert np.all(fb.residual[sent.indices] == 0)
    assert np.array_equal(sent.values, x[sent.indices])
    assert sent.nnz >= 10 and np.all(fb.residual[20_000:] == 0)  # the small tensor went dense


def test_quantise_huge_values_clip_and_stay_exact():
    a = np.array([7e4, -1e9, 3e38, 65504.0, 1e-8], np.float32)
    q = quantise(a, "float16")
    assert np.all(np.abs(q) <= 65504) and np.all(np.isfinite(q.astype(np.float16)))
    assert np.array_equal(q + (a - q), a)


# --------------------------------------------------------------------------- selection


def _tensor(kind, n, rng):
    if kind == "normal":
        return rng.standard_normal(n)
    if kind == "cauchy":
        return rng.standard_cauchy(n)
    return rng.lognormal(0.0, 3.0, n) * rng.choice([-1, 1], n)


@pytest.mark.parametrize("kind", ["normal", "cauchy", "lognormal"])
@pytest.mark.parametrize("density", [0.1, 0.01, 0.001])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_threshold_count_within_20_percent_and_keeps_the_largest(kind, density, seed):
    rng = np.random.default_rng(seed)
    x = _tensor(kind, 200_000, rng).astype(np.float32)
    idx = threshold_indices(x, density, rng=rng)
    k = target_count(x.size, density)
    assert 0.8 * k <= idx.size <= 1.2 * k
    assert idx.dtype == np.int64 and np.all(np.diff(idx) > 0)
    kept = np.zeros(x.size, bool)
    kept[idx] = True
    assert np.abs(x[kept]).min() >= np.abs(x[~kept]).max()  # a magnitude threshold


def test_threshold_on_a_structured_tensor():
    # Periodic magnitudes alias with a strided sample; the correction must fix it.
    x = np.tile(np.array([100.0, 1, 1, 1, 1, 1, 1, 1], np.float32), 50_000)
    x += np.random.default_rng(3).standard_normal(x.size).astype(np.float32) * 1e-3
    for density in (0.01, 0.2):
        idx = threshold_indices(x, density)
        k = target_count(x.size, density)
        assert 0.8 * k <= idx.size <= 1.2 * k


@pytest.mark.parametrize("density", [1.0, 0.5, 0.01, 1e-6])
def test_topk_is_exact(density):
    x = np.random.default_rng(0).standard_normal(10_000).astype(np.float32)
    idx = topk_indices(x, density)
    k = target_count(x.size, density)
    assert idx.size == k
    assert set(idx.tolist()) == set(np.argsort(-np.abs(x))[:k].tolist())


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([0.0005, 0.001, 0.0013]))
def test_exact_top_k_keeps_the_lowest_index_among_ties_compiled_and_on_numpy(seed, density):
    """A tensor whose sample would be the whole (n <= 2 / density, so k is 1 or 2) is selected
    exactly: the k largest |x|, ties to the lower index (zeros, equal magnitudes of either
    sign), the compiled selection bitwise numpy's; NaN ranks above every number."""
    rng = np.random.default_rng(seed)
    layout = (1500, 40, 1200)  # the 1,500 and 1,200 entries are on the exact path at these densities
    flat = (rng.integers(-3, 4, sum(layout)) * 0.5).astype(np.float32)  # few magnitudes: many ties
    flat[rng.integers(0, flat.size, 30)] = 0.0
    k = target_count(1500, density)
    mags = np.abs(flat[:1500])
    order = sorted(range(1500), key=lambda i: (-mags[i], i))  # by magnitude, then the lower index first
    expect = np.sort(np.array(order[:k], np.int64))
    assert np.array_equal(topk_indices(flat[:1500], density), expect)
    sp = Sparsifier("threshold", dense_below=1000)
    with compiled(False):
        slow = sp.indices(flat, layout, density)
    fast = sp.indices(flat, layout, density)
    assert np.array_equal(fast, slow) and np.array_equal(fast[:k], expect)
    flat[7] = np.nan
    with compiled(False):
        slow = sp.indices(flat, layout, density)
    fast = sp.indices(flat, layout, density)
    assert np.array_equal(fast, slow) and 7 in fast.tolist()


def test_sparsifier_dense_below_and_none():
    layout = (100, 50_000, 0, 30)
    flat = np.random.default_rng(0).standard_normal(sum(layout)).astype(np.float32)
    idx = Sparsifier("threshold", dense_below=1000).indices(flat, layout, 0.01)
    assert np.array_equal(idx[:100], np.arange(100))  # small tensor whole
    assert np.array_equal(idx[-30:], np.arange(50_100, 50_130))
    assert 400 <= idx.size - 130 <= 600
    assert Sparsifier("none").indices(flat, layout, 0.01).size == flat.size
    sd = Sparsifier("topk", dense_below=0).select(flat, layout, 0.01)
    assert np.array_equal(sd.values, flat[sd.indices])


def test_sparsifier_validates():
    with pytest.raises(ValueError, match=r"compression.method must be one of"):
        Sparsifier("random")
    with pytest.raises(ValueError, match=r"density must be in \(0, 1\], got 1.5"):
        Sparsifier().indices(np.zeros(4, np.float32), (4,), 1.5)
    with pytest.raises(ValueError, match="layout covers 3 entries, vector has 4"):
        Sparsifier().indices(np.zeros(4, np.float32), (3,), 0.5)


# --------------------------------------------------------------------------- momentum


def _reference_topk(v, layout, density):
    """Independent per-tensor top-k: full sort, not argpartition."""
    out, start = [], 0
    for n in layout:
        k = min(n, max(1, round(density * n)))
        out.append(np.sort(np.argsort(-np.abs(v[start:start + n]), kind="stable")[:k]) + start)
        start += n
    return np.concatenate(out)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), kind=st.sampled_from(["normal", "cauchy", "lognormal"]),
       density=st.sampled_from([0.2, 0.01, 0.001]), sampled=st.booleans())
def test_threshold_selection_is_the_same_compiled_and_on_numpy(seed, kind, density, sampled):
    x = _tensor(kind, 60_000, np.random.default_rng(seed)).astype(np.float32)
    x[::7] = 0.0  # ties at zero
    fast = threshold_indices(x, density, rng=np.random.default_rng(seed) if sampled else None)
    with compiled(False):
        slow = threshold_indices(x, density, rng=np.random.default_rng(seed) if sampled else None)
    assert np.array_equal(fast, slow)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), kind=st.sampled_from(["normal", "cauchy", "lognormal", "sparse"]),
       density=st.sampled_from([1.0, 0.3, 0.05, 0.01, 0.001]), sampled=st.booleans(),
       dense_below=st.sampled_from([0, 100, 16384]), specials=st.booleans())
def test_sparsifier_indices_are_the_same_compiled_and_on_numpy(seed, kind, density, sampled, dense_below, specials):
    """The one compiled call over every tensor (first threshold pass, trimmed where it overshoots,
    numpy's corrections where it undershoots) against the per-tensor numpy path, on a layout of
    small, sampled and exactly selected tensors, with NaN, infinities and ties at zero."""
    layout = (7, 300, 2500, 40_000, 64, 30_000)
    rng = np.random.default_rng(seed)
    x = _tensor("normal" if kind == "sparse" else kind, sum(layout), rng).astype(np.float32)
    if kind == "sparse":
        x[rng.random(x.size) < 0.9] = 0.0  # mostly zeros: thresholds of 0, ties
    if specials:
        x[rng.integers(0, x.size, 6)] = [np.nan, np.inf, -np.inf, np.nan, 0.0, -0.0]

    def select():
        sp = Sparsifier("threshold", dense_below, rng=np.random.default_rng(seed) if sampled else None)
        return [sp.indices(x, layout, d) for d in (density, density, density / 2)]  # plans reused

    fast = select()
    with compiled(False):
        slow = select()
    for a, b in zip(fast, slow):
        assert a.dtype == b.dtype == np.int64 and np.array_equal(a, b)


@FAST
@given(seed=st.integers(0, 2**32 - 1), scale=st.integers(-30, 8), specials=st.booleans())
def test_quantise_at_is_quantise_bitwise(seed, scale, specials):
    """The compiled float16 rounding of the sent values against quantise's numpy casts, over
    subnormal, normal, float16-clipped values, and NaN and infinities (which it hands back)."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(5000) * 2.0 ** scale).astype(np.float32)
    if specials:
        x[rng.integers(0, x.size, 3)] = [np.nan, np.inf, 70000.0]
    idx = np.sort(rng.choice(x.size, 800, replace=False)).astype(np.int64)
    for dtype in ("float16", "float32"):
        got = quantise_at(x, idx, dtype)
        assert np.array_equal(got.view(np.uint32), quantise(x[idx], dtype).view(np.uint32))


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("mode, per_step", [("correction", True), ("sparsification_aware", True),
                                            ("correction", False)])
def test_a_scaled_step_is_the_step_of_the_scaled_update_bitwise(native, mode, per_step):
    """``step(g, scale=s)`` (a clipped gradient, scaled as the policy reads it) against
    ``step(g * float32(s))``, over steps: the same sends and the same buffers, bit for bit."""
    layout, rng = (40, 30_000, 5000), np.random.default_rng(11)
    grads = [(rng.standard_normal(sum(layout)) * 3).astype(np.float32) for _ in range(4)]
    scales = [0.37, None, 1e-3, 0.9]

    def run(pass_scale):
        policy = make_policy("threshold", mode, per_step, layout, "float16", 1000, 0.9)
        sent = []
        for g, s in zip(grads, scales):
            if pass_scale:
                sent.append(policy.step(g, 0.01, lr=0.1, weights=None, scale=s))
            else:
                sent.append(policy.step(g if s is None else g * np.float32(s), 0.01, lr=0.1, weights=None))
        return sent, policy.state_dict()

    with compiled(native):
        a, state_a = run(True)
        b, state_b = run(False)
    for x, y in zip(a, b):
        assert np.array_equal(x.indices, y.indices) and np.array_equal(x.values.view(np.uint32), y.values.view(np.uint32))
    assert all(np.array_equal(state_a[k].view(np.uint32), state_b[k].view(np.uint32)) for k in state_a)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), dtype=st.sampled_from(["float32", "float16"]), masking=st.booleans(),
       big=st.booleans(), clipped=st.booleans(), specials=st.booleans())
def test_dgc_step_is_bitwise_the_same_compiled_and_on_numpy(seed, dtype, masking, big, clipped, specials):
    """The whole step in one compiled call (momentum pass, selection, values, residual, masking)
    against numpy's passes, over steps at three densities, clipped or not, on a layout with a
    tensor sent whole, sampled ones and one on exact top-k at density 0.001 (its 1,500 entries:
    the sample would be the whole), which the compiled call selects too. It hands a step back
    after its momentum pass where, with ``big``, a value is beyond float16 (from then on: the
    residual keeps what float16 could not carry); numpy's passes then finish it. With ``specials``
    a NaN lands in a sampled tensor's sample and an infinity elsewhere (the compiled call, which
    makes the momentum pass tensor by tensor with the selection, hands those steps back too)."""
    layout = (40, 30_000, 1500, 5000)
    rng = np.random.default_rng(seed)
    grads = [(rng.standard_normal(sum(layout)) * 10.0 ** rng.integers(-6, 2)).astype(np.float32) for _ in range(6)]
    if big:
        grads[3][rng.integers(0, sum(layout), 3)] = [7e4, -1e6, 3e5]
    if specials:  # index 40: the first of the 30,000-entry tensor, the first of its sample
        grads[4][[40, int(rng.integers(0, sum(layout)))]] = [np.nan, np.inf]
    scales = [0.5, None, 0.01, None, 2.0, None] if clipped else [None] * 6
    densities = [0.01, 0.001, 0.01, 0.05, 0.05, 0.01]
    outcomes = []

    def counted(*args):
        outcomes.append(dgc_step(*args))
        return outcomes[-1]

    def run():
        dgc = DGCMomentum(layout, Sparsifier("threshold", dense_below=1000), value_dtype=dtype, momentum=0.9,
                          masking=masking)
        with np.errstate(invalid="ignore"):  # specials: NaN - NaN, inf - inf
            sent = [dgc.step(g, d, lr=0.1, weights=None, scale=s) for g, s, d in zip(grads, scales, densities)]
        return sent, dgc.momentum.view(np.uint32), dgc.velocity.view(np.uint32)

    dgc_step = native_step.dgc_step
    with mock.patch.object(native_step, "dgc_step", counted):
        fast_sent, fast_u, fast_v = run()
    with compiled(False):
        slow_sent, slow_u, slow_v = run()
    for a, b in zip(fast_sent, slow_sent):
        assert np.array_equal(a.indices, b.indices) and np.array_equal(a.values.view(np.uint32), b.values.view(np.uint32))
    assert np.array_equal(fast_u, slow_u) and np.array_equal(fast_v, slow_v)
    if native.enabled():  # the compiled call took every step, and handed back exactly those it must
        handed_back = [(i >= 3 and big and dtype == "float16") or (i >= 4 and specials) for i in range(len(densities))]
        assert [c < 0 for c in outcomes] == handed_back


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_dgc_momentum_matches_reference(dtype):
    layout, m, density = (3000, 500), 0.9, 0.02
    rng = np.random.default_rng(5)
    dgc = DGCMomentum(layout, Sparsifier("topk", dense_below=0), value_dtype=dtype, momentum=m)
    u = np.zeros(sum(layout), np.float32)
    v = np.zeros(sum(layout), np.float32)
    for _ in range(6):
        g = rng.standard_normal(u.size).astype(np.float32)
        sent = dgc.step(g, density, lr=0.1, weights=None)
        # DGC (Lin et al. 2018, Alg. 1): u = m·u + g; v += u; S = top(v); v[S] = 0; u[S] = 0.
        u = np.float32(m) * u + g
        v = v + u
        s = _reference_topk(v, layout, density)
        wire = v[s].astype(np.float16).astype(np.float32) if dtype == "float16" else v[s]
        v[s] -= wire
        u[s] = 0
        assert np.array_equal(sent.indices, s)
        np.testing.assert_allclose(sent.values, wire, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(dgc.momentum, u, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(dgc.velocity, v, rtol=1e-5, atol=1e-6)
        if dtype == "float32":
            assert np.all(dgc.velocity[s] == 0)
        assert np.all(dgc.momentum[s] == 0)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_sparsification_aware_momentum_matches_reference(dtype):
    layout, m, wd, lr, density = (4000, 300), 0.9, 1e-4, 0.05, 0.01
    rng = np.random.default_rng(7)
    sam = SparsificationAwareMomentum(layout, Sparsifier("topk", dense_below=0), value_dtype=dtype,
                                      momentum=m, weight_decay=wd)
    u = np.zeros(sum(layout), np.float32)
    w = rng.standard_normal(u.size).astype(np.float32)
    for _ in range(5):
        g = rng.standard_normal(u.size).astype(np.float32)
        sent = sam.step(g, density, lr=lr, weights=w)
        # Yan 2019 (reference worker_gradient_executor): u = m·u + lr·(g + wd·w); send top(u);
        # the sent entries keep u (their velocity), the unsent ones u /= m.
        u = np.float32(m) * u + np.float32(lr) * (g + np.float32(wd) * w)
        s = _reference_topk(u, layout, density)
        wire = u[s].astype(np.float16).astype(np.float32) if dtype == "float16" else u[s].copy()
        unsent = np.ones(u.size, bool)
        unsent[s] = False
        expected = u.copy()
        expected[unsent] = u[unsent] / np.float32(m)  # accumulate instead of decaying
        assert np.array_equal(sent.indices, s)
        np.testing.assert_allclose(sent.values, wire, rtol=1e-6)
        np.testing.assert_allclose(sam.momentum, expected, rtol=1e-5, atol=1e-9)
        assert np.array_equal(sam.momentum[s], u[s])  # kept exactly, not cleared
        u = expected


def test_sparsification_aware_momentum_is_momentum_sgd_per_entry():
    """Sent every step, an entry moves as momentum SGD; sent after T quiet steps, it applies
    m·v + lr·(g_1 + … + g_T): momentum SGD on a T times larger batch (the paper's adaptive batch)."""
    m, lr = 0.9, 0.1
    rng = np.random.default_rng(3)
    dense = SparsificationAwareMomentum((2000,), Sparsifier("topk", dense_below=0), value_dtype="float32",
                                        momentum=m)
    v = np.zeros(2000, np.float32)
    for _ in range(4):
        g = rng.standard_normal(2000).astype(np.float32)
        sent = dense.step(g, 1.0, lr=lr, weights=None)
        v = np.float32(m) * v + np.float32(lr) * g
        assert sent.indices.size == 2000
        np.testing.assert_allclose(sent.values[np.argsort(sent.indices)], v, rtol=1e-5, atol=1e-7)
    # entry 0 is sent at step 1, then stays below the threshold for 3 steps, then is sent again
    sam = SparsificationAwareMomentum((100,), Sparsifier("topk", dense_below=0), value_dtype="float32",
                                      momentum=m)
    big = np.zeros(100, np.float32)
    big[0] = 10.0
    first = sam.step(big, 0.01, lr=lr, weights=None)
    assert first.indices.tolist() == [0] and first.values[0] == np.float32(lr * 10.0)
    quiet = []
    for k in range(3):
        g = np.zeros(100, np.float32)
        g[0], g[1 + k] = 0.5, 100.0  # another entry wins each of these steps
        quiet.append(sam.step(g, 0.01, lr=lr, weights=None))
    assert [q.indices.tolist() for q in quiet] == [[1], [2], [3]]
    g = np.zeros(100, np.float32)
    g[0] = 100.0
    last = sam.step(g, 0.01, lr=lr, weights=None)
    assert last.indices.tolist() == [0]
    # the velocity after the first send, 1.0, decayed once (m), plus lr times the four gradients
    assert last.values[0] == pytest.approx(m * lr * 10.0 + lr * (0.5 * 3 + 100.0), rel=1e-5)


def test_mask_momentum_zeroes_sent_coordinates():
    mom = np.arange(1, 11, dtype=np.float32)
    out = mask_momentum(mom, np.array([0, 3, 9]))
    assert out is mom and mom.tolist() == [0, 2, 3, 0, 5, 6, 7, 8, 9, 0]
    mask_momentum(mom, SparseDelta(10, [1], [5.0]))
    assert mom[1] == 0


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 700), seed=st.integers(0, 2**32 - 1), q=st.floats(0.0, 1.0))
def test_compiled_threshold_count_is_numpys(n, seed, q):
    """The compiled ``|x| >= thr`` pass (blocks of 64 tested whole first) against numpy, at any
    length (tails included), threshold (one hitting values exactly) and with NaN and infinities."""

    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 3)).astype(np.float32)
    if n > 3:
        x[rng.integers(0, n, 3)] = [np.nan, np.inf, -np.inf]
    finite = np.abs(x[np.isfinite(x)])
    thr = np.float32(np.quantile(finite, q, method="nearest")) if finite.size else np.float32(1.0)
    if not native.enabled():
        pytest.skip("no compiled kernels here")
    np.testing.assert_array_equal(native_step.abs_at_least(x, thr), np.flatnonzero(np.abs(x) >= thr))


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("policy", ["correction", "sparsification_aware"])
def test_a_snapshot_survives_the_steps_after_it_and_puts_the_policy_back(native, policy):
    """The per-step policies step out of place, so a snapshot is references, not copies: it
    stays bitwise intact over the KEEP steps after it (and one more), and loading it back
    then repeating those steps sends bitwise what they sent (a dropped push's retraining)."""
    layout = (40, 30_000, 5000)
    rng = np.random.default_rng(3)
    grads = [rng.standard_normal(sum(layout)).astype(np.float32) for _ in range(6)]
    w = rng.standard_normal(sum(layout)).astype(np.float32)
    kwargs = dict(momentum=0.9, weight_decay=1e-4) if policy != "correction" else dict(momentum=0.9)
    cls = DGCMomentum if policy == "correction" else SparsificationAwareMomentum
    with compiled(native):
        p = cls(layout, Sparsifier("threshold", dense_below=1000), **kwargs)
        assert p.out_of_place and p.KEEP >= 2
        for g in grads[:2]:
            p.step(g, 0.01, lr=0.05, weights=w)
        snap = p.snapshot()
        bits = {k: v.copy() for k, v in snap.items()}
        assert all(not v.flags.writeable for v in snap.values())
        first = [p.step(g, 0.01, lr=0.05, weights=w) for g in grads[2:2 + p.KEEP + 1]]
        for k in snap:
            assert np.array_equal(snap[k].view(np.uint32), bits[k].view(np.uint32)), k
            assert not np.shares_memory(snap[k], getattr(p, k))
        p.load_state_dict(snap)
        again = [p.step(g, 0.01, lr=0.05, weights=w) for g in grads[2:2 + p.KEEP + 1]]
    for a, b in zip(first, again):
        assert np.array_equal(a.indices, b.indices) and np.array_equal(a.values.view(np.uint32),
                                                                      b.values.view(np.uint32))
    e = ErrorFeedback(layout, Sparsifier())  # steps in place: its snapshot is a copy
    e.step(grads[0], 0.01, lr=0.05, weights=None)
    assert not e.out_of_place and not np.shares_memory(e.snapshot()["residual"], e.residual)


def test_state_dict_round_trip_and_validation():
    layout = (1000,)
    a = DGCMomentum(layout, Sparsifier("topk"), momentum=0.5)
    a.step(np.random.default_rng(0).standard_normal(1000), 0.01, lr=0.1, weights=None)
    b = DGCMomentum(layout, Sparsifier("topk"), momentum=0.5)
    b.load_state_dict(a.state_dict())
    g = np.random.default_rng(1).standard_normal(1000)
    sa, sb = a.step(g, 0.01, lr=0.1, weights=None), b.step(g, 0.01, lr=0.1, weights=None)
    assert np.array_equal(sa.indices, sb.indices) and np.array_equal(sa.values, sb.values)
    with pytest.raises(BadInput, match=r"missing \['velocity'\]"):
        b.load_state_dict({"momentum": np.zeros(1000, np.float32)})
    with pytest.raises(BadInput, match=r"state 'residual': shape \(3,\), expected \(1000,\)"):
        ErrorFeedback(layout, Sparsifier()).load_state_dict({"residual": np.zeros(3, np.float32)})
    with pytest.raises(BadInput, match="dtype float64, expected float32"):
        ErrorFeedback(layout, Sparsifier()).load_state_dict({"residual": np.zeros(1000)})


@pytest.mark.parametrize("method, mode, per_step, cls, lr_scaled", [
    ("none", "correction", True, None, False),
    ("none", "sparsification_aware", False, None, False),
    ("topk", "correction", False, ErrorFeedback, False),
    ("threshold", "sparsification_aware", False, ErrorFeedback, False),
    ("threshold", "correction", True, DGCMomentum, True),
    ("topk", "sparsification_aware", True, SparsificationAwareMomentum, False),
])
def test_make_policy_and_server_scale_decide_together(method, mode, per_step, cls, lr_scaled):
    policy = make_policy(method, mode, per_step, (500, 20), "float16", 100, 0.9)
    assert type(policy) is cls if cls else policy is None
    if policy is not None:
        assert policy.server_lr_scaled is lr_scaled and policy.sparsifier.method == method
        assert policy.sparsifier.dense_below == 100 and policy.value_dtype == "float16"
    assert server_scale(method, mode, per_step, 0.05) == (0.05 if lr_scaled else 1.0)
    if cls is SparsificationAwareMomentum:
        assert policy.wd == 0 and policy.m == np.float32(0.9)  # the trainer's gradient carries wd


def test_policies_share_one_step_interface():
    layout, rng = (300,), np.random.default_rng(4)
    update, w = rng.standard_normal(300).astype(np.float32), rng.standard_normal(300).astype(np.float32)
    for mode, per_step in (("correction", False), ("correction", True), ("sparsification_aware", True)):
        policy = make_policy("topk", mode, per_step, layout, "float32", 0, 0.9)
        sent = policy.step(update, 0.1, lr=0.5, weights=w)
        assert isinstance(sent, SparseDelta) and sent.nnz == 30
    with pytest.raises(ValueError, match="compression.momentum must be one of"):
        server_scale("topk", "nesterov", True, 0.1)
    with pytest.raises(ValueError, match="compression.method must be one of"):
        make_policy("random", "correction", True, layout, "float32", 0, 0.9)


# --------------------------------------------------------------------------- warm-up


def test_density_warmup_is_exponential_then_target():
    kw = dict(initial=0.25, target=0.001, warmup_epochs=4)
    seq = [density_at(e, **kw) for e in range(6)]
    assert seq[0] == 0.25 and seq[4] == seq[5] == 0.001
    np.testing.assert_allclose(seq[1:4], [0.0629, 0.0158, 0.00398], rtol=0.01)
    assert all(a > b for a, b in zip(seq[:4], seq[1:5]))
    assert density_at(0.0, initial=0.25, target=0.01, warmup_epochs=0) == 0.01
    with pytest.raises(ValueError, match=r"density_warmup.target must be in \(0, 1\], got 0"):
        density_at(1, initial=0.25, target=0, warmup_epochs=2)


def test_lr_schedules():
    kw = dict(base_lr=0.1, warmup_epochs=5, total_epochs=100)
    assert lr_at(0, **kw) == pytest.approx(0.01)  # warmup_start · base_lr
    assert lr_at(2.5, **kw) == pytest.approx(0.055)
    assert lr_at(5, **kw) == lr_at(99, **kw) == pytest.approx(0.1)
    assert lr_at(5, schedule="cosine", **kw) == pytest.approx(0.1)
    assert lr_at(52.5, schedule="cosine", **kw) == pytest.approx(0.05)
    assert lr_at(100, schedule="cosine", **kw) == pytest.approx(0.0, abs=1e-12)
    assert [lr_at(e, schedule="step", **kw) for e in (49, 50, 75)] == pytest.approx([0.1, 0.01, 0.001])
    with pytest.raises(ValueError, match="optimizer.schedule must be one of"):
        lr_at(1, schedule="linear", **kw)
    with pytest.raises(ValueError, match="epoch must be >= 0, got -1.0"):
        lr_at(-1, **kw)


# --------------------------------------------------------------------------- sums


@st.composite
def sparse_deltas(draw, size, count):
    out = []
    for _ in range(count):
        idx = np.array(sorted(draw(st.sets(st.integers(0, size - 1), max_size=size))), np.int64)
        vals = draw(arrays(np.float32, idx.size, elements=st.floats(-100, 100, width=32)))
        out.append(SparseDelta(size, idx, vals))
    return out


@FAST
@given(data=st.data(), size=st.integers(1, 60), count=st.integers(0, 5))
def test_weighted_sum_matches_dense_reference(data, size, count):
    deltas = data.draw(sparse_deltas(size, count))
    weights = data.draw(st.lists(st.floats(-2, 2), min_size=count, max_size=count))
    expected = sum((np.float64(w) * d.to_dense() for d, w in zip(deltas, weights)), np.zeros(size))
    np.testing.assert_allclose(weighted_sum(deltas, weights, size), expected, rtol=1e-5, atol=1e-3)
    out = np.ones(size, np.float32)
    assert weighted_sum(deltas, weights, size, out=out) is out
    np.testing.assert_allclose(out, expected + 1, rtol=1e-5, atol=1e-3)


def test_weighted_sum_validates_sizes():
    with pytest.raises(ValueError, match="got 1 deltas but 2 weights"):
        weighted_sum([SparseDelta.empty(3)], [1.0, 2.0], 3)


@pytest.mark.parametrize("mode", ["correction", "sparsification_aware"])
def test_tensors_sent_whole_keep_plain_momentum(mode):
    """A tensor below dense_below is sent whole every step: no selection, so no masking; the
    server's total over steps is momentum SGD's there (DGC's lr-free form: the sum of u)."""
    layout, m, lr = (5000, 10), 0.9, 0.1
    policy = make_policy("topk", mode, True, layout, "float32", 100, m)
    rng = np.random.default_rng(3)
    u = np.zeros(10, np.float32)
    for _ in range(6):
        g = rng.standard_normal(5010).astype(np.float32)
        sent = policy.step(g, 0.01, lr=lr, weights=None).to_dense()
        u = m * u + g[5000:]
        expect = u if mode == "correction" else lr * u
        np.testing.assert_allclose(sent[5000:], expect, rtol=1e-5, atol=1e-6)
    assert np.count_nonzero(sent[:5000]) == 50  # the big tensor still goes through selection


def test_correction_without_factor_masking_keeps_momentum_of_sent_entries():
    layout, rng = (2000,), np.random.default_rng(8)
    masked = make_policy("topk", "correction", True, layout, "float32", 0, 0.9)
    kept = make_policy("topk", "correction", True, layout, "float32", 0, 0.9, masking=False)
    g = rng.standard_normal(2000).astype(np.float32)
    a, b = masked.step(g, 0.01, lr=0.1, weights=None), kept.step(g, 0.01, lr=0.1, weights=None)
    np.testing.assert_array_equal(a.indices, b.indices)
    assert not masked.momentum[a.indices].any()
    np.testing.assert_array_equal(kept.momentum[b.indices], g[b.indices])  # u = g after one step
    np.testing.assert_array_equal(kept.velocity, masked.velocity)  # the residual is the same
