"""Divergence guard (pure): reject exploding deltas, spot loss spikes.

Delta rule, per block result with ``n = norm / steps`` where ``norm = ‖S‖₂``
of the decoded delta (per local step, so jobs of different lengths compare:
async and balanced rounds vary H)::

    reject  if n_seen >= warmup and steps_seen >= warmup_steps and n > max_norm_factor · median(last n)

``warmup_steps`` counts local steps, not exchanges: a block's momentum builds up over
~1/(1 − m) = 10 steps, so at one step per exchange the first deltas are up to 10x smaller
than the later ones (measured: with 5 exchanges of warm-up, 20-40 of the first deltas of a
dense H = 1 stream run were rejected, and the run ended 0.53 against 0.71 on the jobs
transport); 50 steps is 5 exchanges at H = 10, as before.

The norm is of a decoded delta: the codec has already refused non-finite
values, so the guard judges magnitudes only.

Loss rule, on the mean loss of whole exchanges pooled until they hold at least
``loss_samples`` training samples (one minibatch's loss is noise: at one step
per exchange, judging each alone halved the lr of every per-step run)::

    spike   if n_seen >= warmup and loss > loss_spike_factor · median(last losses)

A non-finite loss is judged at once.

Chance rule, on the same pooled losses, when the number of classes C is known
(``chance_loss = ln C``, the cross-entropy of a model whose outputs are uniform
over the C classes, whatever its input)::

    at chance   if best <= learned · ln C and (1 − band) · ln C <= loss <= (1 + above) · ln C

``best`` is the lowest loss judged sound so far: the model had learned, and its
loss is back at what a model that knows nothing scores. A run can
collapse so without a spike: its outputs stop depending on the input, and the
loss settles at ln C or just above it, where a spike's factor over the median of
early losses never reaches (measured, 1 epoch of Fashion-MNIST with the dense
stream at H = 1 and lr 0.1: 2 runs of 5 collapsed, single minibatches at
2.28-2.33 against ln 10 = 2.303 from a quarter of the epoch on, the guard silent,
test accuracy 0.10 and 0.59; 4 epochs of the test's synthetic set on the jobs
transport at lr 0.5: 32 pooled losses in a row at 2.30-2.40, test accuracy 0.10).
A sound run's early losses cross ln C too (2.67 after 1.75, at lr 0.05), so a
loss at chance only counts in ``chance_in_a_row``: no action is taken on it, and
the run stops when ``max_chance_in_a_row`` judgments in a row are at chance (10 by
default, against 3 for spikes). A collapse stays at ln C for good, so waiting costs
little; a sound run can cross ln C slowly. Measured: sparsification-aware momentum on
8 blocks at one step per exchange (the seed table's row) stopped once in 3 seeds at 3
judgments, loss 2.291 after 1.272; the same seed with the stop off ended its first
epoch at 0.705 test accuracy, its other seeds at 0.665 and 0.681. In 6 more seeds of
that row (stop off, 1 epoch each, 0.664-0.688), the pooled loss went back above 2.0 for
at most 6 judgments after learning, and at most 1 of them in the band.

A loss well above ln C is no such collapse: the model is confidently wrong, which
is how a sound run overshoots and recovers. Measured: GS-ASGD + MS on 8 blocks
at one step per exchange (Fashion-MNIST, the project's sparse settings) rose from
1.32 to 2.4-3.3 at its lr peak, about a tenth of an epoch, then fell back and
ended its first epoch at 0.697 test accuracy; with the band open above, the rule
stopped 3 seeds of 3 there. Hence ``above`` (0.05): the collapses measured sat at
2.28-2.40 (at most 1.045 ln C).

The engine acts on a spike as configured: ``halve_lr``, ``raise_density`` or
``stop`` (exit code 3). When the action does not help, and ``max_spikes_in_a_row``
judgments in a row spike, the run stops (exit code 3): a collapse the lr cannot
undo (measured: a peak lr of 1.0 on the stream's H = 1 spiked 5 judgments in a
row, loss 27 -> 4,471, while halving the lr 5 times; the run then went on at chance
level, 0.1 test accuracy, because a collapsed model's loss is no spike against a
median of early losses).
"""

from __future__ import annotations

import math
import statistics
from collections import deque


