"""Error feedback and momentum policies for sparse sends (one state per block).

Every policy has one interface, ``step(update, density, *, lr, weights) ->
SparseDelta`` (arguments a policy does not need are ignored), keeps flat
float32 buffers, selects entries with a :class:`~.sparsify.Sparsifier`, and
sends them quantised to the wire dtype. In error feedback and momentum
correction what is not sent stays in the buffer, so nothing is lost::

    q = quantise(buf[S])      # exactly representable in the wire dtype
    buf[S] -= q               # exact: q(a) is within a factor 2 of a (Sterbenz)

Hence ``sent + residual == accumulated input`` bitwise, for float16 and
float32 values alike (float32: the residual at sent entries is exactly 0).
Sparsification-aware momentum is a momentum, not a residual: its sent
entries keep their velocity (see the class).

Which policy a run uses, and whether the server multiplies what arrives by
the learning rate, is decided here alone: :func:`make_policy` and
:func:`server_scale`.
"""

from __future__ import annotations

import numpy as np

from ..errors import BadInput
from . import native, native_step
from .codec_format import FLOAT16_MAX, VALUE_DTYPES
from .delta import Layout, SparseDelta, layout_offsets
from .sparsify import MAX_CORRECTIONS, METHODS, Sparsifier

MOMENTUM_MODES = ("correction", "sparsification_aware")  # per-step forms (compression.momentum)


def quantise_at(x: np.ndarray, idx: np.ndarray, value_dtype: str) -> np.ndarray:
    """``quantise(x[idx], value_dtype)``; in one compiled pass where it can (float16, a float32
    ``x``, every value within float16's range)."""
    if value_dtype == "float16" and x.dtype == np.float32 and x.flags.c_contiguous and native.enabled():
        q = native_step.quantise_f16_at(x, idx)
        if q is not None:
            return q
    return quantise(x[idx], value_dtype)


def quantise(a: np.ndarray, value_dtype: str) -> np.ndarray:
    """Round ``a`` (float32) to the wire dtype, returned as float32, such that
    ``a - quantise(a)`` is exact in float32.

    float16: round to nearest, magnitudes above 65504 clipped. The rounded
    value is within a factor 2 of ``a`` (or 0), so the subtraction is exact
    (Sterbenz). A clipped value of ``|a| >= 2**29`` is further rounded down to
    a multiple of ``ulp(a)``, which keeps the subtraction exact there too.
    """
    a = np.asarray(a, dtype=np.float32)
    if value_dtype == "float32":
        return a.copy()
    if value_dtype != "float16":
        raise ValueError(f"value_dtype must be one of {VALUE_DTYPES}, got {value_dtype!r}")
    q = np.clip(a, -FLOAT16_MAX, FLOAT16_MAX).astype(np.float16).astype(np.float32)
    big = np.abs(a) > FLOAT16_MAX
    if big.any():
        _, exp = np.frexp(a[big])  # |a| = m · 2**exp, 0.5 <= m < 1
        ulp = np.ldexp(np.float32(1.0), exp - 24)  # float32 quantum of each big value
        q[big] = np.copysign(np.floor(FLOAT16_MAX / ulp) * ulp, a[big])
    return q


def mask_momentum(momentum_flat: np.ndarray, sent_indices) -> np.ndarray:
    """Momentum factor masking for the local-step form (DESIGN §3, step 4)::

        momentum[S] = 0

    so stale momentum does not push already-sent coordinates again. In place;
    returns ``momentum_flat``. ``sent_indices`` may be a SparseDelta.
    """
    if isinstance(sent_indices, SparseDelta):
        sent_indices = sent_indices.indices
    momentum_flat[sent_indices] = 0.0
    return momentum_flat


