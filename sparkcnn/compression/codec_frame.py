"""Reading a payload: its frame (header, table, lengths) checked, then its index stream
decoded and its values checked, into DecodedParts, the split form sparse_sum sums.

Every fault of the bytes is a CodecError naming it. The frame is checked
first (``parse``), so that a batch of payloads can size its shared arrays
before decoding any index stream into them (``decode_frame``, sparse_sum.py).
The index stream is decoded by the compiled kernel where it is enabled
(native_codec.rice_indices), which only says *that* the stream is bad; the
numpy decoder, the reference, then says what.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..errors import CodecError
from . import native, native_codec
from .codec_format import (HEADER, MAGIC, VERSION, WIRE_DTYPES, LayoutInfo, layout_info, segment_starts,
                           unpack_fields)
from .codec_values import check_values
from .delta import Layout


@dataclass(frozen=True)
class DecodedParts:
    """A validated delta, split for fast summation (see sparse_sum)."""

    dense: np.ndarray  # bool, T: tensors sent whole
    dense_values: np.ndarray  # wire dtype, the dense tensors' values in tensor order
    sparse_indices: np.ndarray  # int64, global, strictly increasing
    sparse_values: np.ndarray  # wire dtype, same length
    counts: np.ndarray  # int64, T: entries per tensor


def _fail_tensor(mask: np.ndarray, what) -> None:
    """Raise for the first tensor flagged in ``mask``; ``what(t)`` says why."""
    t = int(np.flatnonzero(mask)[0])
    raise CodecError(f"delta tensor {t}: {what(t)}")


def _raise_out_of_range(q, b, r, sp_counts, sparse, sizes) -> None:
    """Name the first out-of-range index (slow path, only for bad input).

    Recomputed in float64 so that forged gaps cannot overflow: exact below
    2**53, and anything larger is out of range anyway.
    """
    gaps = q * np.exp2(b.astype(np.float64)) + r + 1
    seg_end = np.cumsum(sp_counts)
    cs = np.cumsum(gaps)
    base = np.concatenate([[0.0], cs[seg_end[:-1] - 1]])
    local = cs - 1 - np.repeat(base, sp_counts)
    at = int(np.flatnonzero(local >= np.repeat(sizes[sparse], sp_counts))[0])
    t = int(np.flatnonzero(sparse)[np.searchsorted(seg_end, at, side="right")])
    raise CodecError(f"delta tensor {t}: index {int(local[at])} out of range [0, {int(sizes[t])})")


@dataclass(frozen=True)
class Frame:
    """A payload whose header, table and lengths are checked; index stream not yet decoded."""

    info: LayoutInfo
    counts: np.ndarray  # int64, T
    rice: np.ndarray  # uint8, T
    dense: np.ndarray  # bool, T
    sparse: np.ndarray  # bool, T
    values: np.ndarray  # wire dtype: dense tensors' values, then sparse ones'
    n_dense: int
    unary: np.ndarray  # uint8
    rem: np.ndarray  # uint8

    @property
    def n_sparse(self) -> int:
        return self.values.size - self.n_dense


def parse(data: bytes, layout: Layout) -> Frame:
    """Check everything but the index stream and the values; CodecError on any fault."""
    info = layout_info(layout)
    buf = memoryview(data)
    if len(buf) < HEADER.size:
        raise CodecError(f"truncated header: {len(buf)} bytes, need {HEADER.size}")
    magic, version, code, reserved, ntensors, unary_len = HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise CodecError(f"bad magic {magic!r}, expected {MAGIC!r} (not a sparkcnn delta)")
    if version != VERSION:
        raise CodecError(f"unsupported format version {version} (this build reads {VERSION})")
    if code not in WIRE_DTYPES:
        raise CodecError(f"unknown value dtype code {code}")
    if reserved:
        raise CodecError(f"reserved header field is {reserved}, expected 0")
    if ntensors != info.sizes.size:
        raise CodecError(f"tensor count {ntensors} does not match layout of {info.sizes.size} tensors")
    pos = HEADER.size
    if len(buf) < pos + 5 * ntensors:
        raise CodecError(f"truncated tensor table: {len(buf)} bytes, need {pos + 5 * ntensors}")
    counts = np.frombuffer(buf, "<u4", ntensors, pos).astype(np.int64)
    rice_u8 = np.frombuffer(buf, np.uint8, ntensors, pos + 4 * ntensors)
    rice = rice_u8.astype(np.int64)
    pos += 5 * ntensors

    sizes = info.sizes
    if (counts > sizes).any():
        _fail_tensor(counts > sizes, lambda t: f"count {counts[t]} exceeds tensor size {sizes[t]}")
    dense = counts == sizes
    sparse = (counts > 0) & ~dense
    if (rice[~sparse] != 0).any():
        _fail_tensor(~sparse & (rice != 0), lambda t: f"Rice parameter {rice[t]} on a dense or empty tensor")
    if (rice > info.max_rice).any():
        _fail_tensor(rice > info.max_rice,
                     lambda t: f"Rice parameter {rice[t]} exceeds {info.max_rice[t]} for size {sizes[t]}")

    wire = WIRE_DTYPES[code]
    n_dense, n_sparse = int(counts[dense].sum()), int(counts[sparse].sum())
    rem_len = (int((counts * rice).sum()) + 7) // 8
    expected = pos + (n_dense + n_sparse) * wire.itemsize + unary_len + rem_len
    if len(buf) < expected:
        raise CodecError(f"truncated delta: {len(buf)} bytes, expected {expected}")
    if len(buf) > expected:
        raise CodecError(f"{len(buf) - expected} trailing bytes after the delta ({expected} expected)")

    values = np.frombuffer(buf, wire, n_dense + n_sparse, pos)
    pos += values.nbytes
    unary = np.frombuffer(buf, np.uint8, unary_len, pos)
    rem = np.frombuffer(buf, np.uint8, rem_len, pos + unary_len)
    return Frame(info, counts, rice_u8, dense, sparse, values, n_dense, unary, rem)


def _sparse_indices_numpy(f: Frame) -> np.ndarray:
    """Decode and check the index stream with numpy (the reference); CodecError on any fault."""
    sizes, sparse, n_sparse = f.info.sizes, f.sparse, f.n_sparse
    sp_counts = f.counts[sparse]
    # unpackbits yields 0/1 bytes; flatnonzero is ~7× faster on a bool view.
    ones = np.flatnonzero(np.unpackbits(f.unary).view(bool))
    if ones.size != n_sparse:
        raise CodecError(f"index stream holds {ones.size} codes, expected {n_sparse}")
    if f.unary.size != (int(ones[-1]) // 8 + 1 if ones.size else 0):
        raise CodecError("index stream has trailing bytes after its last code")
    if not n_sparse:
        return np.zeros(0, np.int64)
    q = np.empty_like(ones)  # zeros before each one
    q[0] = ones[0]
    np.subtract(ones[1:], ones[:-1] + 1, out=q[1:])
    b = np.repeat(f.rice[sparse], sp_counts)  # uint8: a quarter of the traffic
    r = unpack_fields(f.rem, b, int(f.rice.max()))
    # Every gap is below the largest tensor, or some index is out of
    # range; checking that first keeps the shift and the cumulative sum
    # (<= n_sparse · 2**31) clear of int64 overflow on forged input.
    biggest = int(sizes[sparse].max())
    if int(q.max()) >= biggest:
        _raise_out_of_range(q, b, r, sp_counts, sparse, sizes)
    gaps = q << b
    gaps |= r
    if int(gaps.max()) >= biggest:
        _raise_out_of_range(q, b, r, sp_counts, sparse, sizes)
    gaps += 1
    cs = np.cumsum(gaps)
    last = np.cumsum(sp_counts) - 1  # last entry of each sparse tensor
    base = np.zeros(sp_counts.size, dtype=np.int64)  # cs before each tensor
    base[1:] = cs[last[:-1]]
    # Local indices increase within a tensor, so checking its last is enough.
    over = cs[last] - 1 - base >= sizes[sparse]
    if over.any():
        _raise_out_of_range(q, b, r, sp_counts, sparse, sizes)
    # global index = offset_t + local = cs - 1 - base_t + offset_t
    cs += np.repeat(f.info.offsets[:-1][sparse] - base - 1, sp_counts)
    return cs


def _sparse_indices(f: Frame, out: np.ndarray | None) -> np.ndarray:
    """The frame's global sparse indices (into ``out`` when given); CodecError on any fault."""
    if f.n_sparse and native.enabled():
        if out is None:
            out = np.empty(f.n_sparse, np.int64)
        sparse = f.sparse
        if native_codec.rice_indices(f.unary, f.rem, f.counts[sparse], f.rice[sparse].astype(np.int64),
                                     f.info.offsets[:-1][sparse], f.info.sizes[sparse], out):
            return out
    idx = _sparse_indices_numpy(f)  # the reference: raises, naming the fault
    if out is None:
        return idx
    out[:] = idx
    return out


