"""Compiled per-step passes of a worker: momentum, threshold (the lookahead's: native_look.py).

Each is one pass over the model where numpy makes two or three, with its
temporaries, bitwise the same (float32, each operation rounded, no FMA):

    momentum_step_to   u' = m·u + g; v' = v + u'     (DGC's momentum correction, out of place; feedback.py;
                                                      of g·s when the gradient is clipped)
    dgc_step           momentum_step_to and threshold_select in one pass where the first threshold
                       settles, the values sent and what they leave: DGCMomentum's whole step
                       (feedback.py)
    abs_at_least       {i : |x[i]| >= thr}          (threshold selection; sparsify.py)
    threshold_select   a whole vector's threshold selection, tensor by tensor (exact top-k where the
                       sample would be the whole tensor)
    quantise_f16_at    x[idx] rounded to float16 and back        (the sent values; feedback.py)
"""

from __future__ import annotations

import math

import numpy as np

from .native_compile import kernel, kernels
from .native_codec import f16_bits, f32_bits


@kernel(nogil=True, boundscheck=False)
def k_momentum_step_to(u, v, g, s, m, u_out, v_out):
    """``u_out = m·u + g·s; v_out = v + u_out`` in one pass, rounding each product, then each
    sum, in float32 as numpy's passes do (``s`` = 1 leaves ``g`` as it is: a product by one is
    exact)."""
    for i in range(u.size):
        gi = g[i] * s
        ui = u[i] * m
        ui = ui + gi
        u_out[i] = ui
        v_out[i] = v[i] + ui


@kernel(nogil=True, boundscheck=False)
def k_abs_at_least(x, thr, out):
    """Every i with ``|x[i]| >= thr``, ascending, into ``out``; returns how many."""
    return k_abs_at_least_range(x, 0, x.size, thr, out, 0)


@kernel(nogil=True, boundscheck=False)
def k_abs_at_least_range(x, a, b, thr, out, c):
    """Every i in ``[a, b)`` with ``|x[i]| >= thr``, ascending, written from ``out[c]``; returns
    the new c.

    Hits are rare (density <= a few %), so each block of 64 entries is first tested as a whole,
    by a branch-free OR that the compiler vectorises, and only a block with a hit is walked:
    5.8x faster than walking every entry at density 0.001 (205 k entries: 15 against 84 us),
    no slower at 0.1. It indexes the slice from 0: indices the compiler cannot prove
    non-negative get a wrap-around test each, which stops the vectorised OR (7x slower)."""
    xs = x[a:b]
    blocks = xs.size // 64
    for blk in range(blocks):
        base = blk * 64
        hit = False
        for j in range(64):
            hit |= abs(xs[base + j]) >= thr
        if hit:
            for j in range(64):
                if abs(xs[base + j]) >= thr:
                    out[c] = a + base + j
                    c += 1
    for i in range(blocks * 64, xs.size):
        if abs(xs[i]) >= thr:
            out[c] = a + i
            c += 1
    return c


@kernel(nogil=True, boundscheck=False)
def k_trim(x, out, c0, c, k):
    """Keep the ``k`` of the candidates ``out[c0:c]`` of largest ``|x|``, ties to the lower
    index (sparsify._trim's rule), compacted in order at ``out[c0:c0 + k]``."""
    n = c - c0
    vals = np.empty(n, np.float32)
    for j in range(n):
        vals[j] = abs(x[out[c0 + j]])
    kth = np.partition(vals.copy(), n - k)[n - k]
    need = k
    for j in range(n):
        if vals[j] > kth:
            need -= 1
    w = c0
    for j in range(n):
        v = vals[j]
        if v > kth or (v == kth and need > 0):
            if v == kth:
                need -= 1
            out[w] = out[c0 + j]
            w += 1


@kernel(nogil=True, boundscheck=False)
def k_exact_topk(x, a, b, k, out, c):
    """sparsify.topk_indices of ``x[a:b]`` (0 < k < b - a) as global indices written from ``out[c]``:
    the k largest ``|x|``, ties to the lower index. Returns the new c, or -1 (nothing kept)
    when the tensor holds a NaN."""
    n = b - a
    mags = np.empty(n, np.float32)
    for j in range(n):
        mags[j] = abs(x[a + j])
        if mags[j] != mags[j]:
            return -1
    kth = np.partition(mags.copy(), n - k)[n - k]
    ties = k
    for j in range(n):
        ties -= mags[j] > kth
    for j in range(n):
        if mags[j] > kth:
            out[c] = a + j
            c += 1
        elif mags[j] == kth and ties > 0:
            out[c] = a + j
            c += 1
            ties -= 1
    return c


