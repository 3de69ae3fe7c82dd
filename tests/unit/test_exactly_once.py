"""Exactly-once (DESIGN §10: every (block, epoch, step) is trained and applied exactly once),
against a real :class:`~sparkcnn.server.run.Run` fed by a fake transport: no Spark, no TensorFlow.

The fake transport plays each block's worker as the real ones behave: a block trains its next
steps from the server's current version, sends the result, and trains on only once that result
is answered (ASGD: applied, or too stale and trained again over the same steps from a fresher
version; BSP: it may train round r + 1 while its push of round r waits, but sends it only once
round r is applied). Hypothesis chooses the interleaving of the blocks, how often each result
is delivered (1-3 times in a row) and when an old result is delivered again, long after.

Each delivery is checked against a model of the rule (a key already applied, or held in BSP,
is a duplicate; ASGD drops tau > ps.max_staleness; BSP applies a round once every block's
result is in), and at the end: the steps applied, the cursors, the counters, the version, and
``W`` against the serial application of the applied deltas in numpy.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from sparkcnn.protocol import Arrival
from sparkcnn.server.run import APPLIED, DUPLICATE, HELD, RETRAIN, RunShape
from tests.unit.fake_run import (BATCH, apply_expected, arrival, initial_weights, make_cfg, make_run,
                                 make_spec, random_payload, server_scale, staleness_lambda)

EXAMPLES = settings(max_examples=200, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
MOVES = 160        # choices at most; then results are sent one block at a time
LRS = (0.05, 0.1, 0.025)


@dataclass
class Worker:
    """One block's task: its own cursor, its next seq, and the result it trained but did not send."""

    block: int
    pass_steps: int
    epochs: int
    epoch: int = 0
    step: int = 0
    seq: int = 0                     # stream numbering: its next exchange (a retrained one keeps it)
    pending: Arrival | None = None   # trained, not sent yet
    sent: int = -1                   # BSP: the last round it sent

    @property
    def cursor(self) -> int:
        return self.epoch * self.pass_steps + self.step

    @property
    def finished(self) -> bool:
        return self.epoch >= self.epochs

    def next_steps(self, h: int) -> int:
        return min(h, self.pass_steps - self.step)

    def advance(self, steps: int) -> None:
        self.step += steps
        if self.step == self.pass_steps:
            self.epoch, self.step = self.epoch + 1, 0


class Model:
    """The rule, written from DESIGN §10 and server/exchange.py's docstring: what each delivery
    should do (a decision the run makes otherwise is kept in ``wrong``), and W as the serial
    application of what the run applied, with the factors the rule gives."""

    def __init__(self, run, blocks: int, w0: np.ndarray, *, bsp: bool, h: int, max_staleness: int, rule: str):
        self.run, self.bsp, self.h, self.max_staleness, self.rule = run, bsp, h, max_staleness, rule
        self.n = blocks
        self.version = 0                             # the run's version: one per exchange it applied
        self.last = {k: -1 for k in range(blocks)}  # the last seq of each block the run applied
        self.held: dict[int, dict[int, Arrival]] = {}  # BSP: seq -> block -> its result, in arrival order
        self.W = w0.copy()
        self.applied: list[Arrival] = []             # what the run applied, in order
        self.duplicates = self.late = self.retrains = self.rounds = 0  # as the rule counts them
        self.wrong: list[str] = []

    def expect(self, a: Arrival) -> str:
        if a.seq <= self.last[a.block] or (self.bsp and a.block in self.held.get(a.seq, {})):
            self.duplicates += 1
            self.late += a.seq < self.last[a.block]  # after a later seq of its block was applied
            return DUPLICATE
        if self.bsp:
            self.held.setdefault(a.seq, {})[a.block] = a
            return APPLIED if len(self.held[a.seq]) == self.n else HELD
        if self.version - a.base_version > self.max_staleness:
            self.retrains += 1
            return RETRAIN
        return APPLIED

    def deliver(self, a: Arrival):
        want = self.expect(a)
        cursors = {k: self.run.cursors.cursor(k) for k in self.last}
        d = self.run.accept(a)
        where = f"block {a.block} seq {a.seq} base_version {a.base_version} at version {self.version}"
        if d.kind != want:
            self.wrong.append(f"{where}: {d.kind}, expected {want}")
        if d.kind != APPLIED:
            return d
        if self.bsp:
            got = self.held.pop(a.seq, {})
            rs = [got.get(k, a) for k in d.blocks]
            if list(d.blocks) != list(got):
                self.wrong.append(f"{where}: applied blocks {d.blocks}, expected {tuple(got)} "
                                  "in arrival order")
            total = sum(r.samples for r in rs)
            s = server_scale(self.h, rs[0].lr)
            self.W = apply_expected(self.W, [(s * r.samples / total, r.payload) for r in rs])
            self.rounds += 1
        else:
            rs = [a]
            tau = self.version - a.base_version
            scale = staleness_lambda(tau, self.rule) / self.n
            if d.blocks != (a.block,) or d.tau != tau or d.record.scale != pytest.approx(scale):
                self.wrong.append(f"{where}: blocks {d.blocks}, tau {d.tau}, scale {d.record.scale}; "
                                  f"expected ({a.block},), {tau}, {scale}")
            self.W = apply_expected(self.W, [(scale * server_scale(self.h, a.lr), a.payload)])
        for r in rs:
            if cursors[r.block] != r.first_step:
                self.wrong.append(f"{where}: block {r.block}'s steps from {r.first_step} applied at its "
                                  f"cursor {cursors[r.block]}")
            self.last[r.block] = r.seq
            self.applied.append(r)
        self.version += 1
        return d