def _frame_index(f: Frame, sparse_indices: np.ndarray, at: int) -> int:
    """Flat index of ``f.values[at]``: dense tensors' values first, then the sparse ones."""
    if at >= f.n_dense:
        return int(sparse_indices[at - f.n_dense])
    d_counts = f.counts[f.dense]
    k = int(np.searchsorted(np.cumsum(d_counts), at, side="right"))
    t = int(np.flatnonzero(f.dense)[k])
    return int(f.info.offsets[t]) + at - int(d_counts[:k].sum())


def decode_frame(f: Frame, index_out: np.ndarray | None = None) -> DecodedParts:
    """Decode a parsed frame (its sparse indices into ``index_out`` when given); CodecError on any fault."""
    idx = _sparse_indices(f, index_out)
    wire = "float16" if f.values.dtype.itemsize == 2 else "float32"
    check_values(f.values, f.info, lambda at: _frame_index(f, idx, at), wire)
    return DecodedParts(f.dense, f.values[:f.n_dense], idx, f.values[f.n_dense:], f.counts)


def decode_parts(data: bytes, layout: Layout) -> DecodedParts:
    """Parse and validate ``data`` against ``layout``; CodecError on any fault."""
    return decode_frame(parse(data, layout))


@lru_cache(maxsize=64)
def _dense_indices(layout: tuple, dense_mask: bytes) -> np.ndarray:
    """Global indices of the dense tensors, concatenated in tensor order."""
    info = layout_info(layout)
    dense = np.frombuffer(dense_mask, dtype=bool)
    sizes = info.sizes[dense]
    shift = np.repeat(info.offsets[:-1][dense] - segment_starts(sizes), sizes)
    out = np.arange(int(sizes.sum()), dtype=np.int64) + shift
    out.setflags(write=False)  # shared through the cache
    return out


def dense_indices(layout: Layout, dense: np.ndarray) -> np.ndarray:
    """Cached read-only global indices of the tensors flagged in ``dense``."""
    key = layout if isinstance(layout, tuple) else tuple(layout)
    return _dense_indices(key, np.asarray(dense, bool).tobytes())