@kernel(nogil=True, boundscheck=False)
def k_threshold_select(x, a, b, whole, stride, start, rank, k, lo, hi, corrections, out, found):
    """Sparsifier.indices in one call, tensor by tensor (``[a[t], b[t])`` of ``x``), as
    sparsify.threshold_indices selects: a tensor sent whole gives all its indices; another
    those with ``|x[i]| >= thr``, thr the ``rank``-th largest of the sample
    ``|x[a + start :: stride]|``: accepted within ``[lo, hi]``, trimmed to the ``k`` largest
    above it, and below it corrected with a lower rank, up to ``corrections`` passes; a tensor
    whose sample would be the whole (``hi < lo``) its exact top ``k`` (:func:`k_exact_topk`).
    Indices go to ``out`` in tensor order; ``found[t]`` is tensor t's count, or -1 where the
    caller selects it itself (NaN in its sample or, on the exact path, in the tensor; a
    tensor the corrections do not settle), which leaves nothing of it in ``out``.
    Returns the entries written."""
    one = np.float32(1.0)
    return k_select(x, a, b, whole, stride, start, rank, k, lo, hi, corrections, out, found,
                    False, x, x, x, one, one, x)


@kernel(nogil=True, boundscheck=False)
def k_select(x, a, b, whole, stride, start, rank, k, lo, hi, corrections, out, found, fuse, u, v, g, s, m,
             u_out):
    """:func:`k_threshold_select`; with ``fuse``, of ``x = v_out`` as the momentum pass
    (``k_momentum_step_to(u, v, g, s, m, u_out, x)``) writes it, that pass made here tensor by
    tensor: a sampled tensor's sample is computed from the inputs, and its first threshold's
    selection is made in the same pass that writes the tensor (:func:`k_momentum_at_least`), so
    that ``x`` is read again only by a correction. Every entry's momentum pass is made
    whatever ``found`` says."""
    c = 0
    for t in range(a.size):
        lo_t, hi_t = a[t], b[t]
        sampled = not whole[t] and hi[t] >= lo[t]
        if fuse and not sampled:
            # the momentum pass alone: a NaN threshold selects nothing
            k_momentum_at_least(u, v, g, s, m, u_out, x, lo_t, hi_t, np.float32(np.nan), out, c)
        if whole[t]:
            for i in range(lo_t, hi_t):
                out[c] = i
                c += 1
            found[t] = hi_t - lo_t
            continue
        found[t] = -1
        if not sampled:  # exact top-k
            c0 = c
            c = k_exact_topk(x, lo_t, hi_t, k[t], out, c)
            if c < 0:  # NaN in the tensor: the caller's
                c = c0
            else:
                found[t] = c - c0
            continue
        first = lo_t + start[t]
        n_s = (hi_t - first + stride[t] - 1) // stride[t]
        sample = np.empty(n_s, np.float32)
        nan = False
        for j in range(n_s):
            i = first + j * stride[t]
            if fuse:
                ui = u[i] * m
                ui = ui + g[i] * s
                sample[j] = abs(v[i] + ui)
            else:
                sample[j] = abs(x[i])
            nan |= sample[j] != sample[j]
        if nan:
            if fuse:
                k_momentum_at_least(u, v, g, s, m, u_out, x, lo_t, hi_t, np.float32(np.nan), out, c)
            continue
        c0 = c
        r = rank[t]
        for it in range(max(corrections, 1 if fuse else 0)):
            thr = np.partition(sample.copy(), n_s - r)[n_s - r]
            if fuse and it == 0:
                c = k_momentum_at_least(u, v, g, s, m, u_out, x, lo_t, hi_t, thr, out, c0)
                if it >= corrections:  # no correction pass allowed: the momentum pass alone
                    break
            else:
                c = k_abs_at_least_range(x, lo_t, hi_t, thr, out, c0)
            n = c - c0
            if n > hi[t]:  # too many: the k largest are among them
                k_trim(x, out, c0, c, k[t])
                c = c0 + k[t]
                found[t] = k[t]
                break
            if n >= lo[t]:
                found[t] = n
                break
            new_r = min(n_s, max(r + 1, math.ceil(r * 1.25 * k[t] / max(n, 1))))
            if new_r == r:  # already at the smallest sampled value
                break
            r = new_r
        if found[t] < 0:
            c = c0
    return c


@kernel(nogil=True, boundscheck=False)
def k_momentum_at_least(u, v, g, s, m, u_out, v_out, a, b, thr, out, c):
    """``k_momentum_step_to`` over ``[a, b)`` and, in the same pass, ``k_abs_at_least_range(v_out,
    a, b, thr, out, c)``: returns the new c. Blocks of 64 entries as there, slices indexed from 0."""
    us, vs, gs, uo, vo = u[a:b], v[a:b], g[a:b], u_out[a:b], v_out[a:b]
    blocks = us.size // 64
    for blk in range(blocks):
        base = blk * 64
        hit = False
        for j in range(64):
            gi = gs[base + j] * s
            ui = us[base + j] * m
            ui = ui + gi
            uo[base + j] = ui
            vi = vs[base + j] + ui
            vo[base + j] = vi
            hit |= abs(vi) >= thr
        if hit:
            for j in range(64):
                if abs(vo[base + j]) >= thr:
                    out[c] = a + base + j
                    c += 1
    for i in range(blocks * 64, us.size):
        gi = gs[i] * s
        ui = us[i] * m
        ui = ui + gi
        uo[i] = ui
        vo[i] = vs[i] + ui
        if abs(vo[i]) >= thr:
            out[c] = a + i
            c += 1
    return c


