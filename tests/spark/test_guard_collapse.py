"""A real collapse, caught: the stream at one step per exchange with a peak lr far too high.

The lr warms up linearly from lr/10 over 3 epochs to 3.0, sixty times the project's: training
is sound at first, then the loss explodes as the lr climbs. (At a peak of 1.0 the collapse was a
matter of the pushes' order: in 6 of 22 runs halving the lr brought the loss back near chance's
2.3 between spikes, the spikes never came 3 in a row, and the run went on at chance. At 3.0 the
loss kept spiking through the halvings in 10 runs of 10.) DGC's local gradient clipping, on by
default, bounds each step and keeps even this lr from collapsing, so it is off here
(``compression.clip_norm=0``). Without the guard (its factors out of
reach, no limit on spikes in a row) the run goes on and ends at chance level. With the guard as
shipped (halve the lr on a spike), halving does not undo the collapse; after
``guard.max_spikes_in_a_row`` spiking judgments in a row the run stops with ``Diverged`` (exit 3).

A quiet collapse too: on the jobs transport (sync, one step per round, deterministic) a constant
lr of 0.5 takes the model to chance level without a spike the spike rule sees (one pooled loss of
3.99 against a median near 2.2, then 2.30-2.40 to the end). The chance rule stops it.
"""

import math
import os

import pytest

from sparkcnn.errors import Diverged

COLLAPSE = ["engine.transport=stream", "engine.mode=async", "train.steps_per_round=1", "train.epochs=4",
            "train.batch_size=32", "train.lr=3.0", "train.lr_warmup_epochs=3", "train.lr_schedule=constant",
            "compression.method=threshold", "compression.density=0.01", "compression.dense_below=1000",
            "compression.density_down=0.05", "compression.clip_norm=0", "guard.loss_samples=128"]
QUIET = ["train.epochs=4", "train.batch_size=32", "train.steps_per_round=1", "train.lr=0.5",
         "train.lr_warmup_epochs=1", "train.lr_schedule=constant", "guard.loss_samples=128"]
GUARD_OFF = ["guard.loss_spike_factor=1e12", "guard.max_norm_factor=1e12", "guard.max_spikes_in_a_row=0"]


def _rounds(run_dir: str) -> list[dict]:
    from sparkcnn.metrics import read_jsonl

    return [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if r["kind"] == "round"]


def _run_dir(out: str) -> str:
    [name] = os.listdir(out)
    return os.path.join(out, name)


@pytest.fixture(scope="module")
def runs(spark, tiny_data, tmp_path_factory):
    from sparkcnn import config
    from sparkcnn.train import train

    out = {}
    off_dir = tmp_path_factory.mktemp("guard-off")
    summary = train(config.load(None, [f"data.path={tiny_data}", f"run.out_dir={off_dir}", *COLLAPSE, *GUARD_OFF]),
                    progress=None)
    out["off"] = summary, _rounds(summary["run_dir"])
    on_dir = tmp_path_factory.mktemp("guard-on")
    with pytest.raises(Diverged) as caught:
        train(config.load(None, [f"data.path={tiny_data}", f"run.out_dir={on_dir}", *COLLAPSE]), progress=None)
    out["on"] = caught.value, _rounds(_run_dir(str(on_dir)))
    return out


def test_without_the_guard_the_run_collapses_to_chance(runs):
    summary, rounds = runs["off"]
    early = sum(r["loss"] for r in rounds[:20]) / 20
    worst = max(r["loss"] for r in rounds)
    print(f"\nguard collapse: off -> test accuracy {summary['test_accuracy']:.3f}, loss {early:.3g} early, "
          f"{worst:.3g} at worst, spikes counted {summary['loss_spikes']}")
    assert summary["test_accuracy"] <= 0.2  # 10 classes: chance is 0.1
    assert worst > 10 * early
    # reported: the guard's counts and what its actions left (halve_lr on each spike it saw)
    assert summary["rejected_deltas"] == 0 and summary["guard_density_factor"] == 1.0
    assert summary["guard_lr_factor"] == 0.5 ** summary["loss_spikes"]
    with open(os.path.join(summary["run_dir"], "report.md"), encoding="utf-8") as fh:
        assert f"{summary['loss_spikes']} loss spikes (lr x{0.5 ** summary['loss_spikes']:g}" in fh.read()


