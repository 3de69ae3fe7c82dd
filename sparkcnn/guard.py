"""Divergence guard (pure): reject exploding deltas, spot loss spikes.

Delta rule, per block result with ``n = norm / steps`` where ``norm = ‖S‖₂``
of the decoded delta (per local step, so jobs of different lengths compare:
async and balanced rounds vary H)::

    reject  if n_seen >= warmup and n > max_norm_factor · median(last n)

The norm is of a decoded delta: the codec has already refused non-finite
values, so the guard judges magnitudes only.

Loss rule, per round::

    spike   if n_seen >= warmup and loss > loss_spike_factor · median(last losses)

The engine acts on a spike as configured: ``halve_lr``, ``raise_density`` or
``stop`` (exit code 3).
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np


class DivergenceGuard:
    def __init__(self, max_norm_factor: float = 10.0, loss_spike_factor: float = 3.0,
                 window: int = 50, warmup: int = 5):
        self.max_norm_factor = float(max_norm_factor)
        self.loss_spike_factor = float(loss_spike_factor)
        self.warmup = int(warmup)
        self._norms: deque = deque(maxlen=window)
        self._losses: deque = deque(maxlen=window)
        self.rejected = 0
        self.spikes = 0

    def check_norm(self, norm: float, steps: int = 1) -> str | None:
        """None if a delta of L2 norm ``norm`` over ``steps`` local steps may be applied, else why not."""
        n = float(norm) / max(1, int(steps))
        if len(self._norms) >= self.warmup:
            med = float(np.median(self._norms))
            if med > 0 and n > self.max_norm_factor * med:
                self.rejected += 1
                return f"norm per step {n:.3g} > {self.max_norm_factor:g} x running median {med:.3g}"
        self._norms.append(n)
        return None

    def check_loss(self, loss: float) -> bool:
        """True when ``loss`` is a spike (or not finite)."""
        if not math.isfinite(loss):
            self.spikes += 1
            return True
        spike = (len(self._losses) >= self.warmup
                 and loss > self.loss_spike_factor * float(np.median(self._losses)))
        if spike:
            self.spikes += 1
        else:
            self._losses.append(loss)
        return spike

    def state_dict(self) -> dict:
        return {"norms": list(self._norms), "losses": list(self._losses), "rejected": self.rejected,
                "spikes": self.spikes}

    def load_state_dict(self, d: dict) -> None:
        self._norms.extend(float(x) for x in d.get("norms", []))
        self._losses.extend(float(x) for x in d.get("losses", []))
        self.rejected = int(d.get("rejected", 0))
        self.spikes = int(d.get("spikes", 0))
