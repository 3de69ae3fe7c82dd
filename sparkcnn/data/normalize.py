"""Which per-channel statistics the model normalises its input by (``data.normalize``).

``dataset``: the training split's own mean and standard deviation, in [0, 1] units (pixel / 255),
which ``sparkcnn prepare`` stores in a prepared dataset's metadata (``sparkcnn.mean``,
``sparkcnn.std``). The normalisation itself is the model's first layer
(:func:`sparkcnn.models.build_model`), so that evaluation, prediction and a saved model apply it
as training did. numpy-free: plain floats.
"""

from __future__ import annotations

import math

from sparkcnn.errors import BadInput

NORMALIZE = ("none", "dataset")  # data.normalize


def normalization(setting: str, stats, origin: str,
                  channels: int) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """(mean, std) per channel, in [0, 1] units, for ``data.normalize`` = ``setting``; None for none.

    ``dataset``: the training set's own statistics, ``stats`` = (mean, std) from a prepared
    dataset's metadata, one value for each of the images' ``channels``; refused, naming
    ``origin``, when the data has none (any other input), or a channel has no spread (nothing
    to divide by)."""
    if setting == "none":
        return None
    if setting not in NORMALIZE:
        raise BadInput(f"data.normalize must be one of {', '.join(NORMALIZE)}, got {setting!r}")
    if not stats or not stats[0] or not stats[1]:
        raise BadInput(f"data.normalize=dataset: {origin} stores no per-channel mean and std (prepare it "
                       "with 'sparkcnn prepare', or set data.normalize=none)")
    mean, std = (tuple(float(v) for v in s) for s in stats)
    if not len(mean) == len(std) == channels or not all(math.isfinite(v) for v in (*mean, *std)):
        raise BadInput(f"data.normalize=dataset: {origin}: bad per-channel statistics (mean {list(mean)}, "
                       f"std {list(std)})")
    flat = [i for i, s in enumerate(std) if s <= 0]
    if flat:
        raise BadInput(f"data.normalize=dataset: {origin}: channel {flat[0]} has standard deviation 0")
    return mean, std