class _FlatState:
    """Named flat float32 buffers with persistence, and the shared send step."""

    _buffers: tuple[str, ...] = ()
    # True when the sent values are free of the learning rate, so the server
    # applies ``W -= lr · mean(S)`` (server_scale); False when they are lr-scaled
    # updates the server applies as they are.
    server_lr_scaled: bool = False

    def __init__(self, layout: Layout, sparsifier: Sparsifier, value_dtype: str = "float16"):
        if value_dtype not in VALUE_DTYPES:
            raise ValueError(f"compression.value_dtype must be one of {VALUE_DTYPES}, got {value_dtype!r}")
        self.layout = tuple(int(n) for n in layout)
        self.size = int(layout_offsets(self.layout)[-1])  # P, elements
        self.sparsifier = sparsifier
        self.value_dtype = value_dtype
        for name in self._buffers:
            setattr(self, name, np.zeros(self.size, dtype=np.float32))
        self._retired: list[list[np.ndarray]] = []  # out-of-place policies: the last KEEP steps' buffers
        self._spare: list[list[np.ndarray]] = []    # and older ones, free for the next step
        # tensors the sparsifier sends whole every step (fewer than dense_below elements):
        # no selection happens there, so neither does momentum masking
        offsets = layout_offsets(self.layout)
        self.dense_ranges = [(int(a), int(b)) for a, b in zip(offsets[:-1], offsets[1:])
                             if b - a < sparsifier.dense_below]
        self._dense = np.zeros(self.size, bool)
        for a, b in self.dense_ranges:
            self._dense[a:b] = True

    # Policies that step out of place write each step's buffers into arrays other than the
    # last step's, so :meth:`snapshot` hands out references instead of copies (the stream's
    # tasks take one every step, to put back if the push is dropped: two copies of P each).
    out_of_place = False
    KEEP = 2  # steps a snapshot of an out-of-place policy stays intact after it was taken

    def snapshot(self) -> dict[str, np.ndarray]:
        """The buffers as they are now, for :meth:`load_state_dict`: read-only references that
        stay intact for the next ``KEEP`` steps when the policy steps out of place, else copies."""
        if not self.out_of_place:
            return self.state_dict()
        out = {}
        for name in self._buffers:
            out[name] = view = getattr(self, name).view()
            view.flags.writeable = False
        return out

    def _fresh(self) -> list[np.ndarray]:
        """Arrays for the next step's buffers (out-of-place policies): none of them is the
        current buffers or those of the last ``KEEP`` steps."""
        if not self._spare:
            self._spare = self._generations()
        return self._spare.pop()

    def _generations(self) -> list[list[np.ndarray]]:
        """The buffers of the ``KEEP + 2`` steps the policy cycles through in one block (7 MB for
        fmnist_cnn, backed by numpy with huge pages), each array on 64 bytes, the current ones
        copied into the first (a snapshot of them stays intact: they are not written again);
        returns the other ``KEEP + 1``. A step reads three and writes two, cold after TF's step."""
        n, gens, stride = len(self._buffers), self.KEEP + 2, -(-self.size // 16) * 16  # 64 bytes
        raw = np.empty(stride * n * gens + 16, np.float32)
        at = (-raw.ctypes.data // 4) % 16
        out = [[raw[at + j * stride:at + j * stride + self.size] for j in range(g * n, (g + 1) * n)]
               for g in range(gens)]
        for name, a in zip(self._buffers, out[0]):
            np.copyto(a, getattr(self, name))
            setattr(self, name, a)
        return out[1:]

    def _advance(self, new: list[np.ndarray]) -> None:
        """Make ``new`` the buffers; the old ones retire, reused ``KEEP`` steps later."""
        self._retired.append([getattr(self, name) for name in self._buffers])
        for name, a in zip(self._buffers, new):
            setattr(self, name, a)
        if len(self._retired) > self.KEEP:
            self._spare.append(self._retired.pop(0))

    def selected(self, indices: np.ndarray) -> np.ndarray:
        """The entries of ``indices`` in tensors that go through selection (not sent whole)."""
        return indices[~self._dense[indices]] if self.dense_ranges else indices

    def _select(self, buf: np.ndarray, density: float) -> SparseDelta:
        """``S = select(buf)``; returns ``SparseDelta(S, quantise(buf[S]))``, ``buf`` untouched.

        The values are exactly representable in ``value_dtype``, so encoding
        them with that dtype loses nothing.
        """
        idx = self.sparsifier.indices(buf, self.layout, density)
        return SparseDelta(self.size, idx, quantise_at(buf, idx, self.value_dtype))

    def _send(self, buf: np.ndarray, density: float) -> SparseDelta:
        """:meth:`_select`, then ``buf[S] -= q``: what was sent leaves the buffer (a residual)."""
        sent = self._select(buf, density)
        buf[sent.indices] -= sent.values  # exact, see quantise()
        return sent

    def step(self, update: np.ndarray, density: float, *, lr: float, weights: np.ndarray | None,
             scale: float | None = None) -> SparseDelta:
        """Take this step's ``update`` (a delta or a gradient, see the class), times ``scale``
        when given (a clipped gradient, scaled here rather than copied), and return what to send."""
        raise NotImplementedError

    def _scaled(self, name: str, vec: np.ndarray, scale: float | None) -> np.ndarray:
        """``vec`` checked, times float32 ``scale`` when given (a new array)."""
        vec = self._check_input(name, vec)
        return vec if scale is None else vec * np.float32(scale)

    def _check_input(self, name: str, vec: np.ndarray) -> np.ndarray:
        vec = np.asarray(vec, dtype=np.float32).ravel()
        if vec.size != self.size:
            raise ValueError(f"{name} has {vec.size} entries, layout has {self.size}")
        return vec

    def state_dict(self) -> dict[str, np.ndarray]:
        """Copies of the buffers, keyed by name (persist with np.savez, no pickle)."""
        return {name: getattr(self, name).copy() for name in self._buffers}

    def load_state_dict(self, state: dict) -> None:
        missing = sorted(set(self._buffers) - set(state))
        extra = sorted(set(state) - set(self._buffers))
        if missing or extra:
            raise BadInput(f"{type(self).__name__} state: missing {missing}, unexpected {extra}")
        for name in self._buffers:
            arr = np.asarray(state[name])
            if arr.shape != (self.size,):
                raise BadInput(
                    f"{type(self).__name__} state {name!r}: shape {arr.shape}, expected ({self.size},)"
                )
            if arr.dtype != np.float32:
                raise BadInput(f"{type(self).__name__} state {name!r}: dtype {arr.dtype}, expected float32")
            setattr(self, name, arr.copy())


class ErrorFeedback(_FlatState):
    """Residual accumulation for the local-step form (DESIGN §3, step 3)::

        A += Δ                   # update = Δ, an lr-scaled weight delta
        S = select(A, density)
        A[S] -= q(A[S])          # q: wire quantisation; A keeps what was not sent
        return S, q(A[S])

    ``lr`` and ``weights`` are ignored.
    """

    _buffers = ("residual",)

    def step(self, update: np.ndarray, density: float, *, lr: float, weights: np.ndarray | None,
             scale: float | None = None) -> SparseDelta:
        self.residual += self._scaled("update", update, scale)
        return self._send(self.residual, density)


class DGCMomentum(_FlatState):
    """Momentum correction with factor masking, per-step form (DGC, H = 1)::

        u = m·u + g              # update = g, the gradient; momentum accumulated locally
        v += u                   # velocity residual
        S = select(v, density)
        send q(v[S]);  v[S] -= q(v[S])      # = 0 with float32 values
        u[S] = 0                 # factor masking (selected tensors; those sent whole every
                                 # step keep their momentum: plain momentum SGD there)

    ``masking=False`` keeps ``u`` everywhere (momentum correction alone): a
    coordinate selected every step then still moves as momentum SGD, where
    masking leaves it plain SGD (measured at H = 1, 2 epochs: 0.862 without
    masking, 0.848 with it, 0.870 dense).

    What is sent is free of the learning rate: the server applies
    ``W -= lr · mean(S)`` with no second momentum (``server_lr_scaled``).
    ``lr`` and ``weights`` are ignored here.
    """

    _buffers = ("momentum", "velocity")
    server_lr_scaled = True

    def __init__(self, layout: Layout, sparsifier: Sparsifier, value_dtype: str = "float16",
                 *, momentum: float = 0.9, masking: bool = True):
        super().__init__(layout, sparsifier, value_dtype)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"optimizer.momentum must be in [0, 1), got {momentum}")
        self.m = np.float32(momentum)
        self.masking = bool(masking)
        self._sent = None  # the compiled step's output arrays (indices, values, per-tensor counts)

    out_of_place = True

    def step(self, update: np.ndarray, density: float, *, lr: float, weights: np.ndarray | None,
             scale: float | None = None) -> SparseDelta:
        g = self._check_input("update", update)
        u, v = self._fresh()
        plan = (self.sparsifier.compiled_plan(self.layout, density, self.size)
                if self.sparsifier.rng is None else None)
        if plan is not None:  # the whole step in one compiled call, bitwise the same as below
            if self._sent is None:
                self._sent = (np.empty(self.size, np.int64), np.empty(self.size, np.float32),
                              np.empty(plan.a.size, np.int64))
            idx, vals, found = self._sent
            c = native_step.dgc_step(self.momentum, self.velocity, g, self.m, u, v, scale, plan,
                                     MAX_CORRECTIONS, self.value_dtype == "float16", self._dense,
                                     self.masking, idx, vals, found)
        elif native.enabled():  # one pass instead of three (four when scaled), bitwise the same
            native_step.momentum_step_to(self.momentum, self.velocity, g, self.m, u, v, scale)
        else:
            np.multiply(self.momentum, self.m, out=u)
            u += g if scale is None else g * np.float32(scale)
            np.add(self.velocity, u, out=v)
        self._advance([u, v])
        if plan is not None and c >= 0:
            return SparseDelta(self.size, idx[:c].copy(), vals[:c].copy())
        # (handed back by the compiled call, NaN or a value beyond float16, a tensor the
        # corrections did not settle: its momentum pass is done, the selection is not)
        sent = self._send(self.velocity, density)
        if self.masking:
            self.momentum[self.selected(sent.indices)] = 0.0
        return sent


class SparsificationAwareMomentum(_FlatState):
    """Sparsification-aware momentum (SAMomentum; Yan 2019, arXiv 1910.10929; DESIGN §3)::

        u = m·u + lr·(g + wd·w)  # update = g, weights = w; lr-scaled momentum, one buffer per block
        S = select(u, density)   # per-tensor threshold
        send q(u[S])             # u[S] is kept: the momentum of a sent entry goes on as in SGD
        u[~S] /= m               # the next step's m·u restores it: an entry not sent
                                 # accumulates its gradients instead of decaying

    Each entry thus runs momentum SGD on its own batch: an entry sent every step
    is plain momentum SGD; one sent after T steps applies ``m·v + lr·Σ g`` over
    those T steps, momentum SGD with a T times larger batch (the paper's
    "sparsification into adaptive batch size"). Unlike momentum correction, the
    server gets no residual back for what it already applied: a sent entry's
    ``u`` is its velocity, which the next sends carry on (what was applied is
    ``q(u[S])``; the float16 rounding remainder is not fed back).

    Tensors sent whole every step (fewer than ``dense_below`` elements) are
    therefore plain momentum SGD. ``weights`` is read only when ``wd > 0``.

    An earlier form here also cleared ``u[S]`` after sending, which left no
    momentum at all on the sparse entries (only the undecayed accumulation);
    the reference code (``worker_gradient_executor`` in the paper's
    ``yanring/GradientServer``) keeps it, as above.
    """

    _buffers = ("momentum",)

    def __init__(self, layout: Layout, sparsifier: Sparsifier, value_dtype: str = "float16",
                 *, momentum: float = 0.9, weight_decay: float = 0.0):
        super().__init__(layout, sparsifier, value_dtype)
        if not 0.0 < momentum < 1.0:
            raise ValueError(
                f"optimizer.momentum must be in (0, 1) for sparsification-aware momentum, got {momentum}"
            )
        if weight_decay < 0.0:
            raise ValueError(f"optimizer.weight_decay must be >= 0, got {weight_decay}")
        self.m = np.float32(momentum)
        self.wd = np.float32(weight_decay)

    out_of_place = True

    def step(self, update: np.ndarray, density: float, *, lr: float, weights: np.ndarray | None,
             scale: float | None = None) -> SparseDelta:
        g = self._scaled("update", update, scale)
        (u,) = self._fresh()
        np.multiply(self.momentum, self.m, out=u)
        self._advance([u])
        if self.wd:
            u += np.float32(lr) * (g + self.wd * self._check_input("weights", weights))
        else:
            u += np.float32(lr) * g
        sent = self._select(u, density)  # a velocity, not a residual: the sent entries stay
        kept = u[sent.indices]
        u /= self.m
        u[sent.indices] = kept
        return sent


def _policy_class(method: str, momentum_mode: str, per_step: bool) -> type[_FlatState] | None:
    """The policy of a run: None when dense (method "none"), error feedback for local
    steps (H > 1), else the per-step momentum form ``momentum_mode`` names."""
    if method not in METHODS:
        raise ValueError(f"compression.method must be one of {METHODS}, got {method!r}")
    if momentum_mode not in MOMENTUM_MODES:
        raise ValueError(f"compression.momentum must be one of {MOMENTUM_MODES}, got {momentum_mode!r}")
    if method == "none":
        return None
    if not per_step:
        return ErrorFeedback
    return SparsificationAwareMomentum if momentum_mode == "sparsification_aware" else DGCMomentum


def make_policy(method: str, momentum_mode: str, per_step: bool, layout: Layout, value_dtype: str,
                dense_below: int, momentum: float, *, masking: bool = True) -> _FlatState | None:
    """A block's fresh policy, or None when the run is dense (method "none").

        per_step = False:                      ErrorFeedback
        per_step, momentum_mode "correction":  DGCMomentum(momentum, masking)
        per_step, "sparsification_aware":      SparsificationAwareMomentum(momentum, weight_decay=0)

    Weight decay stays 0: the trainer's gradient already includes it.
    """
    cls = _policy_class(method, momentum_mode, per_step)
    if cls is None:
        return None
    sparsifier = Sparsifier(method, dense_below)
    if cls is ErrorFeedback:
        return ErrorFeedback(layout, sparsifier, value_dtype)
    if cls is SparsificationAwareMomentum:
        return SparsificationAwareMomentum(layout, sparsifier, value_dtype, momentum=momentum,
                                           weight_decay=0.0)
    return DGCMomentum(layout, sparsifier, value_dtype, momentum=momentum, masking=masking)


def server_scale(method: str, momentum_mode: str, per_step: bool, lr: float) -> float:
    """What the server multiplies a block's decoded delta by before averaging::

        lr    for a policy whose sends are lr-free (server_lr_scaled: DGCMomentum)
        1.0   otherwise (dense, error feedback, sparsification-aware momentum)
    """
    cls = _policy_class(method, momentum_mode, per_step)
    return float(lr) if cls is not None and cls.server_lr_scaled else 1.0
