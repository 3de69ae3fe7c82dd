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

Limits: each tensor and the whole model below 2**31 entries.

This module holds the format's constants, a layout's per-tensor facts, the
choice of each tensor's Rice parameter and the packing of bit fields. The
codec's two directions are codec.py's; codec_frame.py reads a payload's frame
and index stream, codec_values.py checks its values.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..errors import CodecError
from .delta import Layout, layout_offsets

MAGIC = b"SKCD"
VERSION = 1
HEADER = struct.Struct("<4sBBHII")
WIRE_DTYPES = {1: np.dtype("<f2"), 2: np.dtype("<f4")}  # by value dtype code
DTYPE_CODES = {"float16": 1, "float32": 2}
VALUE_DTYPES = tuple(DTYPE_CODES)  # wire dtypes of the values, by name
FLOAT16_MAX = float(np.finfo(np.float16).max)  # 65504: the largest finite float16 value
# per wire dtype code: the largest magnitude bits (float32) a value may have to be sent
LIMIT_BITS = {1: int(np.array(FLOAT16_MAX, np.float32).view(np.uint32)), 2: 0x7F7FFFFF}
MAX_ENTRIES = 2**31 - 1  # per model; keeps every cumulative sum far from int64 overflow


@dataclass(frozen=True)
class LayoutInfo:
    """What the codec needs of a layout, per tensor."""

    offsets: np.ndarray  # int64, T + 1
    sizes: np.ndarray  # int64, T
    max_rice: np.ndarray  # int64, T: bit length of the largest gap, size - 1


@lru_cache(maxsize=64)
def _layout_info(layout: tuple) -> LayoutInfo:
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
    return LayoutInfo(offsets, sizes, max_rice)


def layout_info(layout: Layout) -> LayoutInfo:
    """Offsets, sizes and largest Rice parameters of ``layout`` (cached, read-only); CodecError
    for a layout the codec cannot carry."""
    # A tuple hashes straight into the cache (~3 µs for ResNet-50's 267
    # tensors); converting each int first would cost ~50 µs per delta.
    return _layout_info(layout if isinstance(layout, tuple) else tuple(layout))


def segment_starts(counts: np.ndarray) -> np.ndarray:
    """First entry position of each segment of the given lengths."""
    starts = np.zeros(counts.size, dtype=np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    return starts


def _rice_start(gap_sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Per segment, ``floor(log2(mean gap · ln 2))`` (at least 0): the Rice parameter of a
    geometric gap distribution, around which the exact bit counts are compared."""
    mean = gap_sums / counts
    return np.floor(np.log2(np.maximum(mean * np.log(2), 1.0))).astype(np.int64)


def rice_parameters(gaps: np.ndarray, counts: np.ndarray, max_rice: np.ndarray) -> np.ndarray:
    """Per segment, the b minimising ``count·(1 + b) + Σ (gap >> b)`` near log2(mean·ln 2)."""
    starts = segment_starts(counts)
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


def pack_fields(values: np.ndarray, widths: np.ndarray) -> bytes:
    """Concatenate ``values[i]`` as ``widths[i]``-bit big-endian fields."""
    total = int(widths.sum())
    if total == 0:
        return b""
    owner = np.repeat(np.arange(values.size), widths)
    pos_in_field = np.arange(total) - np.repeat(segment_starts(widths), widths)
    bits = (values[owner] >> (widths[owner] - 1 - pos_in_field)) & 1
    return np.packbits(bits.astype(np.uint8)).tobytes()


def unpack_fields(stream: np.ndarray, widths: np.ndarray, max_width: int) -> np.ndarray:
    """Inverse of pack_fields (uint32 or int64 values): one window per field.

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
