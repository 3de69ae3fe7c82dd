"""Density warm-up and learning-rate schedule, as functions of the (fractional) epoch.

Density falls exponentially during warm-up, then stays at the target::

    density(e) = initial · (target / initial) ** (e / warmup_epochs)   for e < warmup_epochs
               = target                                              afterwards

e.g. initial 0.25, target 0.001, 4 epochs: 0.25 → 0.063 → 0.016 → 0.004 → 0.001
at whole epochs (DGC's 75% … 99.9% sparsity ramp).

Learning rate: linear warm-up from ``warmup_start · base_lr`` to ``base_lr``
(Goyal et al. 2017), then the chosen decay over the remaining epochs::

    constant: base_lr
    cosine:   base_lr · (1 + cos(π · t)) / 2,   t = (e - warmup) / (total - warmup)
    step:     base_lr · 0.1 ** (milestones passed), milestones at 50% and 75% of total
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "cosine", "step")
STEP_MILESTONES = (0.5, 0.75)  # fractions of total_epochs (ResNet-on-CIFAR habit)
STEP_FACTOR = 0.1


def _check_epoch(epoch: float) -> float:
    epoch = float(epoch)
    if not epoch >= 0.0:  # also rejects NaN
        raise ValueError(f"epoch must be >= 0, got {epoch}")
    return epoch


def density_at(epoch: float, *, initial: float, target: float, warmup_epochs: float) -> float:
    """Density in (0, 1] to use at ``epoch`` (see the module docstring)."""
    epoch = _check_epoch(epoch)
    for name, value in (("initial", initial), ("target", target)):
        if not 0.0 < value <= 1.0:
            raise ValueError(f"compression.density_warmup.{name} must be in (0, 1], got {value}")
    if not warmup_epochs >= 0.0:
        raise ValueError(f"compression.density_warmup.epochs must be >= 0, got {warmup_epochs}")
    if epoch >= warmup_epochs:
        return float(target)
    return float(initial * (target / initial) ** (epoch / warmup_epochs))


def lr_at(
    epoch: float,
    *,
    base_lr: float,
    warmup_epochs: float,
    total_epochs: float,
    schedule: str = "constant",
    warmup_start: float = 0.1,
) -> float:
    """Learning rate at ``epoch``: linear warm-up, then ``schedule`` decay."""
    epoch = _check_epoch(epoch)
    if schedule not in SCHEDULES:
        raise ValueError(f"optimizer.schedule must be one of {SCHEDULES}, got {schedule!r}")
    if not base_lr > 0.0:
        raise ValueError(f"optimizer.lr must be > 0, got {base_lr}")
    if not total_epochs > 0.0:
        raise ValueError(f"train.epochs must be > 0, got {total_epochs}")
    if not 0.0 <= warmup_epochs <= total_epochs:
        raise ValueError(
            f"optimizer.warmup_epochs must be in [0, train.epochs={total_epochs}], got {warmup_epochs}"
        )
    if not 0.0 < warmup_start <= 1.0:
        raise ValueError(f"optimizer.warmup_start must be in (0, 1], got {warmup_start}")

    if epoch < warmup_epochs:
        frac = epoch / warmup_epochs
        return float(base_lr * (warmup_start + (1.0 - warmup_start) * frac))
    if schedule == "constant":
        return float(base_lr)
    if schedule == "cosine":
        span = total_epochs - warmup_epochs
        t = 1.0 if span == 0 else min(1.0, (epoch - warmup_epochs) / span)
        return float(base_lr * 0.5 * (1.0 + math.cos(math.pi * t)))
    passed = sum(epoch >= f * total_epochs for f in STEP_MILESTONES)
    return float(base_lr * STEP_FACTOR**passed)
