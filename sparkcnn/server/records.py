"""The run's records: counters, exchange and epoch records, and the summary.

Every exchange record is made by :mod:`sparkcnn.server.exchange` from the results it
applied; the transport that carried them adds only its :class:`Timings` (and, for the
jobs transport, which task ran where). Records are written once, here, to the run's
sink (``metrics.jsonl`` and the trackers), its progress bar and ``history``.

The fields of ``metrics.jsonl`` and ``summary.json`` are user-facing (README, "Outputs"):
an exchange record is ``"kind": "round"`` and counts exchanges in ``"round"``, as
before the transports shared one server.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from dataclasses import fields as dataclass_fields

import numpy as np

COUNTERS = ("state_resets", "duplicates_dropped", "rejected_deltas", "replica_resyncs", "stale_states",
            "loss_spikes", "losses_at_chance", "stale_dropped")


class Counters:
    """The run's event counts (``COUNTERS``), each named in the summary and epoch records."""

    def __init__(self):
        self._counts = dict.fromkeys(COUNTERS, 0)

    def add(self, name: str, n: int = 1) -> None:
        self._counts[name] += int(n)

    def __getitem__(self, name: str) -> int:
        return self._counts[name]

    def as_dict(self) -> dict:
        return dict(self._counts)

    def load(self, counts: dict) -> None:
        self._counts.update({k: int(v) for k, v in counts.items()})


@dataclass(frozen=True)
class Timings:
    """What a transport measured around one exchange, in seconds (rates in images/s);
    None where the transport has no such figure."""

    compute_s: float | None = None        # the training steps (the slowest block's, for a sync round)
    task_s: float | None = None           # the whole task (async jobs)
    job_s: float | None = None            # the Spark job, submitted to collected (jobs transport)
    apply_s: float | None = None          # the server's part: accept, apply, downlink
    wall_s: float | None = None           # the exchange's wall time
    round_overhead_s: float | None = None  # time not spent training: job minus task, or the push's wait
    exposed_comm_s: float | None = None   # the stream task's wait for its previous reply
    task_overhead_cpu_s: float | None = None  # the stream task's CPU outside TensorFlow
    images_per_s: float | None = None
    idle_fraction: float | None = None    # share of the offered task slots left idle
    # the driver's thread CPU of its part (stream), in seconds: server_cpu_s holds downlink_cpu_s,
    # which holds select_cpu_s and encode_cpu_s
    server_cpu_s: float | None = None     # the span of apply_s: accept, apply, downlink, record
    downlink_cpu_s: float | None = None   # the downlink: choice of D, U += D, its encoding (0: none made)
    select_cpu_s: float | None = None     # the scan's choice of D's entries (0: the candidate set settled it)
    encode_cpu_s: float | None = None     # the downlink's encoding
    first_step_s: float | None = None     # a sync engine's first round: process start -> first step's end

    def fields(self) -> dict:
        # every field is a float or None: no asdict, whose deep copy cost 10 us per record (one
        # record per push on the stream, so on the server's hot path)
        return {k: v for k in _TIMINGS if (v := getattr(self, k)) is not None}


_TIMINGS = tuple(f.name for f in dataclass_fields(Timings))


@dataclass(frozen=True)
class TaskStat:
    """One block's task in a jobs-transport exchange: where it ran and what it took."""

    block: int
    compute_s: float
    prep_s: float
    encode_s: float
    pid: int
    executor: str
    gpus: str | None      # Spark's GPU addresses, comma-separated
    devices: str | None   # what its TensorFlow saw (CUDA_VISIBLE_DEVICES)


@dataclass(frozen=True)
class Where:
    """Where an exchange ran, as the transport saw it; None where it has no such figure."""

    tasks: tuple[TaskStat, ...] = ()   # sync rounds: every block's task
    pid: int | None = None             # async jobs: the Python worker of the block's task
    executors: int | None = None       # async jobs: live executors when it was applied
    slots: int | None = None           # async jobs: live task slots
    inflight_limit: int | None = None  # async jobs: jobs allowed in flight
    transport: str | None = None       # "stream" on the stream transport

    def fields(self) -> dict:
        out = {k: v for k, v in (("pid", self.pid), ("executors", self.executors), ("slots", self.slots),
                                 ("inflight_limit", self.inflight_limit), ("transport", self.transport))
               if v is not None}
        if self.tasks:
            ts = self.tasks
            out.update(task_compute_s={str(t.block): round(t.compute_s, 4) for t in ts},
                       task_prep_s={str(t.block): round(t.prep_s, 4) for t in ts},
                       task_encode_s={str(t.block): round(t.encode_s, 4) for t in ts},
                       task_pids={str(t.block): t.pid for t in ts},
                       task_executors={str(t.block): t.executor for t in ts},
                       task_gpus={str(t.block): t.gpus for t in ts},
                       task_devices={str(t.block): t.devices for t in ts})
        return out


