"""The values of a payload: the codec's one value check (finite, and within ±65504 as
float16), which both of its directions make, and the wire values read back as float32 at
a scale, which the decoder and sparse_sum's sums use.
"""

from __future__ import annotations

import numpy as np

from ..errors import CodecError
from .codec_format import LayoutInfo

# Per float width: the unsigned type of its bits, the mask of everything but
# the sign, and the bits of the largest finite value. Without the sign, a
# float's bits order like its magnitude, with inf and NaN above every finite value.
_MAGNITUDE_BITS = {2: (np.uint16, 0x7FFF, 0x7BFF), 4: (np.uint32, 0x7FFFFFFF, 0x7F7FFFFF)}


def first_unfit(values: np.ndarray, limit: float | None = None) -> int | None:
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


def check_values(values: np.ndarray, info: LayoutInfo, global_index, value_dtype: str,
                 limit: float | None = None) -> None:
    """CodecError naming the first value that is not finite (or beyond ±``limit``).

    The one value check of the codec, on both sides of the wire: the encoder
    refuses what it cannot carry, the decoder what arrived broken, so the
    weights never see a non-finite delta. ``global_index(at)`` is the flat
    index of ``values[at]``.
    """
    at = first_unfit(values, limit)
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
