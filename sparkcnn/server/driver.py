"""RoundDriver: the Spark-free half of a run, shared by every engine.

It holds the parameter server (``W``, ``U``, the version), the schedule (lr
and both density warm-ups, with the guard's factors), the downlink and its
broadcasts (through the injected :class:`~sparkcnn.backends.backend.Backend`),
the path every result takes to ``W``::

    dedup (seq, block)  ->  decode + guard  ->  W -= Σ_k w_k S_k   (server/apply.py, one call per exchange)

checkpoints and restore, records and evaluation. What an arrived result does
(staleness, drop, λ(τ)/N, cursor, record) is :mod:`sparkcnn.server.exchange`'s;
the transports decide only *when* exchanges happen.
"""

from __future__ import annotations

import logging
import math
import os
import time

import numpy as np

from sparkcnn.compression import codec
from sparkcnn.compression.feedback import server_scale
from sparkcnn.compression.plan import density as plan_density
from sparkcnn.compression.plan import plan
from sparkcnn.compression.sparsify import Sparsifier
from sparkcnn.compression.warmup import density_at, lr_at
from sparkcnn.server.apply import Applied, apply_deltas
from sparkcnn.errors import Diverged
from sparkcnn.guard import DivergenceGuard
from sparkcnn.protocol import DownlinkMsg, RoundResult
from sparkcnn.ps import ParameterServer

log = logging.getLogger(__name__)

COUNTERS = ("state_resets", "duplicates_dropped", "rejected_deltas", "replica_resyncs", "stale_states",
            "loss_spikes", "losses_at_chance", "stale_dropped")


