"""Compiled passes of a stream task's lookahead (worker/view.py), each one pass where numpy
makes two or three, bitwise the same (float32, each operation rounded, no FMA):

    velocity_step      vel = (w - prev)·s; prev = w (the lookahead's velocity)
    velocity_step_at   the same at changed indices only, zero where the view moved
    velocity_step_out_at  and the extrapolated weights there too (out = a·vel + w)
    axpy, axpy_at      out = a·x + y                (the lookahead's extrapolated weights)
"""

from __future__ import annotations

import numpy as np

from .native_compile import kernel, kernels


@kernel(nogil=True, boundscheck=False)
def k_velocity_step(w, prev, vel, s):
    """``vel = (w - prev) · s; prev = w`` in one pass (float32, each operation rounded)."""
    for i in range(w.size):
        vel[i] = (w[i] - prev[i]) * s
        prev[i] = w[i]


@kernel(nogil=False, boundscheck=False)
def k_velocity_step_at(w, prev, vel, s, moving, changed):
    """velocity_step where the view moved: ``vel[moving] = 0``, then at ``changed``
    ``vel = (w - prev) · s; prev = w`` (``changed`` may repeat an index: prev moves after)."""
    for j in range(moving.size):
        vel[moving[j]] = 0.0
    for j in range(changed.size):
        i = changed[j]
        vel[i] = (w[i] - prev[i]) * s
    for j in range(changed.size):
        prev[changed[j]] = w[changed[j]]


@kernel(nogil=False, boundscheck=False)
def k_velocity_step_out_at(w, prev, vel, s, moving, changed, a, out):
    """``k_velocity_step_at``, then ``out = a·vel + w`` at ``moving`` and ``changed`` (axpy_at's
    arithmetic): the extrapolated weights follow the velocity where it moved."""
    k_velocity_step_at(w, prev, vel, s, moving, changed)
    for j in range(moving.size):
        i = moving[j]
        out[i] = a * vel[i] + w[i]
    for j in range(changed.size):
        i = changed[j]
        out[i] = a * vel[i] + w[i]


@kernel(nogil=False, boundscheck=False)
def k_axpy_at(a, x, y, out, idx):
    """axpy at ``idx`` only."""
    for j in range(idx.size):
        i = idx[j]
        out[i] = a * x[i] + y[i]


@kernel(nogil=True, boundscheck=False)
def k_axpy(a, x, y, out):
    """``out = a·x + y`` in one pass (float32; the product rounded, then the sum: no FMA)."""
    for i in range(x.size):
        out[i] = a * x[i] + y[i]


def velocity_step(w: np.ndarray, prev: np.ndarray, vel: np.ndarray, s: float) -> None:
    """``vel = (w - prev) · s; prev[:] = w`` in place (float32 arrays), bitwise as numpy."""
    kernels().velocity_step(w, prev, vel, np.float32(s))


def axpy(a: float, x: np.ndarray, y: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out = float32(a) · x + y`` (float32 arrays), bitwise as numpy's multiply then add."""
    kernels().axpy(np.float32(a), x, y, out)
    return out


def velocity_step_at(w: np.ndarray, prev: np.ndarray, vel: np.ndarray, s: float, moving: np.ndarray,
                     changed: np.ndarray) -> None:
    """``vel[moving] = 0``, then ``velocity_step`` at the indices ``changed`` (int64) only."""
    kernels().velocity_step_at(w, prev, vel, np.float32(s), moving, changed)


def velocity_step_out_at(w: np.ndarray, prev: np.ndarray, vel: np.ndarray, s: float, moving: np.ndarray,
                         changed: np.ndarray, a: float, out: np.ndarray) -> None:
    """:func:`velocity_step_at`, and ``out = float32(a) · vel + w`` at ``moving`` and ``changed``."""
    kernels().velocity_step_out_at(w, prev, vel, np.float32(s), moving, changed, np.float32(a), out)


def axpy_at(a: float, x: np.ndarray, y: np.ndarray, out: np.ndarray, idx: np.ndarray) -> None:
    """``out[idx] = float32(a) · x[idx] + y[idx]``, bitwise as numpy's."""
    kernels().axpy_at(np.float32(a), x, y, out, idx)
