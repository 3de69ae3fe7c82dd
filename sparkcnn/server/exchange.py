"""What an arrived result does: the exchange rules, owned once for every transport (DESIGN §10).

The jobs transport hands it Spark job results, the stream typed pushes; neither
applies, counts or records by itself::

    accept(r)                ASGD, one block's result as it arrives:
        dedup (seq, block)  ->  tau = version_now - r.base_version
        tau > ps.max_staleness:  dropped (stale_dropped); the block's cursor stays and its key
                                 is free again, so it trains those steps again, from its state
                                 before them and a dense view (``resync``)
        else:  W -= lambda(tau) * s(r.lr) * S_k / N;  cursor += r.steps;  record
               downlink once every c = ceil(N / 2) applied results (version - view_version >= c)

    accept_round(rs, seq)    BSP, every block's result of round ``seq`` together:
        dedup (seq, block)  ->  W -= sum_k (n_k / sum n) * s(r.lr) * S_k;  downlink;  cursors;  record

``s(lr)`` is the momentum policy's server scale (``compression.feedback.server_scale``);
the lr and density are those the result was trained with (it carries them), so nothing
reads the schedule again.

Why the ASGD downlink has a cadence: every replica follows every downlink, so a block
that pushes once while the N - 1 others push receives about N downlinks per reply. With
a downlink per result, each block would receive N · density_down · P entries per push
(measured with ``bench/psload.py`` at 64 blocks: ~0.6 MB per reply, 210 pushes/s and
4.3 ms of server CPU per push), where the seeds' GS-ASGD sends each worker the top
``density_down`` of the accumulated update per push. One downlink per ceil(N / 2)
results keeps a reply at about two downlinks whatever N, and spreads their selection
over the results between them; at N <= 2 it is a downlink per result, as before.

Every (block, epoch, step) is applied exactly once: a result moves its block's cursor
only when it is applied, and a dropped one is trained again over the same steps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sparkcnn.checkpoint import int_keys, json_keys
from sparkcnn.protocol import RoundResult
from sparkcnn.staleness import held_back, staleness_scale

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    """What ``accept`` did with a result."""

    applied: bool            # the result reached W
    dropped: bool            # too stale: not applied, its block trains those steps again
    tau: int                 # its staleness (versions applied since its base version)
    record: dict | None      # the exchange record (applied only); the transport adds its timings
    results: tuple = ()      # the results it applied


class ExchangeCore:
    """Block cursors, counters and the accept rules of one run (module docstring)."""

    STATE = ("block_epoch", "block_step", "last_seq", "staleness_hist")  # int-keyed, checkpointed

    def __init__(self, driver, block_steps: dict[int, int], *, staleness_rule: str, batch_size: int):
        self.driver = driver
        self.block_steps = dict(block_steps)           # steps in a block's pass over its data
        self.num_blocks = len(block_steps)
        self.rule = staleness_rule
        self.max_staleness = driver.cfg.ps.max_staleness
        self.n_train = sum(self.block_steps.values()) * batch_size  # samples in one epoch
        self.block_epoch = {k: 0 for k in block_steps}  # passes each block has completed
        self.block_step = {k: 0 for k in block_steps}   # minibatches into its current pass
        self.last_seq = {k: -1 for k in block_steps}    # the block's last applied exchange (its state's tag)
        self.staleness_hist: dict[int, int] = {}
        self.resync: set[int] = set()                   # blocks whose next work starts from a dense view
        self.samples_done = 0
        self.exchanges = 0                              # applied exchanges (records of kind "round")
        self.downlink_every = -(-self.num_blocks // 2)  # ASGD: results per downlink (module docstring)

    @property
    def epoch_float(self) -> float:
        return self.samples_done / max(1, self.n_train)

    def cursor(self, block: int) -> int:
        """Minibatches ``block`` has had applied since the run began (its next step's index)."""
        return self.block_epoch[block] * self.block_steps[block] + self.block_step[block]

    # -- the rules ----------------------------------------------------------------------------
    def accept(self, r: RoundResult, inline_bytes: int = 0, pass_end: int | None = None) -> Outcome | None:
        """ASGD: apply one block's result as it arrives (module docstring); None for a duplicate.
        ``inline_bytes``: downlink bytes its order carried; ``pass_end``: the step at which the
        block's pass ends (default: its whole block)."""
        d = self.driver
        if r.seq <= self.last_seq[r.block]:  # the block has moved past it: a duplicate
            d.counters["duplicates_dropped"] += 1
            return None
        if not d.take_fresh([r]):
            return None
        tau = d.version - r.base_version
        self.staleness_hist[tau] = self.staleness_hist.get(tau, 0) + 1
        if held_back(tau, self.max_staleness):
            d.counters["stale_dropped"] += 1
            d.applied.discard((r.seq, r.block))  # not applied: the same steps come again
            self.resync.add(r.block)
            log.warning("exchange %s block %s: staleness %s > ps.max_staleness %s; dropped, trained again",
                        r.seq, r.block, tau, self.max_staleness)
            return Outcome(applied=False, dropped=True, tau=tau, record=None)
        self.resync.discard(r.block)
        scale = staleness_scale(tau, self.rule) / self.num_blocks
        out = d.apply([r], r.lr, factor=scale)
        nnz_down = d.send_downlink(self.epoch_float, every=self.downlink_every)
        rec = {"kind": "round", "round": self.exchanges, "seq": r.seq, "block": r.block,
               "block_epoch": self.block_epoch[r.block], "block_step": self.block_step[r.block],
               "staleness": tau, "scale": scale, "steps": r.steps,
               **self._record([r], out, nnz_down, inline_bytes)}
        self._advance(r, pass_end)
        self._close(rec)
        return Outcome(applied=True, dropped=False, tau=tau, record=rec, results=(r,))

    def accept_round(self, results: list[RoundResult], seq: int, inline_bytes: int = 0,
                     pass_end: int | None = None) -> Outcome:
        """BSP: apply round ``seq``'s fresh results together, samples-weighted (module docstring).
        A result of another round counts as a duplicate."""
        d = self.driver
        fresh = d.take_fresh(results, seq=seq)
        tau = max((d.version - r.base_version for r in fresh), default=0)
        lr = fresh[0].lr if fresh else 0.0
        out = d.apply(fresh, lr)
        nnz_down = d.send_downlink(self.epoch_float)
        rec = {"kind": "round", "round": self.exchanges, "seq": seq,
               "steps": max((r.steps for r in fresh), default=0), "staleness": tau,
               **self._record(fresh, out, nnz_down, inline_bytes)}
        for r in fresh:
            self._advance(r, pass_end)
        self._close(rec)
        return Outcome(applied=bool(fresh), dropped=False, tau=tau, record=rec, results=tuple(fresh))

    # -- shared pieces ------------------------------------------------------------------------
    def _advance(self, r: RoundResult, pass_end: int | None) -> None:
        """An applied result moves its block's cursor by its steps, and the samples done."""
        end = self.block_steps[r.block] if pass_end is None else pass_end
        self.last_seq[r.block] = r.seq
        self.samples_done += r.samples
        self.block_step[r.block] += r.steps
        if self.block_step[r.block] >= end:
            self.block_epoch[r.block] += 1
            self.block_step[r.block] = 0

    def _close(self, rec: dict) -> None:
        """Counters and the loss check of an applied exchange."""
        self.exchanges += 1
        self.driver.check_loss(f"exchange {rec['round']}", rec["loss"], rec["samples"])

    def _record(self, results: list[RoundResult], out, nnz_down: int, inline_bytes: int) -> dict:
        """The record fields of every exchange: lr and density it trained with, loss, traffic."""
        d = self.driver
        d.count_flags(results)
        n = int(d.W.size)
        samples = sum(r.samples for r in results)
        up = sum(len(r.payload) for r in results)
        nnz_up = sum(r.nnz for r in results)
        down = inline_bytes * len(results) + sum(r.view_bytes for r in results)
        dense = 4 * n * len(results)
        return {
            "lr": results[0].lr if results else 0.0, "density": results[0].density if results else 0.0,
            "version": d.version, "samples": samples, "blocks": len(results),
            "loss": sum(r.loss_sum for r in results) / max(1, samples),
            "accuracy": sum(r.correct for r in results) / max(1, samples),
            "bytes_up": up, "nnz_up": nnz_up,
            "achieved_density": nnz_up / max(1, n * len(results)), "bytes_per_nonzero": up / max(1, nnz_up),
            # measured: inline downlink bytes per task + the dense bytes each task read
            "bytes_down": down, "nnz_down": nnz_down, "dense_bytes": dense,
            "uplink_ratio": dense / max(1, up), "downlink_ratio": dense / max(1, down),
            "rejected": len(out.rejected) if out else 0,
            "state_resets": sum(int(r.state_reset) for r in results),
            "replica_resyncs": sum(int(r.replica_resync) for r in results),
        }

    # -- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"samples_done": self.samples_done, "exchanges": self.exchanges,
                "resync": sorted(self.resync), **{k: json_keys(getattr(self, k)) for k in self.STATE}}

    def load_state_dict(self, st: dict) -> None:
        self.samples_done, self.exchanges = int(st["samples_done"]), int(st["exchanges"])
        self.resync = {int(k) for k in st.get("resync", ())}
        for k in self.STATE:
            setattr(self, k, int_keys(st[k]))
