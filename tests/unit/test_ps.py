"""Parameter server, replicas and staleness rules (pure numpy tier)."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from sparkcnn.compression.delta import SparseDelta
from sparkcnn.compression.sparsify import Sparsifier
from sparkcnn.errors import BadInput
from sparkcnn.ps import ParameterServer
from sparkcnn.ps_downlink import SparseDownlink
from sparkcnn.replica import Replica, ReplicaOutOfSync, checksum, format_checksum
from sparkcnn.staleness import held_back, staleness_scale
from tests.native_env import compiled

LAYOUT = (6, 10, 24)  # three tensors, P = 40
P = sum(LAYOUT)


def bits(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


def make_ps(weights=None, **kw) -> ParameterServer:
    if weights is None:
        weights = np.random.default_rng(0).standard_normal(P).astype(np.float32)
    kw.setdefault("density_down", 0.25)
    kw.setdefault("sparsifier", Sparsifier("topk", dense_below=0))
    return ParameterServer(weights, LAYOUT, **kw)


def reload_from(ps: ParameterServer, calls: list | None = None):
    """What a worker's reload does: a dense copy of the server's view U at its version."""
    def reload():
        if calls is not None:
            calls.append(ps.view_version)
        return ps.view_version, ps.U.copy()
    return reload


def step(ps: ParameterServer, rng: np.random.Generator, density: float = 0.2, scale: float = 1.0):
    """One sparse update of realistic size (lr-scaled, ~1e-2)."""
    idx = np.sort(rng.choice(P, max(1, int(density * P)), replace=False))
    vals = (rng.standard_normal(idx.size) * 1e-2).astype(np.float32)
    assert ps.apply(SparseDelta(P, idx, vals), scale)


# -- hypothesis strategies: weights and lr-scaled updates in realistic ranges ------------

def _realistic(lo: float, hi: float, tiny: float):
    """float32 in [lo, hi], with magnitudes below ``tiny`` flushed to 0."""
    return st.floats(lo, hi, width=32).map(lambda x: 0.0 if abs(x) < tiny else x)


weights_st = arrays(np.float32, P, elements=_realistic(-2.0, 2.0, 1e-4))
update_st = arrays(np.float32, P, elements=_realistic(-0.5, 0.5, 1e-5))
op_st = st.one_of(
    st.tuples(st.just("dense"), update_st, st.sampled_from([1.0, 0.5, 1 / 3, 0.125])),
    st.tuples(st.just("sparse"), update_st, st.sampled_from([1.0, 0.5, 1 / 3, 0.125]),
              arrays(np.bool_, P)),
    st.tuples(st.just("downlink")),
)


def run_ops(ps: ParameterServer, ops) -> None:
    for op in ops:
        if op[0] == "dense":
            ps.apply(op[1], op[2])
        elif op[0] == "sparse":
            idx = np.flatnonzero(op[3])
            ps.apply(SparseDelta(P, idx, op[1][idx]), op[2])
        else:
            ps.downlink()


def assert_identity(ps: ParameterServer) -> None:
    """U + R == W exactly (float64), wherever the documented regime holds."""
    W, U, R = ps.W.astype(np.float64), ps.U.astype(np.float64), ps.R
    exact = U + R == W
    small, big = np.minimum(abs(W), abs(U)), np.maximum(abs(W), abs(U))
    regime = (small == 0) | (big <= small * 2.0**28)
    assert np.all(exact | ~regime), (W[~exact], U[~exact])
    assert np.array_equal(bits((U + R).astype(np.float32)), bits(ps.W))  # and rounds back to W always


# -- invariants ---------------------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(weights_st, st.lists(op_st, max_size=25), st.sampled_from([0.05, 0.3, 1.0]))
def test_view_plus_residual_is_weights(w0, ops, density):
    ps = make_ps(w0, density_down=density)
    assert_identity(ps)
    for op in ops:
        run_ops(ps, [op])
        assert_identity(ps)


@settings(max_examples=100, deadline=None)
@given(weights_st, st.lists(op_st, max_size=20))
def test_dense_downlink_makes_view_equal_weights(w0, ops):
    ps = make_ps(w0, density_down=None)
    for op in ops:
        run_ops(ps, [op])
        if op[0] == "downlink":
            assert np.array_equal(bits(ps.U), bits(ps.W))
            assert not ps.R.any()


def test_dense_downlink_is_exact_where_adding_the_residual_is_not():
    # U + float32(W - U) misses W by an ulp in ~1% of entries after a few
    # updates (35% for unrelated values): why the dense downlink assigns.
    rng = np.random.default_rng(9)
    ps = make_ps(rng.standard_normal(P).astype(np.float32) * 0.05, density_down=None)
    U0 = ps.U.copy()
    for _ in range(5):
        ps.apply(rng.standard_normal(P).astype(np.float32) * 0.05)
    naive = U0 + (ps.W - U0)
    assert not np.array_equal(bits(naive), bits(ps.W))
    dl = ps.downlink()
    assert dl.assign and np.array_equal(bits(ps.U), bits(ps.W))


def test_sparse_and_dense_apply_agree_bitwise():
    rng = np.random.default_rng(1)
    a, b = make_ps(), make_ps()
    for scale in (1.0, 0.5, 1 / 3):
        idx = np.sort(rng.choice(P, 7, replace=False))
        vals = rng.standard_normal(7).astype(np.float32)
        sd = SparseDelta(P, idx, vals)
        assert a.apply(sd, scale) and b.apply(sd.to_dense(), scale)
    assert np.array_equal(bits(a.W), bits(b.W)) and a.version == b.version == 3


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([0.05, 0.2, 0.5]), st.integers(0, 12), st.booleans())
def test_sparse_downlink_is_topk_of_residual_minus_zeros(seed, density, dense_below, native):
    """On the compiled support scan and on numpy's alike (``SPARKCNN_NATIVE=0``)."""
    rng = np.random.default_rng(seed)
    sp = Sparsifier("topk", dense_below=dense_below)
    ps = make_ps(density_down=density, sparsifier=sp)
    for _ in range(rng.integers(1, 4)):
        step(ps, rng, density=float(rng.choice([0.05, 0.3, 1.0])))
    residual = ps.W - ps.U
    expected = sp.select(residual, LAYOUT, density)
    expected_idx = expected.indices[expected.values != 0]
    with compiled(native):
        dl = ps.downlink()
    assert np.array_equal(dl.delta.indices, expected_idx)
    assert np.array_equal(bits(dl.delta.values), bits(residual[expected_idx]))


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([0.05, 0.5, 1.0]))
def test_downlink_density_of_one_call_overrides_density_down(seed, density):
    """The density warm-up: one downlink at ``density`` is the top-k at that density (and
    U + R == W still holds), whatever ``density_down`` is."""
    rng = np.random.default_rng(seed)
    sp = Sparsifier("topk", dense_below=0)
    ps = make_ps(density_down=0.05, sparsifier=sp)
    step(ps, rng, density=1.0)
    residual = ps.W - ps.U
    expected = sp.select(residual, LAYOUT, density)
    dl = ps.downlink(density)
    assert np.array_equal(dl.delta.indices, expected.indices[expected.values != 0])
    assert ps.view_version == ps.version
    with pytest.raises(BadInput, match="density"):
        ps.downlink(0.0)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from(["threshold", "topk"]), st.integers(0, 60))
