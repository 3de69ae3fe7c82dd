"""Synchronous data-parallel rounds: one Spark job (mapPartitions + treeAggregate) per round.

Round ``t`` with blocks ``k = 1..N`` and samples ``n_k``::

    S_k = worker_round(W_t, block k, H steps)      # encoded delta, on the executors
    G   = Σ_k (n_k / Σ n) · S_k                     # samples-weighted mean, driver side
    W_{t+1} = W_t − G

The aggregate carries the encoded payloads (concatenated, never densified on
executors); the driver decodes, validates and scatters them into one buffer.
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np

from sparkcnn.compression.warmup import density_at, lr_at
from sparkcnn.errors import CodecError, Diverged
from sparkcnn.worker import RoundOrder, run_block_eval, run_block_round, steps_per_epoch

log = logging.getLogger(__name__)


def _zero():
    return []


def _seq(acc, result):
    acc.append(result)
    return acc


def _comb(a, b):
    a.extend(b)
    return a


class SyncEngine:
    """Drives epochs of synchronous rounds through a backend and a parameter vector ``W``."""

    def __init__(self, cfg, backend, spec, block_rows: dict[int, int], weights: np.ndarray,
                 sink=None, progress=None, run_dir: str | None = None):
        self.cfg = cfg
        self.backend = backend
        self.spec = spec
        self.block_rows = block_rows
        from sparkcnn.compression import Sparsifier
        from sparkcnn.ps import ParameterServer

        c = cfg.compression
        self.sparse_down = c.density_down > 0
        self.ps = ParameterServer(
            np.array(weights, np.float32, copy=True), spec.layout,
            density_down=c.density_down if self.sparse_down else None,
            snapshot_every=cfg.ps.snapshot_every, max_log=cfg.ps.max_log,
            sparsifier=Sparsifier("topk" if c.method == "topk" else "threshold", c.dense_below),
            value_dtype=spec.value_dtype)
        self.run_dir = run_dir         # checkpoints go to run_dir/checkpoints (None: no checkpoints)
        self.initial_states: dict = {}  # block -> state restored from a checkpoint, for the next order
        # balanced sync (scheduler.balance, not pipelined): executor -> measured images/s
        self.balanced = cfg.scheduler.balance and cfg.engine.mode == "sync" and not cfg.engine.pipeline
        self.executor_speed: dict = {}
        self.block_cursor = {k: 0 for k in block_rows}
        self.block_states: dict = {}    # block -> state returned by a checkpoint round
        self.downlinks: list = []      # encoded recent downlinks shipped inline with each task
        self._bcast = None
        self._old_bcasts: list = []
        # older broadcasts (W, or the view U) kept alive: more than the versions that can pass
        # while an order is in flight. Sync: the rounds in flight (1, pipelined 2) plus a spare,
        # so a large model's driver holds a few copies, not a dozen; async: up to max_staleness.
        if cfg.engine.mode == "sync":
            self._keep_bcasts = (2 if cfg.engine.pipeline else 1) + 1
        else:
            self._keep_bcasts = cfg.ps.max_staleness + 2 * max(2, len(block_rows)) + 2
        self.sink = sink
        self.progress = progress
        self.applied: set[tuple[int, int]] = set()
        self.last_state_round: dict[int, int] = {}
        self.counters = {"state_resets": 0, "duplicates_dropped": 0, "rejected_deltas": 0, "replica_resyncs": 0,
                         "stale_states": 0, "loss_spikes": 0}
        self.history: list[dict] = []
        self.last_applied_round: int | None = None   # W holds rounds up to this one
        self.last_recorded_round: int | None = None  # metrics hold rounds (and epochs) up to this one
        self.checkpointed_round: int | None = None   # next_round of the latest checkpoint written
        self._last_done: float | None = None
        self._parallelism = backend.parallelism  # a py4j call on Spark: read once, not per round
        from sparkcnn.guard import DivergenceGuard

        self.guard = DivergenceGuard(cfg.guard.max_norm_factor, cfg.guard.loss_spike_factor)
        self.lr_factor = 1.0        # halved by the guard on a loss spike
        self.density_factor = 1.0   # raised by the guard on a loss spike
        self.epoch_history: list[dict] = []
        H = cfg.train.steps_per_round
        self.block_steps = {k: steps_per_epoch(n, cfg.train.batch_size) for k, n in block_rows.items()}
        self.rounds_per_epoch = max(1, math.ceil(max(self.block_steps.values()) / H))
        self.total_rounds = self.rounds_per_epoch * cfg.train.epochs

    # -- load balancing (sync) ------------------------------------------------------------
    def _sized_steps(self, H: int) -> dict:
        """H per executor so all tasks of a round finish together (``scheduler.size_sync_steps``)."""
        from sparkcnn.scheduler import size_sync_steps

        if not self.executor_speed:
            return {}
        return size_sync_steps(dict(self.executor_speed), H, max_steps=4 * H)

    def _observe_speeds(self, fresh: list[dict]) -> None:
        for r in fresh:
            if r.get("compute_s", 0) > 0 and r["samples"] > 0:
                speed = r["samples"] / r["compute_s"]
                old = self.executor_speed.get(r["executor"])
                # EMA: one noisy round should not swing the split
                self.executor_speed[r["executor"]] = speed if old is None else 0.5 * old + 0.5 * speed
            self.block_cursor[r["block"]] = self.block_cursor.get(r["block"], 0) + r["steps"]

    # -- checkpoints -------------------------------------------------------------------
    def _is_checkpoint_round(self, t: int) -> bool:
        every = self.cfg.checkpoint.every_rounds
        return self.run_dir is not None and ((every and (t + 1) % every == 0)
                                             or (t + 1) % self.rounds_per_epoch == 0)

    def _take_initial_states(self) -> dict:
        states, self.initial_states = self.initial_states, {}
        return states

    def save_checkpoint(self, next_round: int) -> str:
        """W, U, the server log, counters, guard and per-block states after round ``next_round - 1``."""
        from sparkcnn.checkpoint import save_checkpoint

        ps = self.ps.state_dict()
        arrays = {k: v for k, v in ps.items() if isinstance(v, np.ndarray)}
        state = {
            "next_round": next_round,
            "ps": {k: int(v) for k, v in ps.items() if not isinstance(v, np.ndarray)},
            "counters": dict(self.counters), "lr_factor": self.lr_factor,
            "density_factor": self.density_factor, "guard": self.guard.state_dict(),
            "block_cursor": {str(k): v for k, v in self.block_cursor.items()},
            "config": self.cfg.to_dict(),
        }
        path = save_checkpoint(self.run_dir, f"r{next_round:07d}", arrays=arrays, state=state,
                               blocks=dict(self.block_states))
        self.checkpointed_round = next_round
        return path

    def restore(self, ckpt) -> int:
        """Continue from a loaded checkpoint; returns the round to start from."""
        st = ckpt.state
        self.ps.load_state_dict({**ckpt.arrays, **st["ps"]})
        self.counters.update(st["counters"])
        self.lr_factor, self.density_factor = st["lr_factor"], st["density_factor"]
        self.guard.load_state_dict(st["guard"])
        self.block_cursor = {int(k): int(v) for k, v in st.get("block_cursor", {}).items()} or self.block_cursor
        self.initial_states = {int(k): v for k, v in ckpt.blocks.items()}
        nxt = int(st["next_round"])
        self.last_state_round = {k: nxt - 1 for k in self.block_rows}
        self.applied = {(t, k) for t in range(nxt) for k in self.block_rows}
        return nxt

    def _check_loss(self, t: int, loss: float) -> None:
        """Loss spike: act as ``guard.action`` says (halve the lr, raise the density, or stop)."""
        if not self.guard.check_loss(loss):
            return
        action = self.cfg.guard.action
        log.warning("round %s: loss %.4g is a spike; action %s", t, loss, action)
        self.counters["loss_spikes"] += 1
        if action == "stop" or not math.isfinite(loss):
            raise Diverged(f"round {t}: training loss {loss:.4g} diverged (guard.action={action})")
        if action == "halve_lr":
            self.lr_factor *= 0.5
        else:
            self.density_factor = min(1.0 / max(self.cfg.compression.density, 1e-12), self.density_factor * 4)

    @property
    def W(self) -> np.ndarray:
        return self.ps.W

    @property
    def version(self) -> int:
        return self.ps.version

    def _downlink_fields(self) -> dict:
        """Sparse downlink: the last downlinks inline, the dense view as a lazily read broadcast."""
        if not self.sparse_down:
            # dense: W itself, broadcast once per version
            return {"weights_bcast": self._broadcast_at(self.version, self.W)}
        return {"downlinks": tuple(self.downlinks),
                "view": self._broadcast_at(self.ps.view_version, self.ps.U), "view_version": self.ps.view_version}

    def _downlink_bytes(self, order: RoundOrder) -> int:
        """Downlink bytes one task of ``order`` receives (a replica resync's view bytes apart)."""
        return sum(len(d[4]) for d in order.downlinks) if self.sparse_down else self.W.nbytes

    def _broadcast_at(self, version: int, array: np.ndarray):
        """A broadcast of ``array``'s bytes at ``version``, made once per version."""
        if self._bcast is None or self._bcast_version != version:
            if self._bcast is not None:
                # orders still in flight (pipelined round, async jobs) may read an older one:
                # destroy a broadcast only once a few newer ones exist
                self._old_bcasts.append(self._bcast)
                while len(self._old_bcasts) > self._keep_bcasts:
                    self.backend.unpersist(self._old_bcasts.pop(0))
            self._bcast = self.backend.broadcast(array.tobytes())
            self._bcast_version = version
        return self._bcast

    # sync rounds keep every active replica one version behind: the latest D suffices
    inline_downlinks = 1

    def _warmed_density(self, epoch: float, target: float) -> float:
        """``target`` after the exponential density warm-up (``compression.initial_density``,
        ``warmup_epochs``), the same for the uplink and the downlink."""
        c = self.cfg.compression
        return density_at(epoch, initial=max(c.initial_density, target), target=target,
                          warmup_epochs=c.warmup_epochs)

    def _schedule(self, epoch: float) -> tuple[float, float]:
        """(learning rate, uplink density) at a fractional ``epoch`` (sync and async alike),
        warm-ups and the guard's factors included."""
        t, c = self.cfg.train, self.cfg.compression
        lr = lr_at(epoch, base_lr=t.lr, warmup_epochs=t.lr_warmup_epochs, total_epochs=t.epochs,
                   schedule=t.lr_schedule) * self.lr_factor
        density = (1.0 if c.method == "none"
                   else min(1.0, self.density_factor * self._warmed_density(epoch, c.density)))
        return lr, density

    def downlink_density(self, epoch: float) -> float:
        """``compression.density_down`` after the density warm-up: early updates are large and
        dense, and a view that lags them slows training most."""
        return min(1.0, self._warmed_density(epoch, self.cfg.compression.density_down))

    def _send_downlink(self, epoch: float) -> int:
        """After an update: D = sparsify(W - U), U += D; keep the last few for the next orders."""
        from sparkcnn.compression import codec

        dl = self.ps.downlink(self.downlink_density(epoch))
        if dl is None:
            return 0
        enc = codec.encode(dl.delta, self.spec.layout,
                           value_dtype="float32" if dl.assign else self.spec.value_dtype)
        self.downlinks = (list(self.downlinks) + [(dl.version, dl.base_version, dl.checksum_after,
                                                   dl.assign, enc)])[-self.inline_downlinks:]
        return int(dl.delta.nnz)

    # -- one round -----------------------------------------------------------------
    def order_for(self, t: int) -> RoundOrder:
        H = self.cfg.train.steps_per_round
        epoch, r = divmod(t, self.rounds_per_epoch)
        if self.balanced:
            # per-executor H: every block continues from its own cursor, wrapping into its next pass
            steps = {k: H for k in self.block_steps}
            offsets = dict(self.block_cursor)
            by_exec = self._sized_steps(H)
        else:
            steps = {k: max(0, min(H, s - r * H)) for k, s in self.block_steps.items()}
            offsets = {k: epoch * s + r * H for k, s in self.block_steps.items()}
            by_exec = {}
        lr, density = self._schedule(epoch + r / self.rounds_per_epoch)
        return RoundOrder(round=t, epoch=epoch, round_in_epoch=r, steps=steps,
                          step_offset=offsets, steps_by_executor=by_exec, lr=lr,
                          base_version=self.version, expect_state=dict(self.last_state_round),
                          density=density, state_wait_s=5.0 if self.cfg.engine.pipeline else 0.0,
                          return_state=self._is_checkpoint_round(t) and not self.cfg.engine.pipeline,
                          initial_state=self._take_initial_states(), **self._downlink_fields())

    def _job(self, order: RoundOrder):
        """One Spark job: every block's round, reduced by treeAggregate. Runs in a pool thread."""
        spec = self.spec

        def fn(block, attempt):
            return run_block_round(spec, order, block, attempt)

        t0 = time.perf_counter()
        desc = f"sparkcnn {spec.run_id} epoch {order.epoch + 1} round {order.round + 1}"
        results = self.backend.aggregate_blocks(fn, sorted(self.block_rows), _zero, _seq, _comb, desc,
                                                depth=self.cfg.engine.tree_depth,
                                                universe=len(self.block_rows))
        return results, t0, time.perf_counter()

    def run_round(self, t: int) -> dict:
        order = self.order_for(t)
        self.last_state_round = {k: t for k in self.block_rows}
        return self._complete(order, *self._job(order))

    def _complete(self, order: RoundOrder, results, t0: float, t1: float) -> dict:
        """Drop duplicates, apply the round's deltas to W, send the downlink, build the record."""
        t = order.round
        fresh = []
        for res in results:
            key = (res["round"], res["block"])
            if key in self.applied or res["round"] != t:
                self.counters["duplicates_dropped"] += 1
                continue
            self.applied.add(key)
            fresh.append(res)
        total = sum(r["samples"] for r in fresh)
        rec = self._apply(t, order, fresh, total)
        self.last_applied_round = t
        self._observe_speeds(fresh)
        if order.return_state:
            self.block_states = {r["block"]: r["state"] for r in fresh if r.get("state") is not None}
        t2 = time.perf_counter()
        # with pipelining a round's wall time runs from the previous completion to this one
        start = t0 if self._last_done is None else max(t0, self._last_done)
        self._last_done = t2
        rec.update(wall_s=t2 - start, job_s=t1 - t0, apply_s=t2 - t1)
        compute = max((r["task_s"] for r in fresh), default=0.0)
        rec["compute_s"] = max((r["compute_s"] for r in fresh), default=0.0)
        rec["round_overhead_s"] = (t1 - t0) - compute
        rec["images_per_s"] = total / rec["wall_s"] if rec["wall_s"] > 0 else 0.0
        rec["downlink_ratio"] = rec["dense_bytes"] / max(1, rec["bytes_down"])
        slots = max(1, min(len(fresh), self._parallelism))
        busy = sum(r["task_s"] for r in fresh)
        rec["idle_fraction"] = max(0.0, 1.0 - busy / (rec["wall_s"] * slots)) if rec["wall_s"] > 0 else 0.0
        return rec

    def _apply(self, t: int, order: RoundOrder, fresh: list[dict], total: int) -> dict:
        from sparkcnn.compression import codec
        from sparkcnn.compression.sparse_sum import weighted_sum

        layout = self.spec.layout
        good, rejected = [], 0
        for r in fresh:
            if r["samples"] <= 0:
                continue
            try:  # each block's delta is validated alone: a bad one never reaches W, the rest apply
                d = codec.decode(r["payload"], layout)
                why = self.guard.check_delta(d.values, r["steps"])
                if why:
                    raise CodecError(why)
            except CodecError as e:
                log.error("round %s block %s: delta rejected: %s", t, r["block"], e)
                rejected += 1
                self.counters["rejected_deltas"] += 1
                continue
            good.append((r, d))
        if good:
            n_good = sum(r["samples"] for r, _ in good)
            # samples-weighted mean; the per-step (H = 1) DGC form also scales by lr
            G = weighted_sum([d for _, d in good], [r["lr_scale"] * r["samples"] / n_good for r, _ in good],
                             self.W.size)
            if not self.ps.apply(G):
                rejected += len(good)
                self.counters["rejected_deltas"] += len(good)
        nnz_down = (self._send_downlink(order.epoch + order.round_in_epoch / self.rounds_per_epoch)
                    if self.sparse_down else self.W.size)
        down_inline = self._downlink_bytes(order)
        for r in fresh:
            self.counters["state_resets"] += int(r["state_reset"])
            self.counters["stale_states"] += int(r.get("state_stale", False))
            self.counters["replica_resyncs"] += int(r["replica_resync"])
        loss = sum(r["loss_sum"] for r in fresh) / max(1, total)
        self._check_loss(t, loss)
        return {
            "kind": "round", "round": t, "epoch": order.epoch, "round_in_epoch": order.round_in_epoch,
            "lr": order.lr, "version": self.version, "loss": loss,
            "accuracy": sum(r["correct"] for r in fresh) / max(1, total), "samples": total,
            "blocks": len(fresh), "bytes_up": sum(len(r["payload"]) for r in fresh),
            "density": order.density, "nnz_up": sum(r["nnz"] for r in fresh),
            "achieved_density": sum(r["nnz"] for r in fresh) / max(1, self.W.size * len(fresh)),
            "bytes_per_nonzero": sum(len(r["payload"]) for r in fresh) / max(1, sum(r["nnz"] for r in fresh)),
            # measured: inline downlink bytes per task + broadcast bytes each replica read
            "bytes_down": down_inline * len(fresh) + sum(r["view_bytes"] for r in fresh),
            "nnz_down": nnz_down, "replica_resyncs": sum(int(r["replica_resync"]) for r in fresh),
            "dense_bytes": 4 * self.W.size * len(fresh),
            "uplink_ratio": 4 * self.W.size * len(fresh) / max(1, sum(len(r["payload"]) for r in fresh)),
            "task_compute_s": {str(r["block"]): round(r["compute_s"], 4) for r in fresh},
            "task_prep_s": {str(r["block"]): round(r["prep_s"], 4) for r in fresh},
            "task_encode_s": {str(r["block"]): round(r["encode_s"], 4) for r in fresh},
            "task_pids": {str(r["block"]): r["pid"] for r in fresh},
            "rejected": rejected,
            "state_resets": sum(int(r["state_reset"]) for r in fresh),
        }

    # -- evaluation and epochs ------------------------------------------------------
    def evaluate(self, epoch: int) -> dict:
        spec, weights = self.spec, self.W.tobytes()

        def fn(block, attempt):
            return run_block_eval(spec, weights, block)

        desc = f"sparkcnn {spec.run_id} epoch {epoch + 1} evaluate"
        res = self.backend.map_blocks(fn, list(range(spec.test_blocks)), desc, universe=spec.test_blocks)
        n = sum(r["samples"] for r in res)
        return {"test_loss": sum(r["loss_sum"] for r in res) / max(1, n),
                "test_accuracy": sum(r["correct"] for r in res) / max(1, n), "test_samples": n}

    def run(self, start_round: int = 0, on_epoch=None) -> dict:
        """Run rounds ``start_round..total``; with ``engine.pipeline`` two rounds are in flight.

        Pipelined: round t+1 is computed from the weights before round t is
        applied (bounded staleness 1) while the driver aggregates round t, so
        executors do not idle through the driver's share of a round.
        """
        from concurrent.futures import ThreadPoolExecutor
        from collections import deque

        t_start = time.perf_counter()
        depth = 2 if self.cfg.engine.pipeline else 1
        inflight: deque = deque()
        next_t = start_round
        with ThreadPoolExecutor(max_workers=depth, thread_name_prefix="sparkcnn-round") as pool:
            try:
                while next_t < self.total_rounds or inflight:
                    while next_t < self.total_rounds and len(inflight) < depth:
                        order = self.order_for(next_t)
                        # the next round on this block starts from this round's state
                        self.last_state_round = {k: next_t for k in self.block_rows}
                        mark = self.backend.job_mark() if depth > 1 else None
                        inflight.append((order, pool.submit(self._job, order)))
                        if mark is not None and not self.backend.wait_job_after(mark):
                            log.warning("round %s: job not registered within 30 s", next_t)
                        next_t += 1
                    order, fut = inflight.popleft()
                    rec = self._complete(order, *fut.result())
                    t = order.round
                    self._record(rec, t, t_start, on_epoch)
            except BaseException as e:
                for _, fut in inflight:
                    fut.cancel()
                self.backend.stop()
                if isinstance(e, KeyboardInterrupt):
                    self._checkpoint_on_interrupt()
                raise
        return self.summary(time.perf_counter() - t_start)

    def _checkpoint_on_interrupt(self) -> None:
        """Ctrl-C: keep the rounds done so far (``--resume`` continues after the last one).

        Only when the weights hold exactly the recorded rounds; block states not
        collected since the last regular checkpoint restart from zero on resume
        (counted as ``state_resets``).
        """
        t = self.last_recorded_round
        if self.run_dir is None or t is None or t != self.last_applied_round:
            return
        if self.checkpointed_round == t + 1:
            return  # written right after that round
        try:
            path = self.save_checkpoint(t + 1)
            log.warning("interrupted after round %s: checkpoint %s written (continue with --resume)", t, path)
        except Exception:
            log.warning("interrupted after round %s: checkpoint failed", t, exc_info=True)

    def _record(self, rec: dict, t: int, t_start: float, on_epoch) -> None:
        self.history.append(rec)
        if self.sink:
            self.sink.write(rec)
        epoch_end = (t + 1) % self.rounds_per_epoch == 0
        if not epoch_end:  # else only once its epoch record is written (a resume keeps that epoch's)
            self.last_recorded_round = t
        if self.progress:
            self.progress.round(rec, self.total_rounds)
        if epoch_end:
            self._epoch_record(t, t_start, on_epoch)
            self.last_recorded_round = t
        if self._is_checkpoint_round(t):
            self.save_checkpoint(t + 1)
            self.block_states = {}
        if self.cfg.chaos.kill_driver_round == t:  # fault drill: die right after this round
            import os
            import signal

            log.warning("chaos: SIGKILL of the driver after round %s", t)
            os.kill(os.getpid(), signal.SIGKILL)

    def _epoch_record(self, t: int, t_start: float, on_epoch) -> None:
        self._write_epoch(t // self.rounds_per_epoch, t_start, on_epoch)

    def _write_epoch(self, epoch: int, t_start: float, on_epoch, **extra) -> None:
        """Evaluate on the test blocks and write the epoch record (sync and async alike)."""
        ev = self.evaluate(epoch)
        rounds = [h for h in self.history if h.get("epoch") == epoch]
        erec = {"kind": "epoch", "epoch": epoch, **ev,
                "train_loss": float(np.mean([h["loss"] for h in rounds])) if rounds else None,
                "wall_s": time.perf_counter() - t_start,
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
            **self.counters,
        }