@dataclass(frozen=True)
class ExchangeRecord:
    """One applied exchange: the results it applied, its traffic, and where and how long it ran.

    ``as_dict()`` is the ``metrics.jsonl`` line (``"kind": "round"``)."""

    round: int                # the exchange's number in the run (sync: the round t)
    seq: int                  # the exactly-once key's seq (sync: t; async jobs: the job; stream: the block's)
    epoch: int
    lr: float
    density: float
    version: int              # the server's version after it
    samples: int
    blocks: int
    steps: int
    staleness: int
    loss: float
    accuracy: float
    bytes_up: int
    nnz_up: int
    bytes_down: int
    nnz_down: int
    dense_bytes: int          # 4 P per block: what a dense exchange would move each way
    params: int               # P: the model's parameter count
    rejected: int
    state_resets: int
    replica_resyncs: int
    block: int | None = None  # async: the block (and its cursor before the result)
    block_epoch: int | None = None
    block_step: int | None = None
    scale: float | None = None  # async: lambda(tau) / N
    round_in_epoch: int | None = None  # sync rounds
    timings: Timings = field(default_factory=Timings)
    where: Where = field(default_factory=Where)

    def as_dict(self, timings: Timings | None = None, where: Where | None = None) -> dict:
        """The line; ``timings``, ``where``: the transport's, in place of the record's own (a
        record the run made is written once with them: no copy of it for that)."""
        up, down = self.bytes_up, self.bytes_down
        head = {k: getattr(self, k) for k in ("round", "seq", "block", "block_epoch", "block_step",
                                               "staleness", "scale", "steps", "lr", "density", "version",
                                               "samples", "blocks", "loss", "accuracy", "bytes_up", "nnz_up")
                if getattr(self, k) is not None}
        return {"kind": "round", **head,
                "achieved_density": self.nnz_up / max(1, self.params * self.blocks),
                "bytes_per_nonzero": up / max(1, self.nnz_up),
                "bytes_down": down, "nnz_down": self.nnz_down, "dense_bytes": self.dense_bytes,
                "uplink_ratio": self.dense_bytes / max(1, up),
                "downlink_ratio": self.dense_bytes / max(1, down),
                "rejected": self.rejected, "state_resets": self.state_resets,
                "replica_resyncs": self.replica_resyncs, "epoch": self.epoch,
                **({} if self.round_in_epoch is None else {"round_in_epoch": self.round_in_epoch}),
                **(timings or self.timings).fields(), **(where or self.where).fields()}


@dataclass(frozen=True)
class EpochRecord:
    """One epoch's end: the test evaluation of W, the epoch's training loss and traffic, and the
    run's counters so far. ``as_dict()`` is the ``metrics.jsonl`` line (``"kind": "epoch"``)."""

    epoch: int
    test_loss: float | None
    test_accuracy: float | None
    test_samples: int
    train_loss: float | None       # mean training loss of the epoch's exchanges
    wall_s: float                  # since the run began
    bytes_up: int
    bytes_down: int
    counters: dict                 # Counters.as_dict() at the epoch's end
    staleness_histogram: dict | None = None  # async and stream: tau -> results, so far
    exposed_comm_s: float | None = None      # stream: the tasks' waits for replies in the epoch

    def as_dict(self) -> dict:
        out = {"kind": "epoch", "epoch": self.epoch, "test_loss": self.test_loss,
               "test_accuracy": self.test_accuracy, "test_samples": self.test_samples,
               "train_loss": self.train_loss, "wall_s": self.wall_s, "bytes_up": self.bytes_up,
               "bytes_down": self.bytes_down}
        if self.staleness_histogram is not None:
            out["staleness_histogram"] = self.staleness_histogram
        if self.exposed_comm_s is not None:
            out["exposed_comm_s"] = self.exposed_comm_s
        return {**out, **self.counters}