def test_float16_downlink_skips_crumbs_bitwise_as_the_selector(seed, method, sendable):
    """A float16 server's residual is mostly rounding crumbs (|R| <= 2**-25, 0 in float16): with
    few enough sendable entries it sends them without running the selector, and sends exactly
    what the selector's choice minus the zeros would be (either side of the (1 - 0.2) k bound)."""
    layout, n = (6, 10, 2000), 2016
    rng = np.random.default_rng(seed)
    w = rng.normal(0, 1e-3, n).astype(np.float32)  # small: W - U is exact down to ~1e-10
    u = w.copy()
    crumbs = rng.choice(n, 900, replace=False)
    tiny = np.float32(2.0**-25) * rng.choice([0.25, 0.5, 1.0], crumbs.size).astype(np.float32)
    u[crumbs] = w[crumbs] - tiny * rng.choice([-1, 1], crumbs.size).astype(np.float32)
    big = rng.choice(np.setdiff1d(np.arange(n), crumbs), sendable, replace=False)
    u[big] = w[big] - rng.normal(0, 0.01, big.size).astype(np.float32)
    edge = rng.choice(crumbs, 3, replace=False)  # just above the crumb bound: rounds to 2**-24
    u[edge] = w[edge] - np.float32(1.01 * 2.0**-25)

    def downlink(short_cut: bool):
        ps = ParameterServer(w, layout, density_down=0.02, value_dtype="float16",
                             sparsifier=Sparsifier(method, dense_below=0))
        state = ps.state_dict()
        state["U"][:] = u
        state["version"] = 1
        ps.load_state_dict(state)
        if short_cut:
            return ps.downlink(), ps.U.copy()
        with mock.patch.object(SparseDownlink, "_sendable", return_value=None):
            return ps.downlink(), ps.U.copy()

    (fast, u_fast), (ref, u_ref) = downlink(True), downlink(False)
    assert fast.delta.nnz > 0
    assert np.array_equal(fast.delta.indices, ref.delta.indices)
    assert np.array_equal(bits(fast.delta.values), bits(ref.delta.values))
    assert np.array_equal(bits(u_fast), bits(u_ref)) and fast.checksum_after == ref.checksum_after


