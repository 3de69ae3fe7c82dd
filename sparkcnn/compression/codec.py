"""Wire format of a sparse delta: one bytes object per block and round.

Layout (little-endian; T tensors, per-tensor fields are columns)::

    header   magic b"SKCD" | version u8 = 1 | value dtype u8 (1 float16, 2 float32)
             | reserved u16 = 0 | T u32 | unary_len u32                  16 bytes
    table    count u32[T]                 entries sent of each tensor
             rice  u8[T]                  Rice parameter b_t (0 unless sparse)
    values   dense tensors' values, then sparse tensors' values, tensor order
    unary    unary_len bytes: for each sparse entry, q = gap >> b_t as q zero
             bits then a one bit (MSB first, zero-padded)
    rice     for each sparse entry, r = gap & (2**b_t - 1) in b_t bits (MSB first)

A tensor is **dense** when ``count == size`` (no indices: ``values`` are the
whole tensor), **empty** when ``count == 0``, else **sparse**, with local
indices coded as gaps ``gap_0 = i_0``, ``gap_j = i_j - i_{j-1} - 1``.

Why Golomb–Rice: gaps of a uniformly random support are ~geometric, for which
the best Rice code is within ~0.1 bit of the entropy ``≈ log2(e / density)``:
~8.1 bits at density 0.01 and ~11.4 bits at 0.001, against 16 for a 2-byte varint.
With float16 values that is ~3.0 and ~3.4 bytes per non-zero (floor ~3).
The columnar layout (all counts, then all values, then the bit streams)
lets both directions run as a fixed number of numpy calls per delta,
whatever the tensor count: no Python loop over entries or tensors. With
the compiled kernels each direction is one call (``native.encode_delta``,
``native.decode_delta``), bitwise the same: at one step per exchange a
delta is coded four times per step, and the numpy calls' glue cost ~0.2 ms
each time in a worker between TF steps (measured, fmnist_cnn: 0.6 ms).

Limits: each tensor and the whole model below 2**31 entries.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..errors import CodecError
from . import native
from .delta import Layout, SparseDelta, layout_offsets

MAGIC = b"SKCD"
VERSION = 1
_HEADER = struct.Struct("<4sBBHII")
_DTYPES = {1: np.dtype("<f2"), 2: np.dtype("<f4")}
_DTYPE_CODES = {"float16": 1, "float32": 2}
VALUE_DTYPES = tuple(_DTYPE_CODES)  # wire dtypes of the values, by name
FLOAT16_MAX = float(np.finfo(np.float16).max)  # 65504: the largest finite float16 value
# per wire dtype code: the largest magnitude bits (float32) a value may have to be sent
_LIMIT_BITS = {1: int(np.array(FLOAT16_MAX, np.float32).view(np.uint32)), 2: 0x7F7FFFFF}
MAX_ENTRIES = 2**31 - 1  # per model; keeps every cumulative sum far from int64 overflow


@dataclass(frozen=True)
class _LayoutInfo:
    offsets: np.ndarray  # int64, T + 1
    sizes: np.ndarray  # int64, T
    max_rice: np.ndarray  # int64, T: bit length of the largest gap, size - 1


@lru_cache(maxsize=64)
def _layout_info(layout: tuple) -> _LayoutInfo:
    try:
        offsets = layout_offsets(tuple(int(n) for n in layout))
    except ValueError as e:
        raise CodecError(str(e)) from None
    if offsets[-1] > MAX_ENTRIES:
        raise CodecError(f"layout has {int(offsets[-1])} entries, the codec handles up to {MAX_ENTRIES}")
    sizes = np.diff(offsets)
    max_rice = np.array([max(int(n) - 1, 0).bit_length() for n in sizes], dtype=np.int64)
    for arr in (offsets, sizes, max_rice):
        arr.setflags(write=False)  # shared through the cache
    return _LayoutInfo(offsets, sizes, max_rice)


def _info(layout: Layout) -> _LayoutInfo:
    # A tuple hashes straight into the cache (~3 µs for ResNet-50's 267
    # tensors); converting each int first would cost ~50 µs per delta.
    return _layout_info(layout if isinstance(layout, tuple) else tuple(layout))


def _segment_starts(counts: np.ndarray) -> np.ndarray:
    """First entry position of each segment of the given lengths."""
    starts = np.zeros(counts.size, dtype=np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    return starts


def _rice_start(gap_sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Per segment, ``floor(log2(mean gap · ln 2))`` (at least 0): the Rice parameter of a
    geometric gap distribution, around which the exact bit counts are compared."""
    mean = gap_sums / counts
    return np.floor(np.log2(np.maximum(mean * np.log(2), 1.0))).astype(np.int64)


