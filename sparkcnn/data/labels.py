"""The label-range check every reader and writer of a split shares."""

from __future__ import annotations

import numpy as np

from sparkcnn.errors import BadInput


def check_labels(path: str, labels: np.ndarray, num_classes: int) -> np.ndarray:
    """``labels`` as int32 when every one is in ``[0, num_classes)``.

    Else BadInput naming the file (or split), the first bad record and its label:
    "train-labels-idx1-ubyte.gz: label 10 at record 2 out of range [0, 10)".
    """
    labels = np.asarray(labels)
    bad = np.flatnonzero((labels < 0) | (labels >= num_classes))
    if bad.size:
        i = int(bad[0])
        raise BadInput(f"{path}: label {int(labels[i])} at record {i} out of range [0, {num_classes})")
    return labels.astype(np.int32, copy=False)