CANDIDATE_OPS = st.lists(st.one_of(
    st.tuples(st.just("sparse"), st.sampled_from([0.002, 0.02, 0.3]), st.sampled_from([1e-4, 1e-2, 0.5])),
    st.tuples(st.just("dense")),
    st.tuples(st.just("down"), st.sampled_from([None, 0.01, 0.2, 1.0])),
    st.tuples(st.just("reload")),
), min_size=1, max_size=40)


@pytest.mark.parametrize("native", [True, False])
@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from(["threshold", "topk", "none"]), CANDIDATE_OPS)
@example(5688088, "threshold", [("sparse", 0.002, 0.01), ("sparse", 0.002, 0.0001), ("sparse", 0.3, 0.01),
                                ("sparse", 0.002, 0.0001), ("sparse", 0.02, 0.0001), ("dense",)])
def test_float16_downlinks_from_the_candidate_set_are_the_scans_bitwise(native, seed, method, ops):
    """A float16 server finds what to send among the indices applied since (and sent in) the
    last downlink, instead of scanning all P entries; over any mix of sparse and dense applies,
    downlinks at any density and state reloads, every downlink and U are bitwise the scan's
    (the compiled candidate path and numpy's alike)."""
    with compiled(native):
        _candidates_against_the_scan(seed, method, ops)


def _candidates_against_the_scan(seed, method, ops):
    layout, n = (6, 10, 1200, 3000), 4216
    rng = np.random.default_rng(seed)
    w0 = rng.normal(0, 0.05, n).astype(np.float32)

    def server(candidates):
        return ParameterServer(w0, layout, density_down=0.02, value_dtype="float16",
                               sparsifier=Sparsifier(method, dense_below=100), candidates=candidates)

    fast, ref = server(True), server(False)  # ref: always the scan (ps.downlink_candidates=false)
    taken = []  # whether each candidate path tried settled the downlink
    for name in ("_from_candidates", "_compiled_candidates"):
        def counted(density, _original=getattr(fast._sparse, name)):
            got = _original(density)
            taken.append(got is not None)
            return got

        setattr(fast._sparse, name, counted)
    for op in ops:
        if op[0] == "sparse":
            idx = np.sort(rng.choice(n, max(1, int(op[1] * n)), replace=False))
            delta = SparseDelta(n, idx, (rng.standard_normal(idx.size) * op[2]).astype(np.float32))
            fast.apply(delta, 0.1), ref.apply(delta, 0.1)
        elif op[0] == "dense":
            g = (rng.standard_normal(n) * 1e-3).astype(np.float32)
            fast.apply(g), ref.apply(g)
        elif op[0] == "reload":
            state = ref.state_dict()
            fast.load_state_dict(state), ref.load_state_dict(state)
        else:
            a, b = fast.downlink(op[1]), ref.downlink(op[1])
            assert (a is None) == (b is None)
            if a is not None:
                assert np.array_equal(a.delta.indices, b.delta.indices)
                assert np.array_equal(bits(a.delta.values), bits(b.delta.values))
                assert a.checksum_after == b.checksum_after
        assert np.array_equal(bits(fast.U), bits(ref.U)) and np.array_equal(bits(fast.W), bits(ref.W))
    # drained (a downlink follows an apply; float16 rounding leaves only crumbs after about
    # three), then pushes with one downlink each: small ones the candidate set settles without
    # a scan, large ones (more than (1 - TOLERANCE) k entries of a tensor) go to the selector
    one = SparseDelta(n, np.array([0]), np.array([1e-3], np.float32))
    for _ in range(3):
        fast.apply(one), ref.apply(one)
        fast.downlink(1.0), ref.downlink(1.0)
    settled = {True: [], False: []}  # large push?: whether a candidate path settled each downlink
    for i in range(30):
        large = i % 5 == 4
        idx = np.sort(rng.choice(n, 120 if large else 8, replace=False))
        delta = SparseDelta(n, idx, (rng.standard_normal(idx.size) * 1e-3).astype(np.float32))
        fast.apply(delta), ref.apply(delta)
        del taken[:]
        a, b = fast.downlink(), ref.downlink()
        settled[large].append(any(taken))
        assert np.array_equal(a.delta.indices, b.delta.indices)
        assert np.array_equal(bits(a.delta.values), bits(b.delta.values))
    assert np.array_equal(bits(fast.U), bits(ref.U))
    if method == "none":  # it sends all: no selector
        assert all(settled[False]) and all(settled[True]), settled
    else:  # over 700 random cases: 11 to 17 of the 24 small ones settled, none of the 6 large
        assert sum(settled[False]) >= 8 and not any(settled[True]), settled