def _rice_parameters(gaps: np.ndarray, counts: np.ndarray, max_rice: np.ndarray) -> np.ndarray:
    """Per segment, the b minimising ``count·(1 + b) + Σ (gap >> b)`` near log2(mean·ln 2)."""
    starts = _segment_starts(counts)
    b0 = _rice_start(np.add.reduceat(gaps.astype(np.float64), starts), counts)
    best_b, best_bits = None, None
    for shift in (-1, 0, 1):
        b = np.clip(b0 + shift, 0, max_rice)
        bits = counts * (1 + b) + np.add.reduceat(gaps >> np.repeat(b, counts), starts)
        if best_b is None:
            best_b, best_bits = b, bits
        else:
            better = bits < best_bits
            best_b, best_bits = np.where(better, b, best_b), np.minimum(bits, best_bits)
    return best_b


def _pack_fields(values: np.ndarray, widths: np.ndarray) -> bytes:
    """Concatenate ``values[i]`` as ``widths[i]``-bit big-endian fields."""
    total = int(widths.sum())
    if total == 0:
        return b""
    owner = np.repeat(np.arange(values.size), widths)
    pos_in_field = np.arange(total) - np.repeat(_segment_starts(widths), widths)
    bits = (values[owner] >> (widths[owner] - 1 - pos_in_field)) & 1
    return np.packbits(bits.astype(np.uint8)).tobytes()