def test_with_the_guard_the_collapse_stops_the_run(runs):
    err, rounds = runs["on"]
    print(f"guard collapse: on -> {err}")
    assert err.exit_code == 3
    assert "spiked in 3 judgments in a row despite guard.action=halve_lr" in str(err)
    assert str(err).count("\n") == 0
    early = sum(r["loss"] for r in rounds[:20]) / 20
    assert max(r["loss"] for r in rounds) > 3 * early  # it was collapsing when it stopped
    assert len(rounds) < 4 * 38  # stopped well before the 4 epochs' pushes


def test_spikes_in_a_row_reset_on_a_sound_judgment_and_survive_a_checkpoint():
    from sparkcnn.guard import DivergenceGuard

    g = DivergenceGuard(loss_spike_factor=3, warmup=3)
    for loss in (1.0, 1.0, 1.0, 9.0, 9.0):
        g.check_loss(loss)
    assert (g.spikes, g.in_a_row) == (2, 2)
    resumed = DivergenceGuard(loss_spike_factor=3, warmup=3)
    resumed.load_state_dict(g.state_dict())
    assert resumed.in_a_row == 2 and resumed.check_loss(float("nan")) and resumed.in_a_row == 3
    assert not resumed.check_loss(1.1) and resumed.in_a_row == 0
    assert DivergenceGuard().load_state_dict({"spikes": 1}) is None  # an older checkpoint: none in a row


def test_max_spikes_in_a_row_is_checked():
    from sparkcnn import config
    from sparkcnn.errors import BadInput

    with pytest.raises(BadInput, match=r"guard\.max_spikes_in_a_row must be >= 0, got -1"):
        config.load(None, ["guard.max_spikes_in_a_row=-1"])
    with pytest.raises(BadInput, match=r"guard\.max_chance_in_a_row must be >= 0, got -2"):
        config.load(None, ["guard.max_chance_in_a_row=-2"])


@pytest.fixture(scope="module")
def quiet(spark, tiny_data, tmp_path_factory):
    from sparkcnn import config
    from sparkcnn.train import train

    off_dir = tmp_path_factory.mktemp("quiet-off")
    summary = train(config.load(None, [f"data.path={tiny_data}", f"run.out_dir={off_dir}", *QUIET,
                                       "guard.max_chance_in_a_row=0"]), progress=None)
    on_dir = tmp_path_factory.mktemp("quiet-on")
    with pytest.raises(Diverged) as caught:
        train(config.load(None, [f"data.path={tiny_data}", f"run.out_dir={on_dir}", *QUIET]), progress=None)
    return (summary, _rounds(summary["run_dir"])), (caught.value, _rounds(_run_dir(str(on_dir))))


def test_a_quiet_collapse_to_chance_is_no_spike(quiet):
    (summary, rounds), _ = quiet
    tail = [r["loss"] for r in rounds[-40:]]
    print(f"\nquiet collapse: off -> test accuracy {summary['test_accuracy']:.3f}, best loss "
          f"{min(r['loss'] for r in rounds):.3g}, last 40 losses {min(tail):.3g}-{max(tail):.3g}, "
          f"{summary['losses_at_chance']} judged at chance")
    assert summary["test_accuracy"] <= 0.2
    assert summary["loss_spikes"] == 0  # the spike rule saw nothing: the lr was never halved
    assert summary["guard_lr_factor"] == 1.0
    assert abs(sum(tail) / len(tail) - math.log(10)) < 0.1  # it sat at chance, ln 10
    # the chance rule saw it, judgment after judgment, and said so (no limit: the run went on)
    assert summary["losses_at_chance"] >= 20
    with open(os.path.join(summary["run_dir"], "report.md"), encoding="utf-8") as fh:
        assert f"{summary['losses_at_chance']} losses back at chance level" in fh.read()


def test_the_chance_rule_stops_a_quiet_collapse(quiet):
    _, (err, rounds) = quiet
    print(f"quiet collapse: on -> {err}")
    assert err.exit_code == 3 and str(err).count("\n") == 0
    assert "at or above chance level (ln 10 = 2.303)" in str(err)
    assert "10 judgments in a row: the run collapsed (guard.max_chance_in_a_row=10)" in str(err)
    assert len(rounds) < 40  # stopped in the first epoch of four (19 rounds each)