class DivergenceGuard:
    def __init__(self, max_norm_factor: float = 10.0, loss_spike_factor: float = 3.0,
                 window: int = 50, warmup: int = 5, loss_samples: int = 0, warmup_steps: int = 0,
                 chance_loss: float | None = None, learned: float = 0.9, band: float = 0.005,
                 above: float = 0.05):
        self.max_norm_factor = float(max_norm_factor)
        self.loss_samples = int(loss_samples)
        self._pool = [0.0, 0]  # loss sum and samples of the exchanges not judged yet
        self.loss_spike_factor = float(loss_spike_factor)
        self.warmup = int(warmup)
        self.warmup_steps = int(warmup_steps)
        self.steps_seen = 0
        self._norms: deque = deque(maxlen=window)
        self._losses: deque = deque(maxlen=window)
        self.rejected = 0
        self.spikes = 0
        self.in_a_row = 0  # judged losses that spiked since the last one that did not
        self.judged = math.nan  # the loss check_loss judged last: an exchange's, or the pool's mean
        self.chance_loss = chance_loss  # ln C (the chance rule), or None: no chance rule
        self.learned, self.band, self.above = float(learned), float(band), float(above)
        self.best = math.inf    # the lowest loss judged sound
        self.chance_in_a_row = 0  # judged losses at chance (the chance rule) since the last below it
        self.at_chance_now = False  # whether the last check_loss call judged a loss at chance

    def check_norm(self, norm: float, steps: int = 1) -> str | None:
        """None if a delta of L2 norm ``norm`` over ``steps`` local steps may be applied, else why not.

        A rejected norm still enters the window: an outlier cannot move the median, but a
        lasting change of scale (the lr warm-up of a per-step run) does once it fills half
        the window. Kept out, it froze the median and rejected every later delta."""
        n = float(norm) / max(1, int(steps))
        why = None
        if len(self._norms) >= self.warmup and self.steps_seen >= self.warmup_steps:
            med = statistics.median(self._norms)
            if med > 0 and n > self.max_norm_factor * med:
                self.rejected += 1
                why = f"norm per step {n:.3g} > {self.max_norm_factor:g} x running median {med:.3g}"
        self._norms.append(n)
        self.steps_seen += max(1, int(steps))
        return why

    def check_loss(self, loss: float, samples: int | None = None) -> bool:
        """True when ``loss`` is a spike (or not finite); ``in_a_row`` counts the judged
        losses that spiked since the last that did not.

        ``samples``: the exchange's training samples; its loss is pooled with the
        next exchanges' until they hold ``loss_samples`` (None: judge it alone).
        ``at_chance_now`` says whether this call judged a loss at chance (the chance rule)."""
        self.at_chance_now = False
        if not math.isfinite(loss):
            self.spikes += 1
            self.in_a_row += 1
            self.judged = float(loss)
            return True
        if samples is not None and self.loss_samples > 0:
            self._pool[0] += float(loss) * int(samples)
            self._pool[1] += int(samples)
            if self._pool[1] < self.loss_samples:
                return False
            loss, self._pool = self._pool[0] / self._pool[1], [0.0, 0]
        self.judged = float(loss)
        spike = (len(self._losses) >= self.warmup
                 and loss > self.loss_spike_factor * statistics.median(self._losses))
        chance = self.at_chance_now = self.at_chance(loss)
        self.chance_in_a_row = self.chance_in_a_row + 1 if chance else 0
        if spike:
            self.spikes += 1
            self.in_a_row += 1
        else:
            if not chance:
                self.best = min(self.best, float(loss))
            self._losses.append(loss)
            self.in_a_row = 0
        return spike

    def at_chance(self, loss: float) -> bool:
        """The chance rule (module docstring): the model had learned, and ``loss`` is back at ln C."""
        c = self.chance_loss
        return (bool(c) and self.best <= self.learned * c
                and (1 - self.band) * c <= loss <= (1 + self.above) * c)

    def state_dict(self) -> dict:
        return {"norms": list(self._norms), "losses": list(self._losses), "rejected": self.rejected,
                "spikes": self.spikes, "steps_seen": self.steps_seen,
                "pool": list(self._pool), "in_a_row": self.in_a_row,
                "best": self.best if math.isfinite(self.best) else None,
                "chance_in_a_row": self.chance_in_a_row}

    def load_state_dict(self, d: dict) -> None:
        self._norms.extend(float(x) for x in d.get("norms", []))
        self._losses.extend(float(x) for x in d.get("losses", []))
        self.rejected = int(d.get("rejected", 0))
        self.spikes = int(d.get("spikes", 0))
        self.steps_seen = int(d.get("steps_seen", 0))
        self.in_a_row = int(d.get("in_a_row", 0))
        best = d.get("best")
        self.best = math.inf if best is None else float(best)
        self.chance_in_a_row = int(d.get("chance_in_a_row", 0))
        pool = d.get("pool", [0.0, 0])
        self._pool = [float(pool[0]), int(pool[1])]
