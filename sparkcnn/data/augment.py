"""Augmentation of training minibatches in the executors' input path (``data.augment``).

``crop_flip`` is the CIFAR recipe (He et al. 2016, section 4.2): each image padded with ``PAD``
zero pixels on every side, cropped back to its size at a random offset, and flipped left to
right with probability 1/2::

    padded = zeros(H + 2p, W + 2p, C);  padded[p:p+H, p:p+W] = x
    dy, dx ~ U{0 .. 2p};  y = padded[dy:dy+H, dx:dx+W];  y = y[:, ::-1] with probability 1/2

It runs on the executors, on each minibatch as it is gathered for a step (the trainer's batch
buffer, rewritten in place); evaluation and prediction never augment. The draws of minibatch
``step`` of ``block``'s pass ``epoch`` come from one generator seeded by ``(run seed, block,
epoch, step)`` alone, so whichever task, attempt or resumed run trains that step draws the same
crops and flips: retried, resumed and ``run.deterministic`` runs stay bit-identical. numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sparkcnn.errors import BadInput

AUGMENTS = ("none", "crop_flip")   # data.augment
PAD = 4  # pixels of zero padding on each side before the crop (the CIFAR recipe's)
# the last word of every augmentation seed, so that its draws never repeat the batch
# permutation's (trainer._epoch_permutation seeds [seed, epoch, block])
_STREAM = 0xA6


def batch_rng(seed: int, block: int, epoch: int, step: int) -> np.random.Generator:
    """The generator of minibatch ``step`` of ``block`` in pass ``epoch`` of a run seeded ``seed``."""
    return np.random.default_rng([seed, block, epoch, step, _STREAM])


def crop_flip(images: np.ndarray, rng: np.random.Generator, pad: int = PAD,
              out: np.ndarray | None = None) -> np.ndarray:
    """NHWC ``images`` padded with ``pad`` zero pixels, each cropped back at an offset drawn from
    ``rng`` and flipped left to right with probability 1/2 (module docstring); into ``out``
    (``images`` itself is fine), else a new array. Draws, in this order, every image's row offset,
    then every column offset, then every flip."""
    n, h, w, c = images.shape
    padded = np.zeros((n, h + 2 * pad, w + 2 * pad, c), images.dtype)
    padded[:, pad:pad + h, pad:pad + w] = images
    dy = rng.integers(0, 2 * pad + 1, n)
    dx = rng.integers(0, 2 * pad + 1, n)
    flip = rng.random(n) < 0.5
    if out is None:
        out = np.empty_like(images)
    # one slice copy per image, rather than one gather through index arrays of n x H x W entries
    for i in range(n):
        crop = padded[i, dy[i]:dy[i] + h, dx[i]:dx[i] + w]
        out[i] = crop[:, ::-1] if flip[i] else crop
    return out


AUGMENTERS = {"crop_flip": crop_flip}  # data.augment -> its function (images, rng, out=...)


@dataclass(frozen=True)
class BatchAugment:
    """The augmentation of one task's minibatches: its ``i``-th is step ``keys[i]``, an
    ``(epoch, step)`` of ``block``."""

    name: str                            # one of AUGMENTS but "none"
    seed: int                            # run.seed
    block: int
    keys: tuple[tuple[int, int], ...]    # (epoch, step) of each minibatch, in training order

    def __call__(self, i: int, images: np.ndarray) -> None:
        """Minibatch ``i``'s gathered images, augmented in place."""
        epoch, step = self.keys[i]
        AUGMENTERS[self.name](images, batch_rng(self.seed, self.block, epoch, step), out=images)


def batch_augment(name: str, seed: int, block: int, keys) -> BatchAugment | None:
    """The :class:`BatchAugment` of ``keys`` under ``data.augment`` = ``name``; None for none."""
    if name == "none":
        return None
    if name not in AUGMENTERS:
        raise BadInput(f"data.augment must be one of {', '.join(AUGMENTS)}, got {name!r}")
    return BatchAugment(name, int(seed), int(block), tuple((int(e), int(s)) for e, s in keys))
