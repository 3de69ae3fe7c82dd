"""Progress (tqdm): plain lines, bounded per run, when the stream is no terminal; one bar on a terminal."""

import io
import re

from sparkcnn.backends.inprocess import LocalBackend
from sparkcnn.metrics import ProgressBar


class Tty(io.StringIO):
    def isatty(self):
        return True


def _round(t, epoch=0):
    return {"kind": "round", "round": t, "epoch": epoch, "loss": 2.0 / (t + 1), "accuracy": 0.5,
            "images_per_s": 1234.0, "bytes_up": 3000}


def _epoch(e):
    return {"kind": "epoch", "epoch": e, "test_loss": 0.5, "test_accuracy": 0.8, "wall_s": 1.5}


def test_training_to_a_log_prints_a_bounded_number_of_lines(tiny_cfg):
    from sparkcnn.train import train

    # one step per round: ~38 rounds over 2 epochs, more than the 5 lines allowed
    cfg = tiny_cfg.replace(train__steps_per_round=1)
    out = io.StringIO()
    summary = train(cfg, backend=LocalBackend("t-progress"), progress=ProgressBar(stream=out, lines=5))
    text = out.getvalue()
    assert "\r" not in text and "\x1b" not in text  # a log gets plain lines, no redraws
    lines = text.splitlines()
    rounds = [ln for ln in lines if re.match(r"epoch \d+: \d+/\d+ rounds", ln)]
    epochs = [ln for ln in lines if re.match(r"epoch \d+: test loss", ln)]
    assert summary["rounds"] > 5 * 4
    assert len(rounds) == 5 and len(epochs) == 2 and len(lines) == 7
    total = summary["rounds"]
    assert rounds[-1].startswith(f"epoch 2: {total}/{total} rounds (100%)")
    assert "loss=" in rounds[0] and "img/s" in rounds[0]
    assert f"test accuracy {summary['test_accuracy']:.4f}" in epochs[-1]


def test_lines_are_bounded_however_many_rounds_and_async_jumps():
    out = io.StringIO()
    bar = ProgressBar(stream=out)  # 20 lines per run by default
    for t in range(5000):
        bar.round(_round(t, t // 1000), 5000)
        if t % 1000 == 999:
            bar.epoch(_epoch(t // 1000))
    assert len(out.getvalue().splitlines()) == 20 + 5
    out = io.StringIO()
    bar = ProgressBar(stream=out)
    for t in (3, 3, 2, 400, 999):  # async: a progress scaled to 1000 that may repeat or jump
        bar.round(_round(t), 1000)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[-1].startswith("epoch 1: 1000/1000 rounds")


def test_resumed_run_counts_from_where_it_starts():
    out = io.StringIO()
    bar = ProgressBar(stream=out, lines=10)
    for t in range(60, 100):  # resumed at round 60 of 100: 4 of the 10 steps are left
        bar.round(_round(t), 100)
    assert len(out.getvalue().splitlines()) == 4


def test_terminal_gets_one_redrawn_bar_and_epoch_lines_above_it():
    out = Tty()
    bar = ProgressBar(stream=out)
    assert bar.mode == "tty"
    for t in range(200):
        bar.round(_round(t, t // 100), 200)
        if t % 100 == 99:
            bar.epoch(_epoch(t // 100))
    text = out.getvalue()
    assert text.count("\r") > 2  # redrawn in place
    assert "epoch 1: test loss 0.5000 test accuracy 0.8000" in text
    assert "200/200" in text and "loss=0.0100" in text
    # the bar's line plus the two epoch lines: a terminal does not scroll per round
    assert text.count("\n") <= 4
