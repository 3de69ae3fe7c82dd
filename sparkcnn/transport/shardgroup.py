"""The driver's side of ``ps.shards`` > 1: the K shard processes, the server's version counters
and the ordered log (:mod:`sparkcnn.shards` has the scheme).

The exchange core decides as with one server; only the data moves elsewhere::

    apply(results, factor)   the guard on sqrt(sum_k sumsq_k) per result, in the core's order;
                             the good ones bump the version once, as apply_deltas does
    downlink(density)        a downlink is due: the view's version moves to the server's
    step(answers)            what the core just decided, as one ShardStep per shard (each with
                             its pieces' declared norms), sent to every shard in the same order
    refresh(ps)              a consistent cut of every shard, into the driver's full W and U
                             (evaluation, checkpoints, the final model)

Pushes are decided under the stream engine's lock and their steps are sent before it is
released, so every shard sees the log in the order the core decided it.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from sparkcnn.server.apply import Applied
from sparkcnn.transport.shardservice import ShardProcess
from sparkcnn.protocol import Answer, PieceRef, ExchangeResult, ShardInit, ShardStep
from sparkcnn.shards import shard_ranges
from sparkcnn.streamwire import encode


class ShardCoordinator:
    def __init__(self, k: int, host: str, token: str, ps, *, selector: str, dense_below: int,
                 value_dtype: str,
                 keep_downlinks: int, timeout_s: float, max_message_bytes: int):
        self.ranges = shard_ranges(ps.layout, k)
        self.procs: list[ShardProcess] = []
        with ThreadPoolExecutor(k, thread_name_prefix="sparkcnn-shard-start") as pool:  # they start at once
            started = [pool.submit(ShardProcess, host, token, j, lo, hi, ps.layout,
                                   density_down=ps.density_down,
                                   selector=selector, dense_below=dense_below, value_dtype=value_dtype,
                                   keep_downlinks=keep_downlinks, timeout_s=timeout_s,
                                   max_message_bytes=max_message_bytes)
                       for j, (lo, hi) in enumerate(self.ranges)]
        failed = [f.exception() for f in started if f.exception() is not None]
        self.procs = [f.result() for f in started if f.exception() is None]
        if failed:
            self.close()
            raise failed[0]
        self.version, self.view_version = ps.version, ps.view_version
        init = ShardInit(W=ps.W.tobytes(), U=ps.U.tobytes(), version=ps.version, view_version=ps.view_version)
        for p in self.procs:
            p.send(init)
        self._apply: list[tuple[ExchangeResult, float]] = []
        self._down = 0.0

    @property
    def locations(self) -> tuple[tuple[str, int], ...]:
        return tuple(p.location for p in self.procs)

    def apply(self, results: list[ExchangeResult], factor: float, guard=None) -> Applied:
        """:func:`sparkcnn.server.apply.apply_deltas` for the coordinator: the guard judges each
        result's declared norm; the good ones make one version, applied by the shards at ``step``."""
        rejected, good = {}, []
        for k, r in enumerate(results):
            if r.samples <= 0:
                continue
            if len(r.sumsq) != len(self.procs) or not all(math.isfinite(x) and x >= 0 for x in r.sumsq):
                rejected[k] = f"declared piece norms {r.sumsq!r}: expected {len(self.procs)} finite values"
                continue
            why = guard.check_norm(math.sqrt(sum(r.sumsq)), r.steps) if guard is not None else None
            if why is None:
                good.append(k)
            else:
                rejected[k] = str(why)
        if good:
            self.version += 1
            self._apply = [(results[k], factor) for k in good]
        return Applied(tuple(good), rejected)

    def downlink(self, density: float) -> None:
        if self.version > self.view_version:
            self.view_version = self.version
            self._down = float(density)

    def step(self, answers: list[Answer]) -> None:
        """Send what was decided since the last step, with ``answers``, to every shard (one
        message, encoded once)."""
        apply, self._apply = self._apply, []
        down, self._down = self._down, 0.0
        refs = tuple(PieceRef(stream=r.piece[0], ordinal=r.piece[1], factor=f, samples=r.samples,
                              sumsq=r.sumsq)
                     for r, f in apply)
        buf = encode(ShardStep(version=self.version, apply=refs, downlink=down, answer=tuple(answers)))
        for p in self.procs:
            p.send_bytes(buf)

    def refresh(self, ps) -> None:
        """The driver's W and U from a cut of every shard, after every step sent so far."""
        W, U = np.empty(ps.W.size, np.float32), np.empty(ps.W.size, np.float32)
        for (lo, hi), p in zip(self.ranges, self.procs):
            st = p.cut()
            if (st.version, st.view_version) != (self.version, self.view_version):
                raise RuntimeError(f"shard [{lo}, {hi}) is at version {st.version}/{st.view_version}, the "
                                   f"coordinator at {self.version}/{self.view_version}")
            W[lo:hi] = np.frombuffer(st.W, np.float32)
            U[lo:hi] = np.frombuffer(st.U, np.float32)
        ps.load_state_dict({"W": W, "U": U, "layout": np.asarray(ps.layout, np.int64),
                            "version": self.version,
                            "view_version": self.view_version})

    def kill_last(self) -> None:
        """Fault drill (``chaos.kill_shard_round``): SIGKILL the last shard process."""
        self.procs[-1].proc.kill()

    def close(self) -> None:
        for p in self.procs:
            p.close()
