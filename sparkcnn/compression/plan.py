"""What ``compression.method`` means for a run, decided in one place.

    none                -> dense float32 deltas, density 1, no error feedback
    threshold | topk    -> sparse deltas at the scheduled density, ``value_dtype`` on the wire;
                           with H = 1 the per-step (gradient) form of the momentum policy
    the server's downlink selection follows the uplink's: exact top-k for ``topk``,
    the sampled threshold otherwise
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Plan:
    method: str          # none | threshold | topk
    dense: bool          # method none: every entry travels, at density 1
    value_dtype: str     # wire dtype of uplink values: float32 when dense
    per_step: bool       # sparse and H = 1: workers send momentum-corrected gradients
    selector: str        # the parameter server's downlink sparsifier: topk | threshold


def plan(method: str, value_dtype: str, steps_per_round: int) -> Plan:
    dense = method == "none"
    return Plan(method=method, dense=dense, value_dtype="float32" if dense else value_dtype,
                per_step=not dense and steps_per_round == 1,
                selector="topk" if method == "topk" else "threshold")


def density(p: Plan, scheduled: float) -> float:
    """The uplink density a round uses: 1 when dense, else the scheduled one (at most 1)."""
    return 1.0 if p.dense else min(1.0, scheduled)
