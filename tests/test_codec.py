"""Wire codec: round trips, size on the wire, and rejection of malformed bytes."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkcnn.compression import SparseDelta, decode, decode_and_sum, decode_parts, encode
from sparkcnn.compression.codec import MAGIC, wire_to_float32
from sparkcnn.errors import CodecError

FAST = settings(max_examples=80, deadline=None)
HEADER = 16  # magic, version, dtype, reserved, tensor count, unary length


@st.composite
def layouts_and_deltas(draw):
    """Random layouts whose tensors are empty, dense or sparse, any mix."""
    layout = tuple(draw(st.lists(st.integers(0, 3000), min_size=0, max_size=5)))
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
    return layout, SparseDelta(start, idx, values)


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
    with pytest.raises(CodecError, match=rf"delta tensor 0: non-finite value {shown} at index 100"):
        decode(bytes(data), (1000,))
    # A dense tensor's bad value is named by its position too.
    dense = bytearray(encode(SparseDelta.from_dense(np.ones(4)), (4,)))
    struct.pack_into("<H", dense, HEADER + 5 + 6, bits)
    with pytest.raises(CodecError, match=rf"delta tensor 0: non-finite value {shown} at index 3"):
        decode(bytes(dense), (4,))


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


# --------------------------------------------------------------------------- decode_and_sum


def test_decode_and_sum_matches_dense_reference_and_is_all_or_nothing():
    layout = (64, 20_000, 10, 30_000)
    size = sum(layout)
    rng = np.random.default_rng(2)
    payloads, dense = [], []
    for k in range(5):
        idx = np.concatenate([np.arange(64), 64 + np.sort(rng.choice(20_000, 40 + k, replace=False)),
                              20_074 + np.sort(rng.choice(30_000, 30, replace=False))])
        if k % 2:  # some payloads send the third tensor whole
            idx = np.sort(np.concatenate([idx, np.arange(20_064, 20_074)]))
        delta = SparseDelta(size, idx, rng.standard_normal(idx.size))
        payloads.append(encode(delta, layout))
        dense.append(decode(payloads[-1], layout).to_dense().astype(np.float64))
    weights = rng.uniform(-1, 1, 5)
    expected = sum(w * d for w, d in zip(weights, dense))
    np.testing.assert_allclose(decode_and_sum(payloads, weights, layout), expected, rtol=1e-5, atol=1e-6)

    W = np.ones(size, np.float32)
    decode_and_sum(payloads, weights, layout, out=W)
    np.testing.assert_allclose(W, expected + 1, rtol=1e-5, atol=1e-6)

    before = W.copy()
    with pytest.raises(CodecError, match=r"payload 2: truncated delta"):
        decode_and_sum(payloads[:2] + [payloads[2][:-3]] + payloads[3:], weights, layout, out=W)
    assert np.array_equal(W, before)  # nothing applied


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
