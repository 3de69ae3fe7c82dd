"""Wire codec: round trips, size on the wire, and rejection of malformed bytes."""

from __future__ import annotations

import struct
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkcnn.compression import SparseDelta, decode, decode_batch, decode_parts, encode, weighted_sum
from sparkcnn.compression import native, native_server, sparse_sum
from sparkcnn.compression.codec_format import FLOAT16_MAX, MAGIC
from sparkcnn.compression.codec_values import first_unfit, wire_to_float32
from sparkcnn.errors import CodecError
from tests.native_env import compiled

FAST = settings(max_examples=80, deadline=None)
HEADER = 16  # magic, version, dtype, reserved, tensor count, unary length


@st.composite
def layouts_and_deltas(draw):
    """Random layouts whose tensors are empty, dense or sparse, any mix."""
    layout = tuple(draw(st.lists(st.integers(0, 3000), min_size=0, max_size=5)))
    return layout, draw(deltas_over(layout))


@st.composite
def deltas_over(draw, layout):
    """A delta over ``layout`` whose tensors are empty, dense or sparse, any mix."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    parts, start = [], 0
    for n in layout:
        kind = draw(st.sampled_from(["empty", "dense", "sparse", "one"]))
        if n == 0 or kind == "empty":
            local = np.empty(0, np.int64)
        elif kind == "dense":
            local = np.arange(n)
        elif kind == "one":
            local = np.array([draw(st.integers(0, n - 1))])
        else:
            local = np.sort(rng.choice(n, size=draw(st.integers(1, n)), replace=False))
        parts.append(local + start)
        start += n
    idx = np.concatenate(parts) if parts else np.empty(0, np.int64)
    scale = draw(st.sampled_from([1e-6, 1e-2, 1.0, 1e3]))
    values = (rng.standard_normal(idx.size) * scale).astype(np.float32)
    return SparseDelta(start, idx, values)


@FAST
@given(case=layouts_and_deltas())
def test_round_trip_float32_is_exact(case):
    layout, delta = case
    back = decode(encode(delta, layout, value_dtype="float32"), layout)
    assert back.size == delta.size
    assert np.array_equal(back.indices, delta.indices)
    assert np.array_equal(back.values, delta.values)


@FAST
@given(case=layouts_and_deltas())
def test_round_trip_float16_is_float16_rounding(case):
    layout, delta = case
    back = decode(encode(delta, layout), layout)
    assert np.array_equal(back.indices, delta.indices)
    assert np.array_equal(back.values, delta.values.astype(np.float16).astype(np.float32))


def test_dense_empty_and_no_tensors():
    layout = (5, 0, 3)
    dense = SparseDelta.from_dense(np.arange(8, dtype=np.float32))
    data = encode(dense, layout)
    assert len(data) == HEADER + 5 * 3 + 8 * 2  # no indices for a dense tensor
    assert np.array_equal(decode(data, layout).to_dense(), np.arange(8))
    empty = decode(encode(SparseDelta.empty(8), layout), layout)
    assert empty.nnz == 0 and empty.size == 8
    assert decode(encode(SparseDelta.empty(0), ()), ()).nnz == 0


@pytest.mark.parametrize("density, limit", [(0.01, 3.2), (0.001, 3.5)])
def test_bytes_per_nonzero_on_1m_random_support(density, limit):
    n = 1_000_000
    rng = np.random.default_rng(0)
    idx = np.sort(rng.choice(n, size=int(density * n), replace=False))
    delta = SparseDelta(n, idx, rng.standard_normal(idx.size))
    assert len(encode(delta, (n,))) / delta.nnz <= limit


def test_wire_to_float32_matches_numpy_cast_for_every_finite_float16():
    bits = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    halves = bits.view(np.float16)
    halves = halves[np.isfinite(halves)]
    for scale in (1.0, -0.37, 3e-5, 1e5):
        expected = np.float32(scale) * halves.astype(np.float32)
        assert np.array_equal(wire_to_float32(halves, scale), expected, equal_nan=False)


# --------------------------------------------------------------------------- rejection


def _sparse_payload(layout=(1000,), idx=(3, 100, 900), values=(1.0, -2.0, 0.5)):
    return encode(SparseDelta(sum(layout), np.array(idx), np.array(values, np.float32)), layout)


def test_rejects_truncated_and_trailing_bytes():
    data = _sparse_payload()
    with pytest.raises(CodecError, match=r"truncated header: 10 bytes, need 16"):
        decode(data[:10], (1000,))
    with pytest.raises(CodecError, match=r"truncated tensor table"):
        decode(data[:HEADER + 2], (1000,))
    with pytest.raises(CodecError, match=rf"truncated delta: {len(data) - 1} bytes, expected {len(data)}"):
        decode(data[:-1], (1000,))
    with pytest.raises(CodecError, match=r"2 trailing bytes after the delta"):
        decode(data + b"\0\0", (1000,))


def test_every_truncation_is_rejected():
    layout = (40, 5000, 7)
    rng = np.random.default_rng(1)
    idx = np.concatenate([np.arange(40), 40 + np.sort(rng.choice(5000, 60, replace=False))])
    data = encode(SparseDelta(5047, idx, rng.standard_normal(idx.size)), layout)
    for cut in range(len(data)):
        with pytest.raises(CodecError):
            decode(data[:cut], layout)


def test_rejects_out_of_range_index():
    data = _sparse_payload()  # indices up to 900 in a tensor of 1000
    with pytest.raises(CodecError, match=r"delta tensor 0: index 900 out of range \[0, 800\)"):
        decode(data, (800,))
    # A later tensor: an index read past tensor 1's end is named in its terms.
    data = encode(SparseDelta(3000, [1000, 2999], [1.0, 2.0]), (1000, 2000))
    with pytest.raises(CodecError, match=r"delta tensor 1: index 1999 out of range \[0, 1500\)"):
        decode(data, (1500, 1500))
    with pytest.raises(CodecError, match=r"delta: index 1000 out of range \[0, 1000\)"):
        encode(SparseDelta(1000, [5, 1000], [1.0, 2.0]), (1000,))


def test_rejects_non_increasing_index():
    # Gap coding cannot express a decrease, so the encoder is where it is caught.
    with pytest.raises(CodecError, match=r"not strictly increasing at position 1 \(7 then 7\)"):
        encode(SparseDelta(10, [7, 7], [1.0, 2.0]), (10,))
    with pytest.raises(CodecError, match=r"not strictly increasing at position 2 \(8 then 3\)"):
        encode(SparseDelta(10, [1, 8, 3], [1.0, 2.0, 3.0]), (10,))


@pytest.mark.parametrize("bits, shown", [(0x7E00, "nan"), (0x7C00, "inf"), (0xFC00, "-inf")])
def test_rejects_non_finite_values(bits, shown):
    data = bytearray(_sparse_payload())
    values_at = HEADER + 5  # one tensor: count u32 + rice u8, then the values
    struct.pack_into("<H", data, values_at + 2, bits)  # the second value, at index 100
    with pytest.raises(CodecError, match=rf"delta tensor 0: value {shown} at index 100 is not a finite float16"):
        decode(bytes(data), (1000,))
    # A dense tensor's bad value is named by its position too.
    dense = bytearray(encode(SparseDelta.from_dense(np.ones(4)), (4,)))
    struct.pack_into("<H", dense, HEADER + 5 + 6, bits)
    with pytest.raises(CodecError, match=rf"delta tensor 0: value {shown} at index 3 is not a finite float16"):
        decode(bytes(dense), (4,))


def test_value_check_agrees_with_isfinite_on_every_float16_and_the_float32_edges():
    halves = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    bad = ~np.isfinite(halves)
    for at in np.flatnonzero(bad)[::97].tolist() + [int(np.flatnonzero(bad)[0])]:
        assert first_unfit(np.concatenate([halves[~bad], halves[at:at + 1]])) == int((~bad).sum())
    assert first_unfit(halves[~bad]) is None
    edges = np.array([np.finfo(np.float32).max, -np.finfo(np.float32).max, 0.0, -0.0], np.float32)
    assert first_unfit(edges) is None
    assert first_unfit(np.append(edges, np.float32(np.inf))) == 4
    wire16 = np.array([65504.0, -65504.0], np.float32)
    assert first_unfit(wire16, FLOAT16_MAX) is None
    assert first_unfit(np.append(wire16, np.nextafter(np.float32(65504), np.float32(np.inf))), FLOAT16_MAX) == 2


def test_decoder_names_a_non_finite_float32_value_in_a_later_dense_tensor():
    layout = (1000, 4, 3)
    idx = np.concatenate([[7, 500], 1000 + np.arange(7)])
    vals = np.arange(9, dtype=np.float32)
    data = bytearray(encode(SparseDelta(1007, idx, vals), layout, value_dtype="float32"))
    values_at = HEADER + 5 * 3  # three tensors: dense values (tensor 1, then 2) first, then sparse
    struct.pack_into("<f", data, values_at + 4 * 5, np.inf)  # tensor 2, index 1
    with pytest.raises(CodecError, match=r"delta tensor 2: value inf at index 1 is not a finite float32"):
        decode(bytes(data), layout)


def test_encoder_refuses_values_the_wire_cannot_carry():
    with pytest.raises(CodecError, match=r"delta tensor 1: value nan at index 0 is not a finite float16"):
        encode(SparseDelta(3, [0, 1], [1.0, np.nan]), (1, 2))
    with pytest.raises(CodecError, match=r"value 70000.0 at index 0 is not a finite float16"):
        encode(SparseDelta(2, [0], [7e4]), (2,))
    assert decode(encode(SparseDelta(2, [0], [7e4]), (2,), value_dtype="float32"), (2,)).values[0] == 7e4


def test_rejects_bad_header_fields():
    data = _sparse_payload()
    with pytest.raises(CodecError, match=r"bad magic b'XKCD', expected b'SKCD'"):
        decode(b"X" + data[1:], (1000,))
    with pytest.raises(CodecError, match=r"unsupported format version 9 \(this build reads 1\)"):
        decode(data[:4] + b"\x09" + data[5:], (1000,))
    with pytest.raises(CodecError, match=r"unknown value dtype code 7"):
        decode(data[:5] + b"\x07" + data[6:], (1000,))
    with pytest.raises(CodecError, match=r"tensor count 1 does not match layout of 2 tensors"):
        decode(data, (500, 500))
    assert data[:4] == MAGIC


def test_rejects_inconsistent_table_and_streams():
    data = bytearray(_sparse_payload())
    bad = bytearray(data)
    struct.pack_into("<I", bad, HEADER, 2000)  # count > tensor size
    with pytest.raises(CodecError, match=r"delta tensor 0: count 2000 exceeds tensor size 1000"):
        decode(bytes(bad), (1000,))
    bad = bytearray(data)
    bad[HEADER + 4] = 25  # Rice parameter beyond any gap of a 1000-entry tensor
    with pytest.raises(CodecError, match=r"Rice parameter 25 exceeds 10 for size 1000"):
        decode(bytes(bad), (1000,))
    # Zero the unary stream: no codes where three are announced.
    unary_len = struct.unpack_from("<I", data, 12)[0]
    start = HEADER + 5 + 3 * 2
    bad = bytearray(data)
    bad[start:start + unary_len] = bytes(unary_len)
    with pytest.raises(CodecError, match=r"index stream holds 0 codes, expected 3"):
        decode(bytes(bad), (1000,))


@settings(max_examples=300, deadline=None)
@given(pos=st.integers(0, 10_000), byte=st.integers(0, 255), layout_kind=st.integers(0, 2))
def test_corrupted_bytes_give_codec_error_or_a_valid_delta(pos, byte, layout_kind):
    layout = [(1000,), (40, 5000, 7), (3, 0, 20000)][layout_kind]
    rng = np.random.default_rng(layout_kind)
    size = sum(layout)
    idx = np.sort(rng.choice(size, size // 50, replace=False))
    data = bytearray(encode(SparseDelta(size, idx, rng.standard_normal(idx.size)), layout))
    data[pos % len(data)] = byte
    try:
        out = decode(bytes(data), layout)
    except CodecError:
        return
    out.validate()  # whatever is accepted satisfies every invariant
    assert np.all(np.isfinite(out.values)) and out.size == size


# --------------------------------------------------------------------------- decode_batch + sum


def _reference(payloads, weights: dict, layout):
    """The numpy reference: decode each chosen payload, then weighted_sum in payload order."""
    chosen = sorted(weights)
    return weighted_sum([decode(payloads[k], layout) for k in chosen], [weights[k] for k in chosen], sum(layout))


def test_decode_batch_keeps_failures_and_sums_the_rest():
    layout = (64, 20_000, 10, 30_000)
    size = sum(layout)
    rng = np.random.default_rng(2)
    payloads = []
    for k in range(5):
        idx = np.concatenate([np.arange(64), 64 + np.sort(rng.choice(20_000, 40 + k, replace=False)),
                              20_074 + np.sort(rng.choice(30_000, 30, replace=False))])
        if k % 2:  # some payloads send the third tensor whole
            idx = np.sort(np.concatenate([idx, np.arange(20_064, 20_074)]))
        payloads.append(encode(SparseDelta(size, idx, rng.standard_normal(idx.size)), layout))
    payloads[2] = payloads[2][:-3]
    batch = decode_batch(payloads, layout)
    assert list(batch.errors) == [2] and "truncated delta" in str(batch.errors[2])
    assert np.isnan(batch.norms[2]) and np.isfinite(np.delete(batch.norms, 2)).all()
    assert batch.norms[0] == pytest.approx(np.linalg.norm(decode(payloads[0], layout).values.astype(np.float64)))
    weights = {k: float(w) for k, w in zip((0, 1, 3, 4), rng.uniform(-1, 1, 4))}
    expected = sum(w * decode(payloads[k], layout).to_dense().astype(np.float64) for k, w in weights.items())
    np.testing.assert_allclose(batch.sum(weights), expected, rtol=1e-5, atol=1e-6)
    assert np.array_equal(batch.sum(weights), _reference(payloads, weights, layout))
    with pytest.raises(ValueError, match="payload 2 is not a decoded payload"):
        batch.sum({2: 1.0})


@st.composite
def batches(draw, layout, count):
    """``count`` payloads over ``layout``, float16 or float32: any mix of empty, dense and sparse
    tensors, or (the usual round) the same tensors whole in every payload."""
    same = draw(st.booleans())
    dense = draw(st.sets(st.integers(0, len(layout) - 1)))
    out = []
    for _ in range(count):
        delta = draw(deltas_over(layout))
        if same:  # tensors in `dense` whole, the others sparse or empty
            offsets = np.concatenate([[0], np.cumsum(layout)]).astype(np.int64)
            t = np.searchsorted(offsets, delta.indices, side="right") - 1
            keep = ~np.isin(t, list(dense)) & (np.bincount(t, minlength=len(layout))[t] < np.asarray(layout)[t])
            whole = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in sorted(dense)] + [[]])
            idx = np.concatenate([delta.indices[keep], whole.astype(np.int64)])
            order = np.argsort(idx)
            values = np.concatenate([delta.values[keep], np.linspace(-1, 1, whole.size, dtype=np.float32)])
            delta = SparseDelta(delta.size, idx[order], values[order])
        out.append(encode(delta, layout, value_dtype=draw(st.sampled_from(["float16", "float32"]))))
    return out


@FAST
@given(data=st.data(), layout=st.lists(st.integers(0, 3000), min_size=1, max_size=5).map(tuple),
       count=st.integers(0, 7))
def test_batch_sum_is_bitwise_the_reference_for_any_thread_count_and_both_paths(data, layout, count):
    payloads = data.draw(batches(layout, count))
    chosen = data.draw(st.sets(st.integers(0, max(count - 1, 0)), max_size=count)) if count else set()
    weights = {k: data.draw(st.floats(-4, 4, width=32)) for k in sorted(chosen)}
    expected = _reference(payloads, weights, layout)
    step = data.draw(st.sampled_from([5, sparse_sum.DENSE_STEP]))  # dense values taken a few at a time, or at once
    with mock.patch.object(sparse_sum, "PARALLEL_MIN_BYTES", 0), mock.patch.object(sparse_sum, "DENSE_STEP", step):
        for numpy_only in (False, True):
            with compiled(not numpy_only):
                for threads in (1, 2, 3, 4):
                    batch = decode_batch(payloads, layout, threads=threads)
                    assert batch.threads == threads and not batch.errors
                    got = batch.sum(weights)
                    assert got.dtype == np.float32, threads
                    # bits, so signed zeros count too
                    assert np.array_equal(got.view(np.int32), expected.view(np.int32)), (numpy_only, threads)


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
def test_decode_batch_with_threads_names_each_bad_payload(threads):
    layout = (64, 20_000, 30_000)
    rng = np.random.default_rng(5)
    payloads = []
    for _ in range(8):
        idx = np.concatenate([np.arange(64), 64 + np.sort(rng.choice(50_000, 60, replace=False))])
        payloads.append(encode(SparseDelta(sum(layout), idx, rng.standard_normal(idx.size)), layout))
    bad = list(payloads)
    bad[3] = bad[3][:-3]  # truncated
    bad[4] = bad[4][:23] + b"\x7f" + bad[4][24:]  # tensor 1's count (high byte) beyond its size
    bad[6] = bad[6][:-2] + b"\xff\xff"  # the last remainder bits: an index out of range, or a bad stream
    with mock.patch.object(sparse_sum, "PARALLEL_MIN_BYTES", 0):
        batch = decode_batch(bad, layout, threads=threads)
    assert sorted(batch.errors) == [3, 4, 6]
    assert str(batch.errors[3]).startswith("truncated delta")
    assert str(batch.errors[4]).startswith("delta tensor 1: count")
    good = {k: 1.0 for k in range(8) if k not in batch.errors}
    assert np.array_equal(batch.sum(good), _reference(payloads, good, layout))


def test_decode_batch_validates_threads():
    for threads in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"threads must be an integer >= 1"):
            decode_batch([], (10,), threads=threads)


def test_decode_parts_keeps_wire_dtype():
    data = _sparse_payload()
    parts = decode_parts(data, (1000,))
    assert parts.sparse_values.dtype == np.float16 and parts.sparse_indices.tolist() == [3, 100, 900]


def test_round_trip_of_wide_gaps_uses_64_bit_fields():
    # One entry per 2**28-entry tensor: Rice parameters near 27 bits, beyond
    # the 32-bit window of the fast path.
    layout = (2**28, 2**28)
    delta = SparseDelta(2**29, [2**28 - 1, 2**28 + 123_456_789], [1.5, -2.0])
    data = encode(delta, layout)
    assert max(data[HEADER + 8:HEADER + 10]) > 25  # the Rice parameters
    back = decode(data, layout)
    assert back.indices.tolist() == delta.indices.tolist() and back.values.tolist() == [1.5, -2.0]
    with pytest.raises(CodecError, match=r"delta tensor 1: index 123456789 out of range \[0, 100000000\)"):
        decode(data, (2**28, 10**8))


# --------------------------------------------------------------------------- compiled kernels


def test_compiled_kernels_are_in_use():
    # numba is a dependency: a silent fall back to numpy would lose the driver's speed.
    assert native.enabled()
    with compiled(False):
        assert not native.enabled()


KERNEL_USE = """
import numpy as np
from sparkcnn.compression import SparseDelta, decode, encode
from sparkcnn.ps import ParameterServer
layout = (3000, 40)
d = SparseDelta(3040, np.array([5, 900, 3001]), np.array([0.5, -1.0, 2.0], np.float32))
assert decode(encode(d, layout, value_dtype="float16"), layout).nnz == 3
ps = ParameterServer(np.zeros(3040, np.float32), layout, density_down=0.01, value_dtype="float16")
ps.apply(d, 0.1)
assert ps.downlink() is not None
"""


def test_a_later_process_loads_the_compiled_kernels_from_the_disk_cache(tmp_path):
    # Kernels keyed on something that differs per process would be compiled again in every
    # Python worker and driver (seconds each) and leave a new cache file every time.
    import os
    import subprocess
    import sys

    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path), NUMBA_DEBUG_CACHE="1", SPARKCNN_NATIVE="1")
    runs = [subprocess.run([sys.executable, "-c", KERNEL_USE], env=env, capture_output=True, text=True,
                           timeout=600) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[-1].stderr[-2000:]
    first, second = (r.stdout + r.stderr for r in runs)
    assert "data saved" in first
    assert "data loaded" in second and "data saved" not in second, second[-2000:]


@settings(max_examples=300, deadline=None)
@given(case=layouts_and_deltas(), value_dtype=st.sampled_from(["float16", "float32"]))
def test_compiled_encoder_writes_the_bytes_numpy_writes(case, value_dtype):
    layout, delta = case
    native_bytes = encode(delta, layout, value_dtype=value_dtype)
    native_back = decode(native_bytes, layout)
    with compiled(False):
        assert encode(delta, layout, value_dtype=value_dtype) == native_bytes
        back = decode(native_bytes, layout)
    assert np.array_equal(native_back.indices, back.indices)
    assert native_back.values.tobytes() == back.values.tobytes()


def test_compiled_float16_rounding_is_numpys():
    """Every float32 a float16 payload may carry rounds (and reads back) bitwise as numpy's cast:
    random bit patterns, and each side of the subnormal, normal and largest-value boundaries."""
    rng = np.random.default_rng(5)
    bits = np.concatenate([rng.integers(0, 2**32, 400_000, dtype=np.uint64).astype(np.uint32),
                           np.arange(0x33000000 - 64, 0x33000000 + 64, dtype=np.uint32),   # 2**-25
                           np.arange(0x387FF000, 0x38801000, dtype=np.uint32),             # 2**-14
                           np.arange(0x477FD000, 0x477FE001, dtype=np.uint32)])            # 65504
    x = bits.view(np.float32)
    x = x[np.isfinite(x) & (np.abs(x) <= 65504)]
    x = np.concatenate([x, -x[:1000]])
    layout = (x.size,)
    delta = SparseDelta(x.size, np.arange(x.size), x)
    data = encode(delta, layout)
    back = decode(data, layout)
    with compiled(False):
        assert encode(delta, layout) == data
        ref = decode(data, layout)
    assert back.values.tobytes() == ref.values.tobytes()
    assert np.array_equal(back.values, x.astype(np.float16).astype(np.float32))


def test_compiled_encoder_refuses_what_numpy_refuses():
    """The compiled pass checks order, range and values; the numpy path then names the fault."""
    layout = (10, 20)
    for idx, vals, dtype, match in (([3, 3], [1.0, 2.0], "float16", "not strictly increasing"),
                                    ([3, 30], [1.0, 2.0], "float16", "out of range"),
                                    ([3, 12], [1.0, 70000.0], "float16", "tensor 1: value 70000.0 at index 2"),
                                    ([3, 12], [np.inf, 1.0], "float32", "tensor 0: value inf at index 3")):
        with pytest.raises(CodecError, match=match):
            encode(SparseDelta(30, np.array(idx), np.array(vals, np.float32)), layout, value_dtype=dtype)


def test_compiled_encoder_on_wide_gaps_and_every_rice_parameter():
    """Gaps from 0 to 2**28 (Rice parameters 0 to 27, remainders wider than a byte)."""
    layout = (2**28, 2**28, 64, 5)
    rng = np.random.default_rng(3)
    for count in (1, 2, 7, 300, 5000):
        idx = np.concatenate([np.sort(rng.choice(2**28, count, replace=False)),
                              2**28 + np.sort(rng.choice(2**28, count // 2 + 1, replace=False)),
                              2**29 + np.arange(0, 64, 3), [2**29 + 64 + 4]])
        delta = SparseDelta(sum(layout), idx, rng.standard_normal(idx.size))
        native_bytes = encode(delta, layout)
        with compiled(False):
            assert encode(delta, layout) == native_bytes
        assert np.array_equal(decode(native_bytes, layout).indices, idx)


@settings(max_examples=400, deadline=None)
@given(pos=st.integers(0, 10_000), byte=st.integers(0, 255), layout_kind=st.integers(0, 3),
       density=st.sampled_from([0.002, 0.02, 0.3]))
def test_compiled_decoder_accepts_and_rejects_exactly_what_numpy_does(pos, byte, layout_kind, density):
    layout = [(1000,), (40, 5000, 7), (3, 0, 20000), (1, 70_000, 2)][layout_kind]
    rng = np.random.default_rng(layout_kind)
    size = sum(layout)
    idx = np.sort(rng.choice(size, max(1, int(size * density)), replace=False))
    data = bytearray(encode(SparseDelta(size, idx, rng.standard_normal(idx.size)), layout))
    if pos % 3:  # two in three corrupted; the rest intact
        data[pos % len(data)] = byte
    results = []
    for numpy_only in (False, True):
        with compiled(not numpy_only):
            try:
                p = decode_parts(bytes(data), layout)
                results.append(("ok", p.sparse_indices.tolist(), p.sparse_values.tobytes(), p.dense_values.tobytes()))
            except CodecError as e:
                results.append(("error", str(e)))
            try:  # the whole decode is one compiled call: the same delta, or the same error
                d = decode(bytes(data), layout)
                results.append(("ok", d.indices.tolist(), d.values.tobytes()))
            except CodecError as e:
                results.append(("error", str(e)))
    assert results[:2] == results[2:]


def test_blocked_scatter_chunks_do_not_change_the_sum():
    rng = np.random.default_rng(3)
    size, n = 50_000, 9
    runs, segs = [], []
    for _ in range(n):  # sparse entries outside each payload's dense segments
        cuts = np.sort(rng.choice(size, 4, replace=False))
        seg = [(int(cuts[0]), int(cuts[1])), (int(cuts[2]), int(cuts[3]))][: rng.integers(0, 3)]
        free = np.ones(size, bool)
        for a, b in seg:
            free[a:b] = False
        runs.append(np.sort(rng.choice(np.flatnonzero(free), rng.integers(0, 3000), replace=False)))
        segs.append(seg)
    idx = np.concatenate(runs).astype(np.int64)
    vals = rng.standard_normal(idx.size).astype(np.float32)
    starts = np.concatenate([[0], np.cumsum([r.size for r in runs])]).astype(np.int64)
    flat = [(a, b) for seg in segs for a, b in seg]
    seg_value = np.concatenate([[0], np.cumsum([b - a for a, b in flat])]).astype(np.int64)
    dense_vals = rng.standard_normal(int(seg_value[-1])).astype(np.float32)
    seg_hi = np.cumsum([len(s) for s in segs]).astype(np.int64)
    weights = rng.uniform(-2, 2, n).astype(np.float32)
    runs_arg = native_server.Runs(weights, idx, vals, starts[:-1], starts[1:],
                                  np.array([a for a, _ in flat], np.int64), np.array([b for _, b in flat], np.int64),
                                  seg_value[:-1], dense_vals, seg_hi - [len(s) for s in segs], seg_hi)
    expected = np.zeros(size, np.float32)
    g = 0
    for k in range(n):
        expected[idx[starts[k]:starts[k + 1]]] += weights[k] * vals[starts[k]:starts[k + 1]]
        for a, b in segs[k]:
            expected[a:b] += weights[k] * dense_vals[seg_value[g]:seg_value[g + 1]]
            g += 1
    for chunk in (1, 7, 4096, 1 << 20):
        for lo, hi in ((0, size), (0, 12_345), (12_345, size), (20_000, 20_001)):
            acc = np.zeros(size, np.float32)
            native_server.scatter_runs(acc, runs_arg, lo, hi, chunk)
            want = np.zeros(size, np.float32)
            want[lo:hi] = expected[lo:hi]
            assert np.array_equal(acc.view(np.int32), want.view(np.int32)), (chunk, lo, hi)
