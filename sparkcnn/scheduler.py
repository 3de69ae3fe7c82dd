"""Scheduling policy: load samples + queue -> decisions (pure; stdlib only).

The engine's load monitor fills :class:`ExecutorSample` (from Spark's status
tracker) and :class:`BlockSpeed` (from each block's last task); this module
turns them into decisions and the engine acts on them. Nothing here talks to
Spark, sleeps or keeps time, so every rule is a table-driven test.

Notation: block ``k``, measured speed ``s_k`` in images/s, batch size ``B``
(images per local step), local steps per job ``H_k``, server version ``v``,
base version ``b`` of a job (the version its replica started from), staleness
``tau = v - b`` when its result is applied.

- sync (:func:`size_sync_steps`): a round lasts as long as its slowest task,
  so ``H_k`` is proportional to ``s_k`` and every task takes about as long as
  ``base_steps`` at the median speed.
- async (:class:`AsyncPolicy`): keep every slot busy, stalest block first,
  then a block whose executor has a free slot; hold back when the staleness
  bound would be broken; size ``H_k`` so a job lasts ``target_job_seconds``.
"""

from __future__ import annotations

import enum
import math
import operator
import statistics
from dataclasses import dataclass, field

from sparkcnn.errors import BadInput

__all__ = [
    "AsyncPolicy",
    "BlockSpeed",
    "Decision",
    "DecisionKind",
    "ExecutorSample",
    "pipeline_depth",
    "size_sync_steps",
    "task_slots",
]


def _count(name: str, value: object, minimum: int = 0) -> int:
    """``value`` as an int >= ``minimum`` (numpy integers accepted, bools not)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        n = operator.index(value)
    except TypeError:
        n = minimum - 1
    if n < minimum:
        raise BadInput(f"`{name}` must be an int >= {minimum}, got {value!r}")
    return n


def _known(speed: float | None) -> bool:
    """A speed the policy can use: finite and > 0 (0 images/s means an empty block)."""
    return speed is not None and math.isfinite(speed) and speed > 0


def _round_half_up(x: float) -> int:
    # Python's round() is half-to-even; half-up keeps 2.5 -> 3 and 3.5 -> 4 alike.
    return int(math.floor(x + 0.5))


def _clamp(n: int, lo: int, hi: int | None) -> int:
    n = max(lo, n)
    return n if hi is None else min(hi, n)


def _check_bounds(min_steps: object, max_steps: object) -> tuple[int, int | None]:
    lo = _count("min_steps", min_steps, 1)
    hi = None if max_steps is None else _count("max_steps", max_steps, lo)
    return lo, hi


# -- load samples -----------------------------------------------------------------------

@dataclass(frozen=True)
class ExecutorSample:
    """One executor as the status tracker saw it."""

    executor_id: str
    cores: int          # task slots (spark.executor.cores / spark.task.cpus)
    running_tasks: int  # tasks running now, ours and others'
    failed_tasks: int   # cumulative failed tasks (reported; the policy does not act on it)
    completed_tasks: int = 0  # cumulative completed tasks (reported)

    def __post_init__(self) -> None:
        if not isinstance(self.executor_id, str) or not self.executor_id:
            raise BadInput(f"`executor_id` must be a non-empty string, got {self.executor_id!r}")
        _count(f"executor {self.executor_id}: cores", self.cores)
        _count(f"executor {self.executor_id}: running_tasks", self.running_tasks)
        _count(f"executor {self.executor_id}: failed_tasks", self.failed_tasks)
        _count(f"executor {self.executor_id}: completed_tasks", self.completed_tasks)

    @property
    def free_slots(self) -> int:
        return max(0, self.cores - self.running_tasks)


@dataclass(frozen=True)
class BlockSpeed:
    """Measured speed of a block's last task (None before its first task ends)."""

    block: int
    images_per_s: float | None  # images processed / task compute seconds
    executor_id: str | None     # where that task ran (the block's cached partition lives there)

    def __post_init__(self) -> None:
        _count("block", self.block)
        s = self.images_per_s
        if s is not None and not (isinstance(s, (int, float)) and math.isfinite(s) and s >= 0):
            raise BadInput(f"block {self.block}: `images_per_s` must be a finite number >= 0 or None, "
                           f"got {s!r}")


