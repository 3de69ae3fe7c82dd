"""Compiled loops for the hot paths, by concern:

    native_codec.py    Rice index coding both ways, float16 rounding, whole payloads (codec.py)
    native_step.py     the worker's per-step passes: momentum, threshold, extrapolation
    native_server.py   the blocked weighted add, the support of the parameter server's residual,
                       a downlink's apply with its checksum change, the candidate downlink

This module is their switch and their compile. The kernels are plain
module-level functions marked with :func:`kernel`; the first :func:`kernels`
call imports numba and puts a compiled dispatcher in place of each, so a
kernel calls another by its module-level name. numba compiles each on first
use and caches it on disk: a module-level kernel has no closure, so its cache
key (its bytecode) is the same in every process and later processes load it.
(Kernels built as closures were keyed on their captured dispatchers, which
differ per process: every process compiled them again, seconds per process,
and added a cache file each time.) numba checks a cached kernel against its
own file only: a kernel that calls one of another file is recompiled when
that file changes only if its own file changes too (an installed package
changes both). Importing this module, or any of the three, imports nothing
heavy. Where numba is missing, or ``SPARKCNN_NATIVE=0``,
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
import threading
from types import SimpleNamespace

_lock = threading.Lock()
_kernels = None  # every compiled kernel by name (see _compile) once compiled, False when unavailable

OK, FAULT = 0, 1


_marked: list[tuple[object, dict]] = []  # (module-level function, numba options), as marked


def kernel(**options):
    """Mark a module-level function as a compiled kernel (``numba.njit(**options)``, cached)."""
    def mark(fn):
        _marked.append((fn, options))
        return fn
    return mark


def _compile(cache: bool) -> SimpleNamespace:
    # One namespace for the three modules' kernels: one switch, one fallback when numba is
    # missing. Each marked function is replaced by its dispatcher wherever a kernel module
    # holds it (native_server holds the codec's float16 rounding too); numba resolves a
    # kernel's callees from its module's globals when it compiles it, at its first call.
    import numba

    from . import native_codec, native_server, native_step

    jitted = {fn: numba.njit(cache=cache, **options)(fn) for fn, options in _marked}
    for module in (native_codec, native_server, native_step):
        for name, value in list(vars(module).items()):
            if callable(value) and getattr(value, "py_func", value) in jitted:  # a kernel, or its dispatcher
                setattr(module, name, jitted[getattr(value, "py_func", value)])
    return SimpleNamespace(**{fn.__name__.removeprefix("k_"): d for fn, d in jitted.items()})


def kernels() -> SimpleNamespace | bool:
    """The compiled kernels by name, built on the first call; False when numba is missing."""
    global _kernels
    if _kernels is None:
        with _lock:
            if _kernels is None:
                try:
                    try:
                        _kernels = _compile(cache=True)
                    except RuntimeError:  # no writable cache directory: compile each run
                        _kernels = _compile(cache=False)
                except ImportError:
                    _kernels = False
    return _kernels


def enabled() -> bool:
    """True when the compiled kernels are in use (numba importable, ``SPARKCNN_NATIVE`` not 0)."""
    if os.environ.get("SPARKCNN_NATIVE", "1") == "0":
        return False
    return bool(kernels())


_STEP_NAMES = frozenset({"velocity_step", "velocity_step_at", "velocity_step_out_at", "axpy", "axpy_at"})


def __getattr__(name: str):
    # worker/stream.py calls the lookahead's passes as native.<name>; they are
    # native_step's, which imports this module, so they are looked up on use.
    if name in _STEP_NAMES:
        from . import native_step

        return getattr(native_step, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