def test_the_chance_rule_waits_for_learning_and_survives_a_checkpoint():
    from sparkcnn.guard import DivergenceGuard

    c = math.log(10)
    g = DivergenceGuard(warmup=3, chance_loss=c)
    for loss in (2.31, 2.30, 2.32, 2.29, 2.35):  # at chance before learning anything: not counted
        g.check_loss(loss)
    assert g.chance_in_a_row == 0 and g.best == 2.29
    for loss in (1.5, 2.6, 2.2):  # learned (1.5 <= 0.9 ln 10), one loss above ln 10, one below
        assert not g.check_loss(loss)
    assert g.chance_in_a_row == 0 and g.best == 1.5
    assert not g.check_loss(c * 0.996) and not g.check_loss(2.40)  # within the band around ln 10
    assert g.chance_in_a_row == 2 and g.best == 1.5 and g.spikes == 0
    resumed = DivergenceGuard(warmup=3, chance_loss=c)
    resumed.load_state_dict(g.state_dict())
    assert not resumed.check_loss(2.35)
    assert (resumed.chance_in_a_row, resumed.in_a_row, resumed.best) == (3, 0, 1.5)
    assert resumed.check_loss(9.9) is True  # a spike (> 3 x median): far above chance, no chance count
    assert (resumed.chance_in_a_row, resumed.in_a_row) == (0, 1)
    assert not DivergenceGuard(warmup=3).at_chance(3.0)  # no class count: no chance rule
    assert DivergenceGuard(chance_loss=c).load_state_dict({"best": None}) is None


def test_an_overshoot_above_chance_that_recovers_is_not_a_collapse():
    """The pooled losses of GS-ASGD + MS on 8 blocks through its lr peak (rounded from a real
    run that ended its epoch at 0.697 test accuracy): above ln 10 for a tenth of an epoch,
    confidently wrong, then back. Through the band around ln 10 on the way up and down, never
    3 judgments in a row; a loss that settles at ln 10 still counts."""
    from sparkcnn.guard import DivergenceGuard

    c = math.log(10)
    g = DivergenceGuard(warmup=5, chance_loss=c)
    overshoot = [2.29, 2.28, 2.27, 2.24, 2.21, 2.15, 2.06, 1.88, 1.65, 1.38, 1.32, 1.58, 1.70,
                 2.35, 2.62, 2.95, 3.28, 2.99, 2.77, 2.41, 1.92, 1.48, 1.35, 1.19]
    counts = []
    for loss in overshoot:
        g.check_loss(loss)
        counts.append(g.chance_in_a_row)
    assert max(counts) == 1 and g.spikes == 0 and g.best == 1.19
    assert [g.check_loss(x) or g.chance_in_a_row for x in (2.31, 2.33, 2.30)] == [1, 2, 3]  # a collapse


def test_a_slow_pass_through_chance_goes_on_and_a_stay_at_chance_stops(tiny_cfg):
    """The driver's stop, on the pooled losses of the seed table's sparsification-aware momentum
    on 8 blocks: 3 judgments at ln 10 after 1.272, which stopped one seed of 3 when 3 in a row
    were enough; with the stop off that seed ended its epoch at 0.705. A collapse stays there."""
    from sparkcnn.backends.inprocess import LocalBackend
    from sparkcnn.train import build_engine

    def driver(*overrides):
        cfg = tiny_cfg.replace(guard__loss_samples=0, **dict(overrides))
        backend = LocalBackend("t-chance")
        return build_engine(cfg, backend, backend.run_id)[0].server

    learned = [2.1, 1.8, 1.5, 1.35, 1.272, 1.30]
    d = driver()
    for i, loss in enumerate([*learned, 2.2912, 2.30, 2.35, 2.12, 1.62, 1.30]):  # through ln 10, and back
        d.check_loss(f"exchange {i}", loss)
    assert d.counters["losses_at_chance"] == 3 and d.guard.chance_in_a_row == 0
    stays = [2.30 + 0.01 * (i % 3) for i in range(10)]
    with pytest.raises(Diverged, match=r"exchange 9: training loss 2\.3.*10 judgments in a row: the run "
                                       r"collapsed \(guard\.max_chance_in_a_row=10\)") as caught:
        for i, loss in enumerate(stays):
            d.check_loss(f"exchange {i}", loss)
    assert caught.value.exit_code == 3 and d.counters["losses_at_chance"] == 13
    never = driver(("guard__max_chance_in_a_row", 0))
    for i, loss in enumerate([*learned, *stays, *stays]):
        never.check_loss(f"exchange {i}", loss)
    assert never.counters["losses_at_chance"] == 20 and never.guard.chance_in_a_row == 20