class Records:
    """Exchange and epoch records of a run, written once each to the sink and the progress bar."""

    def __init__(self, progress=None):
        self.history: list[dict] = []        # exchange records, as written (metrics.jsonl lines)
        self.epochs: list[dict] = []         # epoch records
        self.executors: dict[str, int] = {}  # executor -> training results it delivered
        self._sink = None
        self._progress = progress
        self._keep = True  # the history is kept (False: a server process, whose driver keeps it)

    def open(self, sink, history: list[dict] = (), epochs: list[dict] = (), keep: bool = True) -> None:
        """Write to ``sink`` from now on, after the records a resumed run keeps; ``keep``: whether
        ``history`` grows with them (a server process's records are the driver's to keep: it would
        hold every one of a long run for nothing)."""
        self._sink, self._keep = sink, keep
        self.history[:0], self.epochs[:0] = list(history), list(epochs)

    def flush(self) -> None:
        if hasattr(self._sink, "flush"):  # the records a checkpoint covers are stored before it
            self._sink.flush()

    def count_executor(self, executor: str, n: int = 1) -> None:
        self.executors[executor] = self.executors.get(executor, 0) + n

    def write(self, rec: ExchangeRecord, progress_at: tuple | None = None, timings: Timings | None = None,
              where: Where | None = None) -> dict:
        """Write an exchange record, with the transport's ``timings`` and ``where`` when given;
        ``progress_at``: (position, total[, epoch]) on the progress bar."""
        return self.write_line(rec.as_dict(timings, where), progress_at)

    def write_line(self, line: dict, progress_at: tuple | None = None, encoded: str | None = None) -> dict:
        """Write an exchange record's line; ``encoded``: its ``metrics.jsonl`` line, when a server
        process encoded it already (:meth:`write_encoded`), which a sink that can writes as it is."""
        if self._keep:
            self.history.append(line)
        if self._sink:
            if encoded is not None and hasattr(self._sink, "write_encoded"):
                self._sink.write_encoded(line, encoded)
            else:
                self._sink.write(line)
        if progress_at is not None:
            self.show(line, progress_at)
        return line

    def write_encoded(self, encoded: str, progress_at: tuple | None = None) -> dict:
        """Write an exchange record a server process encoded (``ps.servers`` > 1): its line goes to
        ``metrics.jsonl`` as it is, and is read once for the history, the trackers and the bar."""
        return self.write_line(json.loads(encoded), progress_at, encoded)

    def show(self, line: dict, progress_at: tuple) -> None:
        """A written record on the progress bar at (position, total[, epoch])."""
        if self._progress:
            pos, total, *epoch = progress_at
            self._progress.round({**line, "round": pos, **({"epoch": epoch[0]} if epoch else {})}, total)

    def write_epoch(self, epoch: int, evaluation: dict, wall_s: float, counters: Counters, *,
                    staleness: dict[int, int] | None = None, exposed_comm_s: float | None = None) -> dict:
        """Write ``epoch``'s record: ``evaluation`` (test loss, accuracy, samples) and what its
        exchanges recorded; ``staleness``: the run's histogram so far."""
        rounds = [h for h in self.history if h.get("epoch") == epoch]
        rec = EpochRecord(
            epoch=epoch, test_loss=evaluation["test_loss"], test_accuracy=evaluation["test_accuracy"],
            test_samples=evaluation["test_samples"],
            train_loss=float(np.mean([h["loss"] for h in rounds])) if rounds else None, wall_s=wall_s,
            bytes_up=sum(h["bytes_up"] for h in rounds), bytes_down=sum(h["bytes_down"] for h in rounds),
            counters=counters.as_dict(), exposed_comm_s=exposed_comm_s,
            staleness_histogram=None if staleness is None else staleness_histogram(staleness))
        line = rec.as_dict()
        self.epochs.append(line)
        if self._sink:
            self._sink.write(line)
        if self._progress:
            self._progress.epoch(line)
        return line

    def summary(self, wall_s: float, counters: Counters) -> dict:
        h = self.history
        last = self.epochs[-1] if self.epochs else {}
        samples = sum(r["samples"] for r in h)
        dense = sum(r["dense_bytes"] for r in h)  # a dense exchange moves 4 P each way (DESIGN §4)
        return {
            "rounds": len(h), "epochs": len(self.epochs), "wall_s": wall_s,
            "test_accuracy": last.get("test_accuracy"), "test_loss": last.get("test_loss"),
            "accuracy_per_epoch": [e["test_accuracy"] for e in self.epochs],
            "images_per_s": samples / wall_s if wall_s > 0 else 0.0,
            "bytes_up": sum(r["bytes_up"] for r in h), "bytes_down": sum(r["bytes_down"] for r in h),
            "dense_bytes_up": dense, "dense_bytes_down": dense,
            "mean_round_overhead_ms": _mean_ms(h, "round_overhead_s"),
            "mean_round_compute_ms": _mean_ms(h, "compute_s"),
            # start-up: the driver process's start to the first training step's end (sync rounds)
            "first_step_s": next((r["first_step_s"] for r in h if "first_step_s" in r), None),
            "executors": sorted(self.executors),
            "executor_tasks": dict(sorted(self.executors.items())),
            **counters.as_dict(),  # the guard's among them: rejected_deltas, loss_spikes
        }


def _mean_ms(history: list[dict], key: str) -> float:
    return 1000 * float(np.mean([r[key] for r in history])) if history else 0.0


def staleness_histogram(hist: dict[int, int]) -> dict[str, int]:
    """The epoch record's form of a staleness histogram: tau (as text) -> results."""
    return {str(k): v for k, v in sorted(hist.items())}
