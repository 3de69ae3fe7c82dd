"""Arrays TensorFlow can read in place.

TensorFlow's CPU kernels need their inputs aligned to 64 bytes; numpy's large
allocations are not (malloc's mmap leaves them 16 bytes past a page). A
tensor made with ``tf.constant`` therefore copies its array first: at one
step per exchange that is the weights (0.9 MB for fmnist_cnn) and the batch
on every step. An array from :func:`aligned_empty` is handed over without a
copy by :func:`as_tensor` (DLPack), which copies whatever does not qualify.
"""

from __future__ import annotations

import numpy as np

ALIGN = 64  # bytes: TensorFlow's EIGEN_MAX_ALIGN_BYTES on AVX-512 builds, the largest there is


def aligned_empty(shape, dtype=np.float32) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on an ``ALIGN``-byte boundary."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(n + ALIGN, np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    return raw[start:start + n].view(dtype).reshape(shape)


def aligned_copy(a: np.ndarray, dtype=np.float32) -> np.ndarray:
    """``a`` as a new aligned C-contiguous array of ``dtype``."""
    out = aligned_empty(np.shape(a), dtype)
    np.copyto(out, a, casting="unsafe")  # as np.array(a, dtype) converts
    return out


def shareable(a: np.ndarray) -> bool:
    """Whether TensorFlow may read ``a`` in place: aligned, C-contiguous, writeable (DLPack
    exports no read-only array), native byte order."""
    return (a.flags.c_contiguous and a.flags.writeable and a.dtype.isnative
            and a.ctypes.data % ALIGN == 0 and a.size > 0)


def as_tensor(tf, a: np.ndarray):
    """A tensor of ``a``: sharing its memory when :func:`shareable`, else a copy. The caller
    must not write ``a`` while the tensor is in use (a synchronous TF call is)."""
    if shareable(a):
        return tf.experimental.dlpack.from_dlpack(a.__dlpack__())
    return tf.constant(a)
