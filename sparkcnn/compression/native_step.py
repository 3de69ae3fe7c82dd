"""Compiled per-step passes of a worker: momentum, threshold, lookahead extrapolation.

Each is one pass over the model where numpy makes two or three, with its
temporaries, bitwise the same (float32, each operation rounded, no FMA):

    momentum_step_to   u' = m·u + g; v' = v + u'     (DGC's momentum correction, out of place; feedback.py)
    abs_at_least       {i : |x[i]| >= thr}          (threshold selection; sparsify.py)
    velocity_step      vel = (w - prev)·s; prev = w (the lookahead's velocity; worker/stream.py)
    velocity_step_at   the same at changed indices only, zero where the view moved
    axpy, axpy_at      out = a·x + y                (the lookahead's extrapolated weights)
"""

from __future__ import annotations

import numpy as np

from .native import kernel, kernels


@kernel(nogil=True, boundscheck=False)
def k_momentum_step_to(u, v, g, m, u_out, v_out):
    """``u_out = m·u + g; v_out = v + u_out`` in one pass, rounding the product, then each sum,
    in float32 as numpy's three passes do."""
    for i in range(u.size):
        ui = u[i] * m
        ui = ui + g[i]
        u_out[i] = ui
        v_out[i] = v[i] + ui


@kernel(nogil=True, boundscheck=False)
def k_abs_at_least(x, thr, out):
    """Every i with ``|x[i]| >= thr``, ascending, into ``out``; returns how many.

    Hits are rare (density <= a few %), so each block of 64 entries is first tested as a whole,
    by a branch-free OR that the compiler vectorises, and only a block with a hit is walked:
    5.8x faster than walking every entry at density 0.001 (205 k entries: 15 against 84 us),
    no slower at 0.1."""
    c = 0
    n = x.size
    blocks = n // 64
    for b in range(blocks):
        base = b * 64
        hit = False
        for j in range(64):
            hit |= abs(x[base + j]) >= thr
        if hit:
            for j in range(64):
                if abs(x[base + j]) >= thr:
                    out[c] = base + j
                    c += 1
    for i in range(blocks * 64, n):
        if abs(x[i]) >= thr:
            out[c] = i
            c += 1
    return c


@kernel(nogil=True, boundscheck=False)
def k_velocity_step(w, prev, vel, s):
    """``vel = (w - prev) · s; prev = w`` in one pass (float32, each operation rounded)."""
    for i in range(w.size):
        vel[i] = (w[i] - prev[i]) * s
        prev[i] = w[i]


@kernel(nogil=True, boundscheck=False)
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


@kernel(nogil=True, boundscheck=False)
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


def momentum_step_to(u: np.ndarray, v: np.ndarray, g: np.ndarray, m: np.float32, u_out: np.ndarray,
                     v_out: np.ndarray) -> None:
    """``u_out = m·u + g; v_out = v + u_out`` (float32 arrays of one size; the outputs distinct
    from the inputs), bitwise numpy's ``u_out = u·m; u_out += g; v_out = v + u_out``."""
    kernels().momentum_step_to(u, v, g, np.float32(m), u_out, v_out)


def abs_at_least(x: np.ndarray, thr: np.float32) -> np.ndarray:
    """``np.flatnonzero(np.abs(x) >= thr)`` in one pass, without the temporaries."""
    out = np.empty(x.size, np.int64)
    return out[:kernels().abs_at_least(x, np.float32(thr), out)]


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


def axpy_at(a: float, x: np.ndarray, y: np.ndarray, out: np.ndarray, idx: np.ndarray) -> None:
    """``out[idx] = float32(a) · x[idx] + y[idx]``, bitwise as numpy's."""
    kernels().axpy_at(np.float32(a), x, y, out, idx)