def check_end(run, model: Model, workers: list[Worker]) -> None:
    """Every (block, step) applied exactly once, and the run's state what the rule says."""
    steps = Counter((r.block, s) for r in model.applied for s in range(r.first_step, r.first_step + r.steps))
    twice = sorted(k for k, n in steps.items() if n > 1)
    assert not twice, f"(block, step) applied more than once: {twice}"
    for w in workers:
        total = w.epochs * w.pass_steps
        assert sorted(s for b, s in steps if b == w.block) == list(range(total)), f"block {w.block}'s steps"
        c = run.cursors
        assert (c.block_epoch[w.block], c.block_step[w.block], c.cursor(w.block)) == (w.epochs, 0, total)
        assert c.last_seq[w.block] == model.last[w.block]
    assert run.cursors.samples_done == sum(w.epochs * w.pass_steps for w in workers) * BATCH
    assert run.counters["duplicates_dropped"] == model.duplicates
    assert run.counters["stale_dropped"] == model.retrains
    assert run.counters["rejected_deltas"] == 0
    exchanges = model.rounds if model.bsp else len(model.applied)
    assert run.version == model.version == exchanges == run.exchange.exchanges
    assert not run.exchange.held
    np.testing.assert_allclose(run.W, model.W, rtol=1e-5, atol=1e-6)
    assert not model.wrong, "decisions against the rule:\n" + "\n".join(model.wrong[:10])
    for name in ("duplicates", "late", "retrains"):  # --hypothesis-show-statistics: what the examples hit
        event(f"{name}: {'some' if getattr(model, name) else 'none'}")


def finish(workers: list[Worker], model: Model, moved: int) -> bool:
    """Whether every block is done; a run that goes on without end fails, with its wrong decisions."""
    assert moved < MOVES + 200, "the run never ends:\n" + "\n".join(model.wrong[:10])
    return all(w.finished and w.pending is None for w in workers)


# -- ASGD -------------------------------------------------------------------------------------------
@st.composite
def asgd_runs(draw):
    blocks = draw(st.integers(2, 4))
    return dict(blocks=blocks, pass_steps=draw(st.lists(st.integers(1, 4), min_size=blocks, max_size=blocks)),
                epochs=draw(st.integers(1, 2)), h=draw(st.integers(1, 3)),
                max_staleness=draw(st.sampled_from([1, 1, 2, 1000])),
                rule=draw(st.sampled_from(["none", "inverse"])),
                numbering=draw(st.sampled_from(["stream", "jobs"])),
                density_down=draw(st.sampled_from([0.0, 0.1])),
                value_dtype=draw(st.sampled_from(["float16", "float32"])), seed=draw(st.integers(0, 2**16)))


class Moves:
    """The fake transport's choices: ``length`` of them from a generator seeded by hypothesis,
    then ``None`` (a draw per move cost more than the run it drove, and hypothesis's own bytes
    and short lists rarely interleave blocks enough to make a result stale)."""

    def __init__(self, seed: int, length: int):
        self.rng, self.left = random.Random(seed), length

    def pick(self, n: int) -> int | None:
        if self.left <= 0:
            return None
        self.left -= 1
        return self.rng.randrange(n)

    def more(self, n: int, default: int = 0) -> int:
        got = self.pick(n)
        return default if got is None else got