def test_candidate_set_gives_way_to_the_scan_when_it_grows_past_a_quarter_of_p():
    """Many applies and no downlink: the set is dropped (a scan is cheaper) and the next
    downlink scans, sending the same as ever."""
    ps = ParameterServer(np.zeros(P, np.float32), LAYOUT, density_down=1.0, value_dtype="float16",
                         sparsifier=Sparsifier("topk", dense_below=0))
    ps.apply(SparseDelta(P, np.arange(5), np.ones(5, np.float32)))
    assert ps._sparse._candidates.known
    ps.apply(SparseDelta(P, np.arange(6), np.ones(6, np.float32)))  # 11 > 40 // 4 entries
    assert not ps._sparse._candidates.known
    dl = ps.downlink()
    assert dl.delta.indices.tolist() == list(range(6)) and ps._sparse._candidates.known


def test_signed_zeros_are_not_in_the_residual_support():
    """+0.0 in W against -0.0 in U differ in bits, not in value: not in the support (both scans)."""
    ps = make_ps(weights=np.zeros(P, np.float32), density_down=1.0)
    state = ps.state_dict()
    state["U"][5] = -0.0
    state["W"][3] = 1.5
    ps.load_state_dict(state)
    for on in (True, False):
        with compiled(on):
            idx, vals = ps._sparse._residual_support()
            assert idx.tolist() == [3] and vals.tolist() == [1.5]


# -- replicas -----------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.lists(st.sampled_from(["step", "down", "sync"]), max_size=40),
       st.sampled_from([None, 0.1, 0.5]), st.integers(1, 3))
def test_replica_follows_recent_downlinks_or_reloads_and_is_bit_identical(seed, script, density, inline):
    """The engine ships the last ``inline`` downlinks with each task: a replica that is no
    further behind follows them, one further behind reloads U; either way it ends on U."""
    rng = np.random.default_rng(seed)
    ps = make_ps(density_down=density)
    recent: list = []
    replica, reloads = Replica(), []
    assert replica.sync([], reload_from(ps, reloads)) is True and reloads == [0]  # empty: loads U
    for action in script:
        if action == "step":
            step(ps, rng)
        elif action == "down":
            dl = ps.downlink()
            recent = (recent + [dl])[-inline:] if dl is not None else recent
        else:
            behind = bool(recent) and replica.version < recent[0].base_version
            assert replica.sync(recent, reload_from(ps, reloads)) is behind
            assert replica.version == ps.view_version
            assert np.array_equal(bits(replica.U), bits(ps.U))
            assert replica.checksum == ps.checksum
    assert replica.resyncs == len(reloads)