@kernel(nogil=True, boundscheck=False)
def k_dgc_step(u, v, g, s, m, u_out, v_out, a, b, whole, stride, start, rank, k, lo, hi, corrections, f16,
               dense, masking, idx, vals, found):
    """DGCMomentum.step in one call: the momentum pass (``k_momentum_step_to``'s arithmetic) and
    the threshold selection of ``v_out`` into ``idx`` (``k_threshold_select``'s), made together
    tensor by tensor (``k_select``: in the common case one pass over the model where they made
    two), the values sent into ``vals``
    (rounded to float16 when ``f16``, else as they are), those values taken out of ``v_out``
    and, with ``masking``, ``u_out`` zeroed where an index falls outside the tensors sent whole
    (``dense``). Returns how many were sent; -1 when a tensor is left to the caller (``found``)
    or a value is beyond float16, with only the momentum pass done: the caller finishes."""
    c = k_select(v_out, a, b, whole, stride, start, rank, k, lo, hi, corrections, idx, found,
                 True, u, v, g, s, m, u_out)  # the momentum pass and the selection's first in one
    for t in range(found.size):
        if found[t] < 0:
            return -1
    if f16:
        if not k_quantise_f16_at(v_out.view(np.uint32), idx[:c], vals[:c].view(np.uint32)):
            return -1
    else:
        for j in range(c):
            vals[j] = v_out[idx[j]]
    for j in range(c):
        i = idx[j]
        v_out[i] -= vals[j]
        if masking and not dense[i]:
            u_out[i] = 0.0
    return c


@kernel(nogil=True, boundscheck=False)
def k_quantise_f16_at(bits, idx, out):
    """``out[j]`` = float32 bits of ``x[idx[j]]`` rounded to float16 (``bits``: x's float32 bits),
    as feedback.quantise; returns False, leaving ``out`` partly written, at the first value it
    does not take (not finite, or beyond float16's range), which quantise then handles."""
    for j in range(idx.size):
        b = np.int64(bits[idx[j]])
        if (b & 0x7FFFFFFF) > 0x477FE000:  # 65504, float16's largest; NaN and infinities too
            return False
        out[j] = f32_bits(f16_bits(b))
    return True


def momentum_step_to(u: np.ndarray, v: np.ndarray, g: np.ndarray, m: np.float32, u_out: np.ndarray,
                     v_out: np.ndarray, scale: np.float32 | None = None) -> None:
    """``u_out = m·u + g; v_out = v + u_out`` (float32 arrays of one size; the outputs distinct
    from the inputs), bitwise numpy's ``u_out = u·m; u_out += g; v_out = v + u_out``; with
    ``scale``, of the gradient ``g·scale`` (numpy: ``u_out += g * scale``)."""
    s = np.float32(1.0 if scale is None else scale)
    kernels().momentum_step_to(u, v, g, s, np.float32(m), u_out, v_out)


def abs_at_least(x: np.ndarray, thr: np.float32) -> np.ndarray:
    """``np.flatnonzero(np.abs(x) >= thr)`` in one pass, without the temporaries."""
    out = np.empty(x.size, np.int64)
    return out[:kernels().abs_at_least(x, np.float32(thr), out)]


def threshold_select(x: np.ndarray, plan, starts: np.ndarray, ranks: np.ndarray, corrections: int,
                     out: np.ndarray, found: np.ndarray) -> int:
    """:func:`k_threshold_select` over float32 ``x`` with a selection plan's arrays
    (``sparsify._Plan``) and the sample starts and ranks of this call; returns the entries in ``out``."""
    return kernels().threshold_select(x, plan.a, plan.b, plan.whole, plan.stride, starts, ranks, plan.k,
                                      plan.lo, plan.hi, corrections, out, found)


def dgc_step(u: np.ndarray, v: np.ndarray, g: np.ndarray, m: np.float32, u_out: np.ndarray, v_out: np.ndarray,
             scale: np.float32 | None, plan, corrections: int, f16: bool, dense: np.ndarray, masking: bool,
             idx: np.ndarray, vals: np.ndarray, found: np.ndarray) -> int:
    """:func:`k_dgc_step` with a selection plan's arrays (``sparsify._Plan``, samples from start 0)."""
    s = np.float32(1.0 if scale is None else scale)
    return kernels().dgc_step(u, v, g, s, np.float32(m), u_out, v_out,
                              plan.a, plan.b, plan.whole, plan.stride, plan.start0, plan.rank, plan.k,
                              plan.lo, plan.hi, corrections, f16, dense, masking, idx, vals, found)


def quantise_f16_at(x: np.ndarray, idx: np.ndarray) -> np.ndarray | None:
    """``x[idx]`` (float32) rounded to float16 and back, bitwise feedback.quantise's; None when
    a value is not finite or beyond float16's range (quantise clips those)."""
    out = np.empty(idx.size, np.float32)
    return out if kernels().quantise_f16_at(x.view(np.uint32), idx, out.view(np.uint32)) else None
