"""Run report: PNG plots and a markdown page from ``metrics.jsonl`` and ``summary.json``.

Plots need the ``viz`` extra (matplotlib); without it the markdown is still written.
The run directory may be a local path or a URI (:mod:`sparkcnn.runfs`).
"""

from __future__ import annotations

import io
import json

from sparkcnn import runfs
from sparkcnn.errors import BadInput
from sparkcnn.metrics import atomic_write_text, fmt_bytes, read_jsonl


def _load(run_dir: str):
    runfs.check(run_dir)
    mpath = runfs.join(run_dir, "metrics.jsonl")
    if not runfs.isfile(mpath):
        raise BadInput(f"{run_dir}: not a run directory (no metrics.jsonl)")
    try:
        records = read_jsonl(mpath)
    except json.JSONDecodeError as e:
        raise BadInput(f"{mpath}: line {e.lineno}: not valid JSON") from None
    spath = runfs.join(run_dir, "summary.json")
    summary = {}
    if runfs.isfile(spath):
        summary = json.loads(runfs.read_text(spath))
    rounds = [r for r in records if r.get("kind") == "round"]
    return rounds, [r for r in records if r.get("kind") == "epoch"], summary


def _plot(run_dir: str, rounds: list[dict], epochs: list[dict]) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(2, 2, figsize=(11, 7))
    t = [r["round"] + 1 for r in rounds]
    ax[0, 0].plot(t, [r["loss"] for r in rounds], lw=1)
    ax[0, 0].set(title="training loss per round", xlabel="round", ylabel="loss")
    scored = [e for e in epochs if e.get("test_accuracy") is not None]  # none without test data
    ax[0, 1].plot([e["epoch"] + 1 for e in scored], [e["test_accuracy"] for e in scored], "o-")
    ax[0, 1].set(title="test accuracy per epoch" if scored else "no test data", xlabel="epoch",
                 ylabel="accuracy")
    ax[1, 0].plot(t, [r["images_per_s"] for r in rounds], lw=1)
    ax[1, 0].set(title="throughput", xlabel="round", ylabel="images/s")
    ax[1, 1].semilogy(t, [max(1, r["bytes_up"]) for r in rounds], label="up (measured)")
    ax[1, 1].semilogy(t, [max(1, r["bytes_down"]) for r in rounds], label="down (measured)")
    ax[1, 1].semilogy(t, [r["dense_bytes"] for r in rounds], "--", label="dense (4·P per block)")
    ax[1, 1].set(title="bytes per round", xlabel="round", ylabel="bytes")
    ax[1, 1].legend(fontsize=8)
    for a in ax.flat:
        a.grid(alpha=0.3)
    fig.suptitle(runfs.name(run_dir))
    fig.tight_layout()
    path = runfs.join(run_dir, "report.png")
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=90)
    plt.close(fig)
    runfs.write_bytes(path, png.getvalue())
    return path


def write_report(run_dir: str) -> dict:
    rounds, epochs, summary = _load(run_dir)
    png = _plot(run_dir, rounds, epochs)
    lines = [f"# sparkcnn run `{runfs.name(run_dir)}`", ""]
    if summary:
        lines += [f"- model: {summary.get('model')} ({summary.get('params')} parameters), "
                  f"{summary.get('num_blocks')} blocks, mode {summary.get('mode')}, "
                  f"{summary.get('steps_per_round')} steps per round",
                  f"- final test accuracy: **{summary.get('test_accuracy')}**",
                  f"- wall time: {summary.get('wall_s', 0):.1f} s, "
                  f"{summary.get('images_per_s', 0):.0f} images/s",
                  f"- bytes up: {fmt_bytes(summary.get('bytes_up', 0))} "
                  f"(dense would be {fmt_bytes(summary.get('dense_bytes_up', 0))}), "
                  f"bytes down: {fmt_bytes(summary.get('bytes_down', 0))}",
                  f"- mean round overhead: {summary.get('mean_round_overhead_ms', 0):.0f} ms "
                  f"next to {summary.get('mean_round_compute_ms', 0):.0f} ms of compute",
                  f"- divergence guard: {summary.get('rejected_deltas', 0)} deltas rejected, "
                  f"{summary.get('loss_spikes', 0)} loss spikes "
                  f"(lr x{summary.get('guard_lr_factor', 1.0):g}, "
                  f"density x{summary.get('guard_density_factor', 1.0):g} after its actions), "
                  f"{summary.get('losses_at_chance', 0)} losses back at chance level", ""]
    lines += ["| epoch | test accuracy | test loss | train loss | bytes up | wall s |",
              "|---:|---:|---:|---:|---:|---:|"]
    for e in epochs:
        acc, loss = (e.get(k) for k in ("test_accuracy", "test_loss"))
        acc, loss = ("–" if v is None else f"{v:.4f}" for v in (acc, loss))
        lines.append(f"| {e['epoch'] + 1} | {acc} | {loss} | {e.get('train_loss') or 0:.4f} | "
                     f"{fmt_bytes(e.get('bytes_up', 0))} | {e['wall_s']:.1f} |")
    if png:
        lines += ["", "![metrics](report.png)"]
    md = runfs.join(run_dir, "report.md")
    atomic_write_text(md, "\n".join(lines) + "\n")
    return {"report": md, "plot": png, "epochs": len(epochs), "rounds": len(rounds)}