def test_missed_downlink_is_detected_and_resynced():
    rng = np.random.default_rng(2)
    ps = make_ps()
    replica = Replica()
    replica.sync([], reload_from(ps))
    step(ps, rng)
    ps.downlink()  # the replica never sees this one
    step(ps, rng)
    last = ps.downlink()
    with pytest.raises(ReplicaOutOfSync, match="version gap"):
        replica.apply([last])
    assert replica.U is None  # invalidated, not half-updated

    replica.sync([], reload_from(ps))
    step(ps, rng)
    ps.downlink()
    step(ps, rng)
    resynced = replica.sync([ps.downlink()], reload_from(ps))
    assert resynced and replica.resyncs == 3  # initial load, reload after the gap, this one
    assert np.array_equal(bits(replica.U), bits(ps.U))


def test_reload_is_called_only_when_needed_and_downlinks_after_it_are_followed():
    rng = np.random.default_rng(11)
    ps = make_ps()
    replica, calls = Replica(), []
    replica.sync([], reload_from(ps, calls))
    step(ps, rng)
    first = ps.downlink()
    copy = (ps.view_version, ps.U.copy())  # e.g. a broadcast made at this version
    step(ps, rng)
    second = ps.downlink()
    assert replica.sync([first, second], reload_from(ps, calls)) is False and calls == [0]
    stale = Replica()
    assert stale.sync([first, second], lambda: copy) is True  # reloads at `first`, then follows `second`
    assert stale.version == second.version and np.array_equal(bits(stale.U), bits(ps.U))


@pytest.mark.parametrize("touched", [False, True])
def test_corrupted_replica_is_detected_and_resynced(touched):
    rng = np.random.default_rng(3)
    ps = make_ps(density_down=0.1)
    replica = Replica()
    replica.sync([], reload_from(ps))
    U0 = ps.U.copy()
    step(ps, rng)
    dl = ps.downlink()
    j = int(dl.delta.indices[0]) if touched else int(np.setdiff1d(np.arange(P), dl.delta.indices)[0])
    replica._U.view(np.uint32)[j] ^= 1  # one bit of one entry flips (fault injection)
    with pytest.raises(ReplicaOutOfSync, match="checksum mismatch" if touched else "differ"):
        replica.apply([dl], full_check=not touched)

    replica.load_snapshot(0, U0)  # healthy again at version 0...
    replica._U.view(np.uint32)[j] ^= 1  # ...then corrupted again
    assert replica.sync([dl], reload_from(ps)) is True
    assert np.array_equal(bits(replica.U), bits(ps.U)) and replica.checksum == ps.checksum


def test_replica_that_cannot_follow_even_after_a_reload_raises():
    ps = make_ps()
    stale = (0, ps.U.copy())
    rng = np.random.default_rng(4)
    step(ps, rng)
    ps.downlink()
    step(ps, rng)
    with pytest.raises(ReplicaOutOfSync, match="version gap"):
        Replica().sync([ps.downlink()], lambda: stale)  # the copy predates the downlink's base


def test_float16_downlink_values_keep_replicas_in_sync():
    rng = np.random.default_rng(5)
    ps = make_ps(value_dtype="float16", density_down=0.3)
    replica = Replica()
    replica.sync([], reload_from(ps))
    for _ in range(6):
        step(ps, rng)
        dl = ps.downlink()
        v = dl.delta.values
        assert np.array_equal(v.astype(np.float16).astype(np.float32), v) and np.all(v != 0)
        assert replica.sync([dl], reload_from(ps)) is False
    assert np.array_equal(bits(replica.U), bits(ps.U))


# -- checksum -----------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(arrays(np.float32, 17, elements=st.floats(width=32, allow_nan=False)),
       st.integers(0, 16), st.integers(0, 31))
def test_checksum_changes_with_any_single_bit(U, j, bit):
    V = U.copy()
    V.view(np.uint32)[j] ^= np.uint32(1 << bit)
    assert checksum(U) != checksum(V)


@settings(max_examples=100, deadline=None)
@given(arrays(np.float32, 300, elements=st.floats(width=32, allow_nan=False, allow_infinity=False)),
       st.integers(0, 2**32 - 1), st.booleans())
