"""Compiled loops for the hot paths, by concern:

    native_codec.py    Rice index coding both ways, float16 rounding, whole payloads (codec.py)
    native_step.py     the worker's per-step passes: momentum, threshold
    native_look.py     the stream task's lookahead: velocity, extrapolation
    native_server.py   the blocked weighted add, the support of the parameter server's residual,
                       a downlink's apply with its checksum change, the candidate downlink

This module is their switch: :func:`enabled`. Their compile (how a kernel
is marked, when it is built, how numba caches it) is native_compile.py's.
Importing this module, or any of the four, imports nothing heavy. Where
numba is missing, or ``SPARKCNN_NATIVE=0``,
``enabled()`` is False and the codec, sparse_sum and the other callers keep
their numpy paths, which are the reference: both paths give bitwise equal results
(tests/test_codec.py), and on bad input the compiled decoder only reports
*that* something is wrong, the numpy decoder then says what.

Why compiled: numpy needs ~10 passes over each index stream (unpack the bits,
find the ones, gather the remainders, cumulative sums, bound checks), and its
scattered add touches a new page per entry at density 0.001. One pass over
the bits, then an add that walks the output in cache-sized chunks (every
payload's entries in the chunk, payload by payload), make the driver's
whole apply of 256 × 25 M-parameter deltas 0.18 s against 0.27 s on the
numpy path on a 2-vCPU VM (bench/scale.py reports both side by side).

The GIL: a kernel marked ``nogil`` gives it up for its run and must take it back,
which waits while another thread runs Python. Passes over the whole model
(the momentum step, the blocked add, the residual's support) keep ``nogil``: the
other threads progress meanwhile. The short ones a stream step calls between its
TensorFlow calls (a payload's encode and decode, a downlink's apply, the
lookahead's sparse passes) keep the GIL: each hand-over cost the step a wait
for the push thread, and its futex round trip cost CPU. Measured by
bench/throughput.py on 2 cores, medians of 5, before and after: the worker's
CPU outside TensorFlow at one step per exchange fell from 1.49 to 1.31 ms per
step (on a machine 3 % faster in the second run).

No fast-math: ``acc[i] += w * v`` rounds the product and the sum separately
(no fused multiply-add), as numpy does, which the bitwise tests check.
"""

from __future__ import annotations

import os

# The kernel modules are imported here, not where a kernel is first used, so that every
# kernel is marked before native_compile builds them all at once (the first enabled() call);
# worker/view.py calls the lookahead's passes as native.<name>.
from . import native_codec, native_server, native_step  # noqa: F401
from .native_compile import kernels
from .native_look import axpy, axpy_at, velocity_step, velocity_step_at, velocity_step_out_at  # noqa: F401


def enabled() -> bool:
    """True when the compiled kernels are in use (numba importable, ``SPARKCNN_NATIVE`` not 0)."""
    if os.environ.get("SPARKCNN_NATIVE", "1") == "0":
        return False
    return bool(kernels())