def task_slots(executors: list[ExecutorSample], blocks: int, fixed: int = 0, queued: int = 0) -> int:
    """Jobs the async engine may have in flight (one job per block, one task per job)::

        slots = fixed                                        fixed > 0 (``engine.threads``)
        slots = clamp(sum(e.cores) + queued, 1, blocks)      otherwise

    The sum runs over the executors sampled now, so a lost executor takes its
    slots away and a joining one adds its own. ``queued`` jobs wait in Spark's
    queue beyond the free slots (``scheduler.queue_depth``): a slot that frees
    starts the next block at once instead of idling through a driver round
    trip. At least 1: with no executor registered yet, a submitted job waits
    in Spark's queue for one.
    """
    n = _count("blocks", blocks, 1)
    if _count("engine.threads", fixed):
        return fixed
    return _clamp(sum(e.cores for e in executors) + _count("scheduler.queue_depth", queued), 1, n)


# -- sync -------------------------------------------------------------------------------

def size_sync_steps(speeds: dict[int, float | None], base_steps: int, *,
                    min_steps: int = 1, max_steps: int | None = None) -> dict[int, int]:
    """Local steps per block so that all tasks of a sync round finish together.

    With ``K`` the blocks whose speed is known (finite, > 0)::

        s_ref = median(s_k for k in K)
        H_k   = clamp(round_half_up(base_steps * s_k / s_ref), min_steps, max_steps)   k in K
        H_k   = clamp(base_steps, min_steps, max_steps)                                 k not in K

    so task time ``H_k * B / s_k = base_steps * B / s_ref`` is the same for every
    block: the round lasts as long as ``base_steps`` at the median speed. The
    median, not the mean or the minimum, sets the pace so that one straggler
    neither stretches nor shrinks everyone's round. Blocks then process
    different numbers of samples; the server's samples-weighted sum
    (``w_k`` proportional to samples) keeps the update an average over images.
    """
    base = _count("base_steps", base_steps, 1)
    lo, hi = _check_bounds(min_steps, max_steps)
    known = [s for s in speeds.values() if _known(s)]
    if not known:
        return {k: _clamp(base, lo, hi) for k in speeds}
    ref = statistics.median(known)
    return {k: _clamp(_round_half_up(base * s / ref) if _known(s) else base, lo, hi)
            for k, s in speeds.items()}


def pipeline_depth(mode: str, pipeline: bool) -> int:
    """Rounds a block may have in flight at once.

        sync:  1, or 2 with ``pipeline`` (round t+1 computes while t is applied)
        async: 1 (overlap comes from other blocks; the staleness bound limits it)
    """
    if mode == "sync":
        return 2 if pipeline else 1
    if mode == "async":
        return 1
    raise BadInput(f"`engine.mode` must be one of sync, async, got {mode!r}")


# -- async ------------------------------------------------------------------------------

class DecisionKind(enum.Enum):
    SUBMIT = "submit"  # start a job for the block now
    HOLD = "hold"      # leave the block idle until the next decide()


@dataclass(frozen=True)
class Decision:
    kind: DecisionKind
    block: int
    steps: int   # local steps for a SUBMIT; 0 for a HOLD
    reason: str  # one line, for logs and the Spark UI job description