def test_compiled_apply_delta_is_bitwise_numpys(U, seed, assign):
    """The one-pass apply (U and its checksum change) against numpy's, signed zeros included."""
    from sparkcnn.replica import apply_delta

    rng = np.random.default_rng(seed)
    idx = np.sort(rng.choice(U.size, int(rng.integers(0, U.size)), replace=False))
    vals = rng.choice(np.array([0.0, -0.0, 1e-30, -3.5, 2.0**-149, 1e30], np.float32), idx.size)
    vals[::3] = -U[idx][::3]  # exact cancellations: +0.0
    delta = SparseDelta(U.size, idx, vals)
    fast = U.copy()
    change = apply_delta(fast, delta, assign=assign)
    slow = U.copy()
    with compiled(False):
        assert apply_delta(slow, delta, assign=assign) == change
    assert np.array_equal(fast.view(np.uint32), slow.view(np.uint32))
    assert (checksum(U) + change) & ((1 << 64) - 1) == checksum(fast)


@settings(max_examples=50, deadline=None)
@given(arrays(np.float32, st.integers(0, 3000), elements=st.floats(width=32)))
def test_compiled_checksum_is_numpys(U):
    """The compiled full checksum against numpy's chunks (NaN, infinities, signed zeros), and on
    a vector longer than one chunk of numpy's path."""
    long = np.random.default_rng(len(U)).standard_normal(70_001).astype(np.float32)
    fast = [checksum(U), checksum(long)]
    with compiled(False):
        assert [checksum(U), checksum(long)] == fast


def test_checksum_order_sensitive_and_formatted():
    U = np.arange(8, dtype=np.float32)
    assert checksum(U) != checksum(U[::-1].copy())
    assert len(format_checksum(checksum(U))) == 16


# -- arguments ----------------------------------------------------------------------------

def test_apply_returns_the_new_version():
    ps = make_ps()
    assert ps.apply(np.zeros(P, np.float32)) == 1
    assert ps.apply(SparseDelta(P, np.array([2]), np.array([1.0], np.float32)), scale=0.5) == 2 == ps.version


def test_bad_arguments_name_the_field():
    w = np.zeros(P, np.float32)
    with pytest.raises(BadInput, match="`density_down` must be in"):
        ParameterServer(w, LAYOUT, density_down=1.5)
    with pytest.raises(BadInput, match="`layout` covers"):
        ParameterServer(w, (3, 4), density_down=None)
    with pytest.raises(BadInput, match="`weights` must be a 1-D float32"):
        ParameterServer(w.astype(np.float64), LAYOUT, density_down=None)
    ps = make_ps()
    with pytest.raises(BadInput, match="`scale` must be finite"):
        ps.apply(np.zeros(P, np.float32), scale=float("nan"))
    with pytest.raises(BadInput, match="not strictly increasing"):
        ps.apply(SparseDelta(P, np.array([4, 4]), np.ones(2, np.float32)))


# -- downlink versions ---------------------------------------------------------------------

def test_downlink_versions_chain_when_applies_batch():
    rng = np.random.default_rng(7)
    ps = make_ps()
    for _ in range(3):
        step(ps, rng)
    first = ps.downlink()
    assert (first.base_version, first.version) == (0, 3)
    assert ps.downlink() is None
    step(ps, rng)
    second = ps.downlink()
    assert (second.base_version, second.version) == (3, 4)


# -- checkpoints --------------------------------------------------------------------------

def test_state_dict_round_trip_and_same_future():
    rng = np.random.default_rng(8)
    ps = make_ps()
    for _ in range(5):
        step(ps, rng)
        ps.downlink()
    step(ps, rng)  # W ahead of U at the checkpoint
    state = ps.state_dict()
    assert all(isinstance(v, (np.ndarray, int)) for v in state.values())
    clone = make_ps(np.zeros(P, np.float32))
    clone.load_state_dict({**state, "log_versions": np.zeros(2, np.int64)})  # old checkpoints' keys: ignored
    for attr in ("version", "view_version", "checksum"):
        assert getattr(clone, attr) == getattr(ps, attr)
    for a, b in ((clone.W, ps.W), (clone.U, ps.U)):
        assert np.array_equal(bits(a), bits(b))
    replica = Replica()
    replica.sync([], reload_from(ps))
    for server in (ps, clone):
        server.apply(np.full(P, 1e-3, np.float32))
    a, b = ps.downlink(), clone.downlink()
    assert a.checksum_after == b.checksum_after
    assert replica.sync([b], reload_from(clone)) is False  # a resumed server's downlinks serve old replicas

    with pytest.raises(BadInput, match="expected 0 <= view_version <= version"):
        make_ps().load_state_dict({**state, "view_version": state["version"] + 1})
    with pytest.raises(BadInput, match="`layout` differs"):
        make_ps().load_state_dict({**state, "layout": np.asarray([P], np.int64)})
    bad = dict(state, U=state["U"].copy())
    bad["U"][0] = np.nan
    with pytest.raises(BadInput, match="`U` must be finite"):
        make_ps().load_state_dict(bad)
    del state["W"]
    with pytest.raises(BadInput, match="`W` must be float32"):
        make_ps().load_state_dict(state)


