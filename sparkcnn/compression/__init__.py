"""Sparse communication: selection, error feedback, momentum, warm-up, wire codec, sums.

numpy and the standard library, plus numba for two compiled loops of the
driver's decode+sum (native.py, loaded on first use). A test checks that
importing this package pulls in neither pyspark nor tensorflow.
"""

from .codec import decode, encode
from .codec_frame import DecodedParts, decode_parts
from .delta import Layout, SparseDelta, layout_offsets
from .feedback import (
    DGCMomentum,
    ErrorFeedback,
    SparsificationAwareMomentum,
    make_policy,
    mask_momentum,
    quantise,
    server_scale,
)
from .sparse_sum import DecodedBatch, decode_batch, weighted_sum
from .sparsify import Sparsifier, target_count, threshold_indices, topk_indices
from .warmup import density_at, lr_at

__all__ = [
    "DGCMomentum",
    "DecodedBatch",
    "DecodedParts",
    "ErrorFeedback",
    "Layout",
    "SparseDelta",
    "SparsificationAwareMomentum",
    "Sparsifier",
    "decode",
    "decode_batch",
    "decode_parts",
    "density_at",
    "encode",
    "layout_offsets",
    "lr_at",
    "make_policy",
    "mask_momentum",
    "quantise",
    "server_scale",
    "target_count",
    "threshold_indices",
    "topk_indices",
    "weighted_sum",
]