@EXAMPLES
@given(shape=asgd_runs(), moves=st.tuples(st.integers(0, 2**32 - 1), st.integers(MOVES // 8, MOVES)))
def test_asgd_applies_every_step_once_under_duplicates_late_arrivals_and_retrains(shape, moves):
    """ps.max_staleness 1 or 2 makes retrains common, 1000 rules them out. ``numbering``: the
    stream's per-block seq (a retrained push keeps its seq) or the jobs transport's run-wide one
    (a retrained job is a new order, with a new seq)."""
    n, h = shape["blocks"], shape["h"]
    cfg = make_cfg("async", h=h, blocks=n, max_staleness=shape["max_staleness"], staleness=shape["rule"],
                   density_down=shape["density_down"], value_dtype=shape["value_dtype"],
                   epochs=shape["epochs"])
    w0 = initial_weights(shape["seed"])
    pass_steps = dict(enumerate(shape["pass_steps"]))
    run = make_run(cfg, make_spec(cfg), w0, RunShape(pass_steps, bsp=False, downlink_every=-(-n // 2)))
    model = Model(run, n, w0, bsp=False, h=h, max_staleness=shape["max_staleness"], rule=shape["rule"])
    workers = [Worker(k, p, shape["epochs"]) for k, p in pass_steps.items()]
    rng = np.random.default_rng(shape["seed"])
    moves = Moves(*moves)
    sent: list[Arrival] = []
    jobs = 0  # the jobs transport's run-wide order number

    def train(w: Worker) -> None:
        nonlocal jobs
        seq = w.seq if shape["numbering"] == "stream" else jobs
        jobs += 1
        w.pending = arrival(w.block, seq, run.version, w.cursor, w.next_steps(h), LRS[moves.more(len(LRS))],
                            random_payload(rng, shape["value_dtype"]))

    def send(w: Worker) -> None:
        a, w.pending = w.pending, None
        d = model.deliver(a)
        for _ in range(moves.more(3)):  # the same result again at once (a speculative or retried task)
            model.deliver(a)
        sent.append(a)
        if d.kind == APPLIED:
            w.advance(a.steps)
            w.seq += 1
        # RETRAIN: the block trains the same steps again (the stream: with the same seq)

    play(workers, model, moves, sent, train, send, can_send=lambda w: True)
    check_end(run, model, workers)


def play(workers, model, moves, sent, train, send, can_send) -> None:
    """The moves until the run ends: a block sends its pending result (when ``can_send``), trains
    its next one, or a result delivered before arrives once more, possibly long after later seqs
    were applied. Once the moves are read: one block at a time, so each result is fresh and the
    run ends."""
    moved = 0
    while not finish(workers, model, moved):
        moved += 1
        choices = [("send", w) for w in workers if w.pending is not None and can_send(w)]
        choices += [("train", w) for w in workers if w.pending is None and not w.finished]
        assert choices, "no block can move:\n" + "\n".join(model.wrong[:10])
        choices += [("again", None)] if sent else []
        at = moves.pick(len(choices))
        kind, w = choices[0 if at is None else at]
        if kind == "train":
            train(w)
        elif kind == "send":
            send(w)
        else:
            model.deliver(sent[moves.more(len(sent))])


# -- BSP --------------------------------------------------------------------------------------------
@st.composite
def bsp_runs(draw):
    return dict(blocks=draw(st.integers(1, 4)), pass_steps=draw(st.integers(1, 4)),
                epochs=draw(st.integers(1, 2)), h=draw(st.integers(1, 3)),
                density_down=draw(st.sampled_from([0.0, 0.1])),
                value_dtype=draw(st.sampled_from(["float16", "float32"])), seed=draw(st.integers(0, 2**16)))


@EXAMPLES
@given(shape=bsp_runs(), moves=st.tuples(st.integers(0, 2**32 - 1), st.integers(MOVES // 8, MOVES)))
def test_bsp_applies_every_round_once_under_duplicates_and_late_arrivals(shape, moves):
    """Every block trains the same steps per round (the sync stream's pass is the smallest
    block's); a round's lr is the same for all its blocks, as one order or one reply gives it."""
    n, h, p = shape["blocks"], shape["h"], shape["pass_steps"]
    cfg = make_cfg("sync", h=h, blocks=n, density_down=shape["density_down"],
                   value_dtype=shape["value_dtype"], epochs=shape["epochs"])
    w0 = initial_weights(shape["seed"])
    run = make_run(cfg, make_spec(cfg), w0, RunShape({k: p for k in range(n)}, bsp=True))
    model = Model(run, n, w0, bsp=True, h=h, max_staleness=cfg.ps.max_staleness, rule="none")
    workers = [Worker(k, p, shape["epochs"]) for k in range(n)]
    rng = np.random.default_rng(shape["seed"])
    moves = Moves(*moves)
    sent: list[Arrival] = []

    def train(w: Worker) -> None:  # round w.seq, from the version now (one round old when it computes ahead)
        w.pending = arrival(w.block, w.seq, run.version, w.cursor, w.next_steps(h), LRS[w.seq % len(LRS)],
                            random_payload(rng, shape["value_dtype"]))
        w.advance(w.pending.steps)
        w.seq += 1

    def send(w: Worker) -> None:
        a, w.pending = w.pending, None
        for _ in range(1 + moves.more(3)):
            model.deliver(a)
        sent.append(a)
        w.sent = a.seq

    # a block sends round r once round r - 1 is applied (its reply waited for it), and trains
    # round r + 1 once round r is sent
    play(workers, model, moves, sent, train, send, can_send=lambda w: model.last[w.block] == w.sent)
    for a in sent:  # every result once more at the end: all duplicates now
        model.deliver(a)
    check_end(run, model, workers)