# -- staleness ----------------------------------------------------------------------------

@pytest.mark.parametrize(
    "tau, rule, expected",
    [(0, "none", 1.0), (1, "none", 1.0), (7, "none", 1.0),
     (0, "inverse", 1.0), (1, "inverse", 1.0), (2, "inverse", 0.5), (4, "inverse", 0.25),
     (np.int64(8), "inverse", 0.125)],
)
def test_staleness_scale_table(tau, rule, expected):
    assert staleness_scale(tau, rule) == expected


@pytest.mark.parametrize(
    "tau, bound, expected",
    [(0, None, False), (100, None, False), (0, 0, False), (1, 0, True), (3, 3, False), (4, 3, True)],
)
def test_held_back_table(tau, bound, expected):
    assert held_back(tau, bound) is expected


def test_staleness_validation_names_the_field():
    with pytest.raises(BadInput, match="`staleness.rule` must be one of"):
        staleness_scale(1, "sqrt")
    with pytest.raises(BadInput, match="`tau` must be an int >= 0"):
        staleness_scale(-1)
    with pytest.raises(BadInput, match="`staleness.max_staleness`"):
        held_back(1, -2)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_compiled_float16_rounding_of_a_downlink_is_numpys_bitwise(seed):
    """The scan's float16 rounding, compiled: every value clipped to ±65504 and rounded to the
    nearest float16 (ties to even, subnormals), the entries that round to 0 left out, bitwise
    numpy's casts; a value that is not finite is left to numpy (None, nothing changed)."""
    rng = np.random.default_rng(seed)
    n = 3000
    mags = 2.0 ** rng.uniform(-27, 17, n)  # below the float16 zero bound up to beyond its range
    vals = (mags * rng.choice([-1, 1], n)).astype(np.float32)
    ties = rng.choice(n, 200, replace=False)  # exact halves between neighbouring float16 values
    h = rng.integers(1, 0x7BFF, ties.size).astype(np.uint16)
    lo, hi = h.view(np.float16).astype(np.float32), (h + 1).view(np.float16).astype(np.float32)
    vals[ties] = (lo.astype(np.float64) + hi) / 2
    vals[:4] = [2.0**-25, -(2.0**-25), 65520.0, -1e30]
    idx = np.sort(rng.choice(10**6, n, replace=False)).astype(np.int64)
    ref = np.clip(vals, -65504, 65504).astype(np.float16).astype(np.float32)
    keep = ref != 0
    with compiled(True):
        got_idx, got_vals = SparseDownlink._round_f16(idx.copy(), vals.copy())
    assert np.array_equal(got_idx, idx[keep]) and np.array_equal(bits(got_vals), bits(ref[keep]))
    assert got_idx.size < n  # some did round to 0
    with compiled(True):
        from sparkcnn.compression import native_server
        bad = vals.copy()
        bad[7] = np.nan
        assert native_server.round_f16(idx.copy(), bad) is None


@pytest.mark.parametrize("on", [True, False])
def test_the_residual_support_says_which_entries_float16_can_send(on):
    """The scan's one pass: the residual's support and, in it, the positions of the entries whose
    float16 rounding is not 0 (|R| > 2**-25), on both paths."""
    ps = make_ps(weights=np.zeros(P, np.float32), density_down=0.1, value_dtype="float16")
    state = ps.state_dict()
    state["W"][[1, 4, 9, 12]] = [2.0**-25, -(2.0**-24), 1.5, -(2.0**-26)]
    state["U"][5] = -0.0
    ps.load_state_dict(state)
    with compiled(on):
        idx, vals, pos = ps._sparse._residual_support(sendable=True)
    assert idx.tolist() == [1, 4, 9, 12] and pos.tolist() == [1, 2]
    assert vals.tolist() == [2.0**-25, -(2.0**-24), 1.5, -(2.0**-26)]