def _unpack_fields(stream: np.ndarray, widths: np.ndarray, max_width: int) -> np.ndarray:
    """Inverse of _pack_fields (uint32 or int64 values): one window per field.

    The windows are a stride-1 big-endian view of the zero-padded stream, so
    a field costs one gather and two shifts. 32-bit words (twice the numpy
    throughput of 64-bit) hold any field of <= 25 bits at any bit offset.
    """
    if widths.size == 0:
        return np.zeros(0, np.int64)
    bits32 = max_width <= 25 and stream.size < 2**28  # field offsets fit uint32
    dtype, word_bits = (np.uint32, 32) if bits32 else (np.uint64, 64)
    padded = np.zeros(stream.size + word_bits // 8, dtype=np.uint8)
    padded[: stream.size] = stream
    windows = np.ndarray((stream.size + 1,), dtype=f">u{word_bits // 8}", buffer=padded, strides=(1,))
    w = widths.astype(dtype)
    bit = np.cumsum(w, dtype=dtype)
    bit -= w  # first bit of each field
    word = windows.take(bit >> 3).astype(dtype)  # native byte order
    word <<= bit & 7  # drop the bits of earlier fields
    word >>= word_bits - w  # keep this field's bits
    return word if bits32 else word.view(np.int64)  # int64 |= uint64 has no common type


def encode(delta: SparseDelta, layout: Layout, *, value_dtype: str = "float16",
           unchecked_values: bool = False) -> bytes:
    """Serialize ``delta`` (global indices over ``layout``) to bytes.

    Raises CodecError for a delta that does not fit the layout, has
    unsorted or out-of-range indices, or values that are non-finite or
    (float16) beyond ±65504. ``unchecked_values`` skips the value check: fault
    injection only (a NaN delta the receiving side must reject).
    """
    if value_dtype not in _DTYPE_CODES:
        raise CodecError(f"value_dtype must be one of {tuple(_DTYPE_CODES)}, got {value_dtype!r}")
    info = _info(layout)
    if delta.size != info.offsets[-1]:
        raise CodecError(f"delta size {delta.size} does not match layout total {int(info.offsets[-1])}")
    if native.enabled() and not unchecked_values:  # one compiled pass, checks included
        code = _DTYPE_CODES[value_dtype]
        data = native.encode_delta(np.ascontiguousarray(delta.indices), np.ascontiguousarray(delta.values),
                                   info.offsets, info.max_rice, code, _LIMIT_BITS[code])
        if data is not None:
            return data  # refused: the numpy path below names the fault
    try:
        delta.validate()
    except ValueError as e:
        raise CodecError(f"delta: {e}") from None
    idx, vals = delta.indices, delta.values
    if not unchecked_values:
        _check_values(vals, info, lambda at: idx[at], value_dtype,
                      FLOAT16_MAX if value_dtype == "float16" else None)

    bounds = np.searchsorted(idx, info.offsets)
    counts = np.diff(bounds)
    dense = counts == info.sizes
    sparse = (counts > 0) & ~dense
    wire = _DTYPES[_DTYPE_CODES[value_dtype]]
    rice, values, unary, rem = _encode_numpy(idx, vals, counts, sparse, info)
    header = _HEADER.pack(MAGIC, VERSION, _DTYPE_CODES[value_dtype], 0, counts.size, len(unary))
    return b"".join(
        (header, counts.astype("<u4").tobytes(), rice.astype(np.uint8).tobytes(),
         values.astype(wire).tobytes(), unary, rem)
    )


def _encode_numpy(idx, vals, counts, sparse, info: _LayoutInfo):
    """(rice, values in wire order, unary, rem): the reference encoder (native.encode_delta
    writes the same bytes in one compiled pass)."""
    entry_sparse = np.repeat(sparse, counts)
    rice = np.zeros(counts.size, dtype=np.int64)
    unary = rem = b""
    if sparse.any():
        sp_counts = counts[sparse]
        local = idx[entry_sparse] - np.repeat(info.offsets[:-1][sparse], sp_counts)
        gaps = np.empty_like(local)
        gaps[0] = local[0]
        gaps[1:] = local[1:] - local[:-1] - 1
        starts = _segment_starts(sp_counts)
        gaps[starts] = local[starts]  # each tensor restarts from local index -1
        rice[sparse] = _rice_parameters(gaps, sp_counts, info.max_rice[sparse])
        b = np.repeat(rice[sparse], sp_counts)
        q = gaps >> b
        ones = np.cumsum(q + 1) - 1  # q zeros then a one
        bits = np.zeros(int(ones[-1]) + 1, dtype=np.uint8)
        bits[ones] = 1
        unary = np.packbits(bits).tobytes()
        rem = _pack_fields(gaps & ((np.int64(1) << b) - 1), b)
    return rice, np.concatenate([vals[~entry_sparse], vals[entry_sparse]]), unary, rem


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


# Per float width: the unsigned type of its bits, the mask of everything but
# the sign, and the bits of the largest finite value. Without the sign, a
# float's bits order like its magnitude, with inf and NaN above every finite value.
_MAGNITUDE_BITS = {2: (np.uint16, 0x7FFF, 0x7BFF), 4: (np.uint32, 0x7FFFFFFF, 0x7F7FFFFF)}


def _first_unfit(values: np.ndarray, limit: float | None = None) -> int | None:
    """Position of the first value that is not finite (or beyond ±``limit``); None when all fit.

    From the bits, in one pass: ~25× faster than np.isfinite on float16.
    """
    if not values.size:
        return None
    uint, magnitude, top = _MAGNITUDE_BITS[values.dtype.itemsize]
    if limit is not None:
        top = int(np.array(limit, values.dtype).view(uint))
    bits = np.bitwise_and(values.view(uint), uint(magnitude))
    if int(bits.max()) <= top:
        return None
    return int(np.flatnonzero(bits > top)[0])


def _check_values(values: np.ndarray, info: _LayoutInfo, global_index, value_dtype: str,
                  limit: float | None = None) -> None:
    """CodecError naming the first value that is not finite (or beyond ±``limit``).

    The one value check of the codec, on both sides of the wire: the encoder
    refuses what it cannot carry, the decoder what arrived broken, so the
    weights never see a non-finite delta. ``global_index(at)`` is the flat
    index of ``values[at]``.
    """
    at = _first_unfit(values, limit)
    if at is None:
        return
    i = int(global_index(at))
    t = int(np.searchsorted(info.offsets, i, side="right")) - 1
    raise CodecError(f"delta tensor {t}: value {values[at]} at index {i - int(info.offsets[t])} "
                     f"is not a finite {value_dtype}")


_F16_SIGN_EXP_MANT = np.uint32(0x8FFFE000).view(np.int32)  # sign | 5-bit exponent | mantissa
_F16_BIAS_SHIFT = 2.0**112  # 2 ** (127 - 15): float32 minus float16 exponent bias


def wire_to_float32(values: np.ndarray, scale: float = 1.0, *, out: np.ndarray | None = None) -> np.ndarray:
    """``scale · float32(values)`` for finite wire values, into ``out`` or a new array.

    float16: the sign-extended bits shifted into a float32's place give
    ``x · 2**-112`` exactly (subnormals included); one multiply by
    ``scale · 2**112`` then rounds ``scale · x`` once, bitwise like
    ``np.float32(scale) * values.astype(np.float32)``, in 3 passes where
    numpy's float16 cast costs ~10× more.
    """
    scale = np.float32(scale)
    if out is None:
        out = np.empty(values.shape, np.float32)
    if values.dtype.itemsize == 4:
        return np.multiply(values, scale, out=out)
    bits = out.view(np.int32)
    np.left_shift(values.view(np.int16), 13, out=bits, dtype=np.int32)
    np.bitwise_and(bits, _F16_SIGN_EXP_MANT, out=bits)
    if abs(scale) < 2.0**15:  # scale · 2**112 stays finite and exact
        out *= np.float32(_F16_BIAS_SHIFT) * scale
    else:
        out *= np.float32(_F16_BIAS_SHIFT)
        out *= scale
    return out


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
class _Frame:
    """A payload whose header, table and lengths are checked; index stream not yet decoded."""

    info: _LayoutInfo
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


def _parse(data: bytes, layout: Layout) -> _Frame:
    """Check everything but the index stream and the values; CodecError on any fault."""
    info = _info(layout)
    buf = memoryview(data)
    if len(buf) < _HEADER.size:
        raise CodecError(f"truncated header: {len(buf)} bytes, need {_HEADER.size}")
    magic, version, code, reserved, ntensors, unary_len = _HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise CodecError(f"bad magic {magic!r}, expected {MAGIC!r} (not a sparkcnn delta)")
    if version != VERSION:
        raise CodecError(f"unsupported format version {version} (this build reads {VERSION})")
    if code not in _DTYPES:
        raise CodecError(f"unknown value dtype code {code}")
    if reserved:
        raise CodecError(f"reserved header field is {reserved}, expected 0")
    if ntensors != info.sizes.size:
        raise CodecError(f"tensor count {ntensors} does not match layout of {info.sizes.size} tensors")
    pos = _HEADER.size
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

    wire = _DTYPES[code]
    n_dense, n_sparse = int(counts[dense].sum()), int(counts[sparse].sum())
    rem_len = (int((counts * rice).sum()) + 7) // 8
    expected = pos + (n_dense + n_sparse) * wire.itemsize + unary_len + rem_len
    if len(buf) < expected:
        raise CodecError(f"truncated delta: {len(buf)} bytes, expected {expected}")
    if len(buf) > expected:
        raise CodecError(f"{len(buf) - expected} trailing bytes after the delta ({expected} expected)")

    values = np.frombuffer(buf, wire, n_dense + n_sparse, pos)
    pos += values.nbytes
    return _Frame(info, counts, rice_u8, dense, sparse, values, n_dense,
                  np.frombuffer(buf, np.uint8, unary_len, pos), np.frombuffer(buf, np.uint8, rem_len, pos + unary_len))


def _sparse_indices_numpy(f: _Frame) -> np.ndarray:
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
    r = _unpack_fields(f.rem, b, int(f.rice.max()))
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


def _sparse_indices(f: _Frame, out: np.ndarray | None) -> np.ndarray:
    """The frame's global sparse indices (into ``out`` when given); CodecError on any fault."""
    if f.n_sparse and native.enabled():
        if out is None:
            out = np.empty(f.n_sparse, np.int64)
        sparse = f.sparse
        if native.rice_indices(f.unary, f.rem, f.counts[sparse], f.rice[sparse].astype(np.int64),
                               f.info.offsets[:-1][sparse], f.info.sizes[sparse], out):
            return out
    idx = _sparse_indices_numpy(f)  # the reference: raises, naming the fault
    if out is None:
        return idx
    out[:] = idx
    return out


def _frame_index(f: _Frame, sparse_indices: np.ndarray, at: int) -> int:
    """Flat index of ``f.values[at]``: dense tensors' values first, then the sparse ones."""
    if at >= f.n_dense:
        return int(sparse_indices[at - f.n_dense])
    d_counts = f.counts[f.dense]
    k = int(np.searchsorted(np.cumsum(d_counts), at, side="right"))
    t = int(np.flatnonzero(f.dense)[k])
    return int(f.info.offsets[t]) + at - int(d_counts[:k].sum())


def _decode_frame(f: _Frame, index_out: np.ndarray | None = None) -> DecodedParts:
    """Decode a parsed frame (its sparse indices into ``index_out`` when given); CodecError on any fault."""
    idx = _sparse_indices(f, index_out)
    wire = "float16" if f.values.dtype.itemsize == 2 else "float32"
    _check_values(f.values, f.info, lambda at: _frame_index(f, idx, at), wire)
    return DecodedParts(f.dense, f.values[:f.n_dense], idx, f.values[f.n_dense:], f.counts)


def decode_parts(data: bytes, layout: Layout) -> DecodedParts:
    """Parse and validate ``data`` against ``layout``; CodecError on any fault."""
    return _decode_frame(_parse(data, layout))


@lru_cache(maxsize=64)
def _dense_indices(layout: tuple, dense_mask: bytes) -> np.ndarray:
    """Global indices of the dense tensors, concatenated in tensor order."""
    info = _layout_info(layout)
    dense = np.frombuffer(dense_mask, dtype=bool)
    sizes = info.sizes[dense]
    shift = np.repeat(info.offsets[:-1][dense] - _segment_starts(sizes), sizes)
    out = np.arange(int(sizes.sum()), dtype=np.int64) + shift
    out.setflags(write=False)  # shared through the cache
    return out


def dense_indices(layout: Layout, dense: np.ndarray) -> np.ndarray:
    """Cached read-only global indices of the tensors flagged in ``dense``."""
    key = layout if isinstance(layout, tuple) else tuple(layout)
    return _dense_indices(key, np.asarray(dense, bool).tobytes())


def decode(data: bytes, layout: Layout) -> SparseDelta:
    """Parse ``data``: a validated SparseDelta with float32 values."""
    if native.enabled():  # one compiled pass; refused: the numpy path below names the fault
        info = _info(layout)
        got = native.decode_delta(data, info.offsets, info.max_rice)
        if got is not None:
            return SparseDelta(int(info.offsets[-1]), *got)
    p = decode_parts(data, layout)
    size = int(_info(layout).offsets[-1])
    d_idx = dense_indices(layout, p.dense)
    d_val, s_val = wire_to_float32(p.dense_values), wire_to_float32(p.sparse_values)
    if not p.sparse_indices.size:
        return SparseDelta(size, d_idx.copy(), d_val)
    if not d_idx.size:
        return SparseDelta(size, p.sparse_indices, s_val)
    # Interleave dense and sparse tensors back into tensor order: every
    # tensor's entries move by (its start in the output - its start in its part).
    out_start = _segment_starts(p.counts)
    idx = np.empty(d_idx.size + p.sparse_indices.size, np.int64)
    val = np.empty(idx.size, np.float32)
    for mask, src_idx, src_val in ((p.dense, d_idx, d_val), (~p.dense, p.sparse_indices, s_val)):
        c = p.counts[mask]
        dest = np.arange(src_idx.size) + np.repeat(out_start[mask] - _segment_starts(c), c)
        idx[dest] = src_idx
        val[dest] = src_val
    return SparseDelta(size, idx, val)