class RoundDriver:
    """Server state and the apply path of one run (see the module docstring)."""

    def __init__(self, cfg, backend, spec, weights: np.ndarray, *, keep_broadcasts: int, evaluate,
                 sink=None, progress=None, run_dir: str | None = None):
        self.cfg, self.backend, self.spec = cfg, backend, spec
        self.evaluator = evaluate  # (W, epoch) -> test loss, accuracy and samples: the transport's job
        c = cfg.compression
        self.plan = plan(c.method, c.value_dtype, cfg.train.steps_per_round)
        self.sparse_down = spec.sparse_downlink
        self.ps = ParameterServer(
            np.array(weights, np.float32, copy=True), spec.layout,
            density_down=c.density_down if self.sparse_down else None,
            sparsifier=Sparsifier(self.plan.selector, c.dense_below),
            value_dtype=spec.value_dtype)
        self.guard = DivergenceGuard(cfg.guard.max_norm_factor, cfg.guard.loss_spike_factor,
                                     loss_samples=cfg.guard.loss_samples, warmup_steps=cfg.guard.warmup_steps,
                                     chance_loss=math.log(spec.num_classes) if spec.num_classes > 1 else None)
        self.shards = None          # ps.shards > 1: the ShardCoordinator the stream engine starts
        self.lr_factor = 1.0        # halved by the guard on a loss spike
        self.density_factor = 1.0   # raised by the guard on a loss spike
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.applied: set[tuple[int, int]] = set()   # (seq, block) of results taken, exactly once
        self.history: list[dict] = []                 # exchange records
        self.epoch_history: list[dict] = []
        self.executors: dict[str, int] = {}           # executor -> training results it delivered
        self.sink, self.progress, self.run_dir = sink, progress, run_dir
        self.checkpointed_at: int | None = None       # the position of the latest checkpoint written
        # downlink: the latest DownlinkMsgs ship inline; dense bytes (W, or the view U) as
        # one broadcast per version. Older broadcasts stay alive while orders in flight may
        # read them: ``keep_broadcasts`` of them, then the oldest is destroyed.
        self.downlinks: list[DownlinkMsg] = []
        self.inline_downlinks = 1
        self.keep_broadcasts = keep_broadcasts
        self._bcast = None
        self._bcast_version = -1
        self._old_bcasts: list = []

    @property
    def W(self) -> np.ndarray:
        return self.ps.W

    @property
    def version(self) -> int:
        return self.ps.version if self.shards is None else self.shards.version

    # -- schedule ---------------------------------------------------------------------------
    def _warmed_density(self, epoch: float, target: float, initial: float | None = None) -> float:
        """``target`` after the exponential density warm-up from ``initial`` (default
        ``compression.initial_density``) over ``warmup_epochs``."""
        c = self.cfg.compression
        return density_at(epoch, initial=max(initial or c.initial_density, target), target=target,
                          warmup_epochs=c.warmup_epochs)

    def schedule(self, epoch: float) -> tuple[float, float]:
        """(learning rate, uplink density) at a fractional ``epoch``, warm-ups and guard included."""
        t, c = self.cfg.train, self.cfg.compression
        lr = lr_at(epoch, base_lr=t.lr, warmup_epochs=t.lr_warmup_epochs, total_epochs=t.epochs,
                   schedule=t.lr_schedule) * self.lr_factor
        density = plan_density(self.plan, self.density_factor * self._warmed_density(epoch, c.density))
        return lr, density

    def downlink_density(self, epoch: float) -> float:
        """``compression.density_down`` after the density warm-up, which starts at
        ``initial_density_down`` (0: ``initial_density``): early updates are large and dense,
        and a view that lags them slows training most; but a replica takes a downlink per push
        of every block, so a start below the uplink's keeps a slow link's downlink in step."""
        c = self.cfg.compression
        return min(1.0, self._warmed_density(epoch, c.density_down, c.initial_density_down))

    # -- downlink ---------------------------------------------------------------------------
    def order_weights(self) -> dict:
        """The weights fields of the next order: W (dense) or the view U and the latest downlinks."""
        if not self.sparse_down:
            return {"weights": self._broadcast_at(self.version, self.W), "weights_version": self.version}
        v = self.ps.view_version
        return {"weights": self._broadcast_at(v, self.ps.U), "weights_version": v,
                "downlinks": tuple(self.downlinks)}

    def _broadcast_at(self, version: int, array: np.ndarray):
        """A broadcast of ``array``'s bytes at ``version``, made once per version."""
        if self._bcast is None or self._bcast_version != version:
            if self._bcast is not None:
                self._old_bcasts.append(self._bcast)
                while len(self._old_bcasts) > self.keep_broadcasts:
                    self.backend.unpersist(self._old_bcasts.pop(0))
            self._bcast = self.backend.broadcast(array.tobytes())
            self._bcast_version = version
        return self._bcast

    def send_downlink(self, epoch: float, every: int = 1) -> int:
        """After an update: D = sparsify(W − U), U += D; keep the latest for the next orders.
        Returns the entries of D (P for the dense downlink, which ships W itself). ``every``:
        only once the view is that many versions behind (0 entries until then)."""
        if not self.sparse_down:
            return int(self.W.size)
        if self.shards is not None:  # the shards make it (its entries are theirs to count)
            if self.shards.version - self.shards.view_version >= every:
                self.shards.downlink(self.downlink_density(epoch))
            return 0
        if self.ps.version - self.ps.view_version < every:
            return 0
        dl = self.ps.downlink(self.downlink_density(epoch))
        if dl is None:
            return 0
        enc = codec.encode(dl.delta, self.spec.layout,
                           value_dtype="float32" if dl.assign else self.spec.value_dtype)
        msg = DownlinkMsg(version=dl.version, base_version=dl.base_version, checksum_after=dl.checksum_after,
                          assign=dl.assign, payload=enc)
        self.downlinks = (self.downlinks + [msg])[-self.inline_downlinks:]
        return int(dl.delta.nnz)

    # -- results ----------------------------------------------------------------------------
    def take_fresh(self, results: list[RoundResult], seq: int | None = None) -> list[RoundResult]:
        """Results not taken before (exactly once per (seq, block)); duplicates are counted.
        With ``seq``, a result of another exchange counts as a duplicate too."""
        fresh = []
        for r in results:
            key = (r.seq, r.block)
            if key in self.applied or (seq is not None and r.seq != seq):
                self.counters["duplicates_dropped"] += 1
                continue
            self.applied.add(key)
            fresh.append(r)
            self.executors[r.executor] = self.executors.get(r.executor, 0) + 1
        return fresh

    def apply(self, results: list[RoundResult], lr: float, factor: float = 1.0) -> Applied:
        """``W −= Σ_k factor·s(lr)·(n_k / Σ n)·S_k`` over the results that decode and pass the guard
        (``s(lr)``: the momentum policy's server scale). Each rejected one is logged and counted."""
        scale = factor * server_scale(self.spec.method, self.spec.momentum_mode, self.spec.per_step, lr)
        if self.shards is not None:  # ps.shards > 1: judged here, applied by the shards
            out = self.shards.apply(results, scale, self.guard)
        else:
            out = apply_deltas(self.ps, [r.payload for r in results], [r.samples for r in results],
                               [scale] * len(results), guard=self.guard, steps=[r.steps for r in results])
        for k, why in sorted(out.rejected.items()):
            log.error("exchange %s block %s: delta rejected: %s", results[k].seq, results[k].block, why)
        self.counters["rejected_deltas"] += len(out.rejected)
        return out

    def count_flags(self, results: list[RoundResult]) -> None:
        for r in results:
            self.counters["state_resets"] += int(r.state_reset)
            self.counters["stale_states"] += int(r.state_stale)
            self.counters["replica_resyncs"] += int(r.replica_resync)

    def check_loss(self, tag: str, loss: float, samples: int | None = None) -> None:
        """Loss spike: act as ``guard.action`` says (halve the lr, raise the density, or stop).
        A loss back at chance level after the model had learned (the guard's chance rule) takes
        no action; ``guard.max_chance_in_a_row`` of them in a row stop the run (exit 3).
        ``samples``: the exchange's; the guard pools exchanges to ``guard.loss_samples``."""
        g, limit = self.guard, self.cfg.guard.max_spikes_in_a_row
        if not g.check_loss(loss, samples):
            if g.at_chance_now:
                chance = (f"{g.judged:.4g}, at or above chance level (ln {self.spec.num_classes} = "
                          f"{g.chance_loss:.4g}) after {g.best:.4g}")
                log.warning("%s: training loss %s", tag, chance)
                self.counters["losses_at_chance"] += 1
                at_most = self.cfg.guard.max_chance_in_a_row
                if at_most and g.chance_in_a_row >= at_most:
                    raise Diverged(f"{tag}: training loss {chance}, {g.chance_in_a_row} judgments in a row: "
                                   f"the run collapsed (guard.max_chance_in_a_row={at_most})")
            return
        action, judged = self.cfg.guard.action, g.judged  # the pooled mean, not this exchange's
        log.warning("%s: loss %.4g is a spike; action %s", tag, judged, action)
        self.counters["loss_spikes"] += 1
        if action == "stop" or not math.isfinite(judged):
            raise Diverged(f"{tag}: training loss {judged:.4g} diverged (guard.action={action})")
        if limit and g.in_a_row >= limit:
            raise Diverged(f"{tag}: training loss {judged:.4g} spiked in {g.in_a_row} judgments in a row "
                           f"despite guard.action={action}: the run collapsed (guard.max_spikes_in_a_row={limit})")
        if action == "halve_lr":
            self.lr_factor *= 0.5
        else:
            self.density_factor = min(1.0 / max(self.cfg.compression.density, 1e-12), self.density_factor * 4)

    # -- checkpoints ------------------------------------------------------------------------
    def save_checkpoint(self, position: int, engine_state: dict, blocks: dict) -> str:
        """W, U, counters, guard, the engine's own state and per-block states, as checkpoint
        ``r<position>``; ``records`` = metrics lines that the checkpoint covers."""
        from sparkcnn.checkpoint import save_checkpoint

        ps = self.ps.state_dict()
        state = {
            "position": position,
            "ps": {k: int(v) for k, v in ps.items() if not isinstance(v, np.ndarray)},
            "counters": dict(self.counters), "lr_factor": self.lr_factor,
            "density_factor": self.density_factor, "guard": self.guard.state_dict(),
            "records": len(self.history) + len(self.epoch_history),
            "engine": engine_state, "config": self.cfg.to_dict(),
        }
        if hasattr(self.sink, "flush"):  # the records the checkpoint covers are stored first
            self.sink.flush()
        path = save_checkpoint(self.run_dir, f"r{position:07d}",
                               arrays={k: v for k, v in ps.items() if isinstance(v, np.ndarray)},
                               state=state, blocks=blocks)
        self.checkpointed_at = position
        return path

    def restore(self, ckpt) -> dict:
        """Server, counters and guard from a loaded checkpoint; returns the engine's own state."""
        st = ckpt.state
        self.ps.load_state_dict({**ckpt.arrays, **st["ps"]})
        self.counters.update(st["counters"])
        self.lr_factor, self.density_factor = st["lr_factor"], st["density_factor"]
        self.guard.load_state_dict(st["guard"])
        self.checkpointed_at = int(st["position"])
        return st["engine"]

    # -- records, evaluation, summary -------------------------------------------------------
    def record(self, rec: dict) -> None:
        self.history.append(rec)
        if self.sink:
            self.sink.write(rec)

    def evaluate(self, epoch: int) -> dict:
        """Test loss and accuracy of ``W``, by the transport's evaluation (``evaluate``)."""
        return self.evaluator(self.W, epoch)

    def write_epoch(self, epoch: int, wall_s: float, on_epoch=None, **extra) -> dict:
        """Evaluate on the test blocks and write the epoch record."""
        ev = self.evaluate(epoch)
        rounds = [h for h in self.history if h.get("epoch") == epoch]
        erec = {"kind": "epoch", "epoch": epoch, **ev,
                "train_loss": float(np.mean([h["loss"] for h in rounds])) if rounds else None,
                "wall_s": wall_s,
                "bytes_up": sum(h["bytes_up"] for h in rounds),
                "bytes_down": sum(h["bytes_down"] for h in rounds),
                **extra, **self.counters}
        self.epoch_history.append(erec)
        if self.sink:
            self.sink.write(erec)
        if self.progress:
            self.progress.epoch(erec)
        if on_epoch:
            on_epoch(erec)
        return erec

    def chaos_kill(self, seq: int) -> None:
        """Fault drills: SIGKILL this driver (``chaos.kill_driver_round``), or its last shard
        process (``chaos.kill_shard_round``), right after exchange ``seq``."""
        import signal

        if self.cfg.chaos.kill_driver_round == seq:
            log.warning("chaos: SIGKILL of the driver after exchange %s", seq)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.cfg.chaos.kill_shard_round == seq and self.shards is not None:
            log.warning("chaos: SIGKILL of shard %s after exchange %s", len(self.shards.procs) - 1, seq)
            self.shards.procs[-1].proc.kill()

    def summary(self, wall_s: float) -> dict:
        h = self.history
        last = self.epoch_history[-1] if self.epoch_history else {}
        samples = sum(r["samples"] for r in h)
        return {
            "rounds": len(h), "epochs": len(self.epoch_history), "wall_s": wall_s,
            "test_accuracy": last.get("test_accuracy"), "test_loss": last.get("test_loss"),
            "accuracy_per_epoch": [e["test_accuracy"] for e in self.epoch_history],
            "images_per_s": samples / wall_s if wall_s > 0 else 0.0,
            "bytes_up": sum(r["bytes_up"] for r in h), "bytes_down": sum(r["bytes_down"] for r in h),
            "dense_bytes_up": sum(r["dense_bytes"] for r in h),
            "dense_bytes_down": sum(r["dense_bytes"] for r in h),
            "mean_round_overhead_ms": 1000 * float(np.mean([r["round_overhead_s"] for r in h])) if h else 0.0,
            "mean_round_compute_ms": 1000 * float(np.mean([r["compute_s"] for r in h])) if h else 0.0,
            "executors": sorted(self.executors),
            "executor_tasks": dict(sorted(self.executors.items())),
            **self.counters,  # the guard's among them: rejected_deltas, loss_spikes
            # what the guard's actions on those spikes left: the lr and density multipliers
            "guard_lr_factor": self.lr_factor, "guard_density_factor": self.density_factor,
        }


class DriverShorthands:
    """``W``, ``version``, ``counters`` and ``history`` of an engine's ``self.driver``
    (for callers: train, benchmarks, tests)."""

    driver: RoundDriver

    @property
    def W(self):
        return self.driver.W

    @property
    def version(self) -> int:
        return self.driver.version

    @property
    def counters(self) -> dict:
        return self.driver.counters

    @property
    def history(self) -> list:
        return self.driver.history


def timed(fn, *args, **kwargs):
    """(fn(*args, **kwargs), start, end) in perf_counter seconds."""
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, t0, time.perf_counter()