@dataclass
class AsyncPolicy:
    """Which idle blocks to start, with how many steps (asynchronous mode).

    Jobs are sized to last about the same time, so results land roughly in the
    order their jobs started. A job ``j`` in flight (``in_flight``: block ->
    base version ``b_j``) at server version ``v`` is then predicted to be
    applied with staleness::

        tau_hat_j = (v - b_j) + #{i != j in flight : b_i <= b_j}

    (the versions applied since it started, plus the jobs started no later,
    which land first; jobs started at the same version count against each
    other because their order is unknown). A new job starts at ``b = v`` with
    ``tau_hat = n``, the number already in flight. Each :meth:`decide` call:

    1. Staleness: submit while every ``tau_hat`` stays <= ``max_staleness``
       with the new job added, that is while ``n <= max_staleness`` and no
       older job has ``tau_hat_j > max_staleness``. The second case means a
       later job overtook it (a straggler): everyone waits for it rather than
       pushing its result further past the bound (stale synchronous parallel).
       Under start-order landing this guarantees ``tau <= max_staleness``.
    2. Slots: submit up to ``free_slots`` idle blocks; the rest are held.
    3. Order: smallest last applied base version first (stalest block; never
       applied counts as -1), then a block whose last executor has a free slot
       (its partition and state are cached there), then block id.
    4. Steps: ``H_k = clamp(round_half_up(target_job_seconds * s_k / batch_size),
       min_steps, max_steps)``; ``default_steps`` when ``s_k`` is unknown.

    State kept between calls: each block's last known speed and executor, and
    its last applied base version (reported by the engine via :meth:`applied`).
    """

    batch_size: int                 # images per local step
    target_job_seconds: float       # s: aim for jobs this long (amortises ~0.1-1 s of job overhead)
    default_steps: int              # steps for a block with no measured speed yet
    max_staleness: int | None = None  # tau bound; None = unbounded
    min_steps: int = 1
    max_steps: int | None = None
    last_applied: dict[int, int] = field(default_factory=dict)     # block -> base version
    last_speed: dict[int, float] = field(default_factory=dict)     # block -> images/s
    last_executor: dict[int, str] = field(default_factory=dict)    # block -> executor id

    def __post_init__(self) -> None:
        _count("batch_size", self.batch_size, 1)
        t = self.target_job_seconds
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and t > 0):
            raise BadInput(f"`scheduler.target_job_seconds` must be > 0, got {t!r}")
        self.min_steps, self.max_steps = _check_bounds(self.min_steps, self.max_steps)
        self.default_steps = _clamp(_count("default_steps", self.default_steps, 1),
                                    self.min_steps, self.max_steps)
        if self.max_staleness is not None:
            _count("ps.max_staleness", self.max_staleness)

    def applied(self, block: int, base_version: int) -> None:
        """The engine applied ``block``'s result computed at ``base_version``."""
        b = _count("base_version", base_version)
        self.last_applied[block] = max(b, self.last_applied.get(block, -1))

    def steps_for(self, block: int) -> int:
        """``H_k`` for a job of ``block`` (rule 4)."""
        s = self.last_speed.get(block)
        if not _known(s):
            return self.default_steps
        return _clamp(_round_half_up(self.target_job_seconds * s / self.batch_size),
                      self.min_steps, self.max_steps)

    def observe(self, speeds: dict[int, BlockSpeed] | None) -> None:
        """Remember each block's latest measured speed and executor."""
        for k, sp in (speeds or {}).items():
            if _known(sp.images_per_s):
                self.last_speed[k] = float(sp.images_per_s)
            if sp.executor_id:
                self.last_executor[k] = sp.executor_id

    def decide(self, now_version: int, free_slots: int, idle_blocks: list[int],
               in_flight: dict[int, int], speeds: dict[int, BlockSpeed] | None = None,
               executors: list[ExecutorSample] | None = None) -> list[Decision]:
        """One decision per idle block: SUBMITs in start order, then HOLDs."""
        v = _count("now_version", now_version)
        slots = _count("free_slots", free_slots)
        busy = set(idle_blocks) & set(in_flight)
        if busy:
            raise BadInput(f"blocks {sorted(busy)} are both idle and in flight")
        for k, b in in_flight.items():
            if _count(f"in_flight[{k}]", b) > v:
                raise BadInput(f"block {k}: base version {b} is ahead of server version {v}")
        self.observe(speeds)
        free_at = {e.executor_id: e.free_slots for e in executors or ()}
        n = len(in_flight)
        bound = self.max_staleness
        # tau_hat of jobs that started before now; new submissions leave these unchanged.
        older = {j: (v - b) + sum(1 for i, c in in_flight.items() if i != j and c <= b)
                 for j, b in in_flight.items() if b < v}
        queue = list(dict.fromkeys(idle_blocks))  # a block listed twice is still one job
        worst = max(older, key=lambda j: (older[j], -j), default=None)
        if bound is not None and worst is not None and older[worst] > bound:
            why = (f"staleness: block {worst} in flight is headed for tau={older[worst]} "
                   f"> max_staleness {bound}; waiting for it")
            return [Decision(DecisionKind.HOLD, k, 0, why) for k in sorted(queue)]

        def is_local(k: int) -> bool:
            return free_at.get(self.last_executor.get(k, ""), 0) > 0

        def priority(k: int) -> tuple[int, bool, int]:
            return (self.last_applied.get(k, -1), not is_local(k), k)

        out: list[Decision] = []
        while queue and slots > 0 and (bound is None or n <= bound):
            k = min(queue, key=priority)
            queue.remove(k)
            local = is_local(k)
            if local:
                free_at[self.last_executor[k]] -= 1
            steps = self.steps_for(k)
            ex = self.last_executor.get(k)
            where = (f"local to {ex}" if local else f"{ex} has no free slot" if ex else "no executor yet")
            why = (f"last applied base {self.last_applied.get(k, -1)}, tau_hat={n}, {where}, "
                   f"{steps} steps at {self.last_speed.get(k, 'unknown')} img/s")
            out.append(Decision(DecisionKind.SUBMIT, k, steps, why))
            n += 1
            slots -= 1

        if queue:
            why = ("no free slot" if slots == 0 else
                   f"staleness: {n} jobs in flight, a new job would have tau_hat={n} > max_staleness {bound}")
            out.extend(Decision(DecisionKind.HOLD, k, 0, why) for k in sorted(queue))
        return out
