"""The compile of the compiled kernels: how a kernel is marked, and when it is built.

The kernels are plain module-level functions of native_codec.py, native_step.py,
native_look.py and native_server.py, marked with :func:`kernel`; the first :func:`kernels` call
imports numba and puts a compiled dispatcher in place of each, so a kernel
calls another by its module-level name. numba compiles each on first use and
caches it on disk: a module-level kernel has no closure, so its cache key (its
bytecode) is the same in every process and later processes load it. (Kernels
built as closures were keyed on their captured dispatchers, which differ per
process: every process compiled them again, seconds per process, and added a
cache file each time.) numba checks a cached kernel against its own file only:
a kernel that calls one of another file is recompiled when that file changes
only if its own file changes too (an installed package changes both).

Every kernel is marked before the first compile: native.py, the switch every
caller asks first (``native.enabled()``), imports the four kernel modules, and
importing the package imports native.py. This module imports only the standard
library; the kernel modules import it, never the other way round.
"""

from __future__ import annotations

import sys
import threading
from types import SimpleNamespace

OK, FAULT = 0, 1  # a kernel's status: the input was consistent, or it was refused

_lock = threading.Lock()
_kernels = None  # every compiled kernel by name (see _compile) once compiled, False when unavailable
_marked: list[tuple[object, dict]] = []  # (module-level function, numba options), as marked


def kernel(**options):
    """Mark a module-level function as a compiled kernel (``numba.njit(**options)``, cached)."""
    def mark(fn):
        _marked.append((fn, options))
        return fn
    return mark


def _compile(cache: bool) -> SimpleNamespace:
    # One namespace for the kernel modules' kernels: one switch, one fallback when numba is
    # missing. Each marked function is replaced by its dispatcher wherever a kernel module
    # holds it (native_server holds the codec's float16 rounding too); numba resolves a
    # kernel's callees from its module's globals when it compiles it, at its first call.
    import numba

    jitted = {fn: numba.njit(cache=cache, **options)(fn) for fn, options in _marked}
    modules = {sys.modules[fn.__module__] for fn, _ in _marked}  # the modules that mark kernels
    for module in modules:
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
