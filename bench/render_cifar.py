"""BENCHMARKS.md's "Seed experiment on CIFAR-10 (JPEG copy)" section, from accuracy-cifar10.json.

bench/cifar_seeds.py prints that file: the six rows of the table at 4 blocks (Keras ``model.fit``
in one process beside them), GS-ASGD + MS at 2 blocks against the Keras row (time to 0.80 on the
same epochs), and one longer GS-ASGD + MS run. Each row shows the model and blocks it trained, its
conf/ file and command; the section ends with its three targets (bench/targets.py's
``of_accuracy_cifar``). A pure function of the JSON, as the rest of bench/render.py.
"""

from __future__ import annotations

from bench import targets as tg
from bench.render import (NOT_MEASURED, _command, _config_file, _g, _list, _name, _plural, _pm, _reached,
                          _stat, _table, measured, targets_block)
from bench.targets import _get

NAME = "accuracy-cifar10"  # the results file, as bench/run_all.py saves it
SCRIPT = "cifar_seeds"  # the bench that prints it
TITLE = "## Seed experiment on CIFAR-10 (JPEG copy)"
LABELS = {"keras": "Keras `model.fit`, one process", "sync-dense": "Sync SGD, dense (jobs transport)",
          "stream-asgd": "ASGD (stream, async, H = 1, dense)",
          "stream-gs-asgd": "GS-ASGD (+ uplink sparsification, momentum correction)",
          "stream-gs-asgd-ms": "GS-ASGD + MS (+ model-parameter sparsification)",
          "stream-gs-asgd-samomentum": "GS-ASGD + MS + SAMomentum",
          "stream-gs-asgd-ms-2blocks": "GS-ASGD + MS, 2 blocks",
          "stream-gs-asgd-ms-long": "GS-ASGD + MS, longer run"}


def _label(row: dict) -> str:
    seeds, collapsed = _list(row.get("seeds")), row.get("collapsed")
    return (LABELS.get(_name(row), _name(row)) + f" ({_plural(len(seeds), 'seed')}"
            + (f", {collapsed} collapsed" if isinstance(collapsed, int) and collapsed else "") + ")")


def _epochs(x) -> str:
    return _plural(x, "epoch") if isinstance(x, int) and not isinstance(x, bool) else f"{_g(x)} epochs"


def _mb(row: dict, key: str) -> str:
    return _pm(*_stat(row, key), 1, 1e-6)


def _to(row: dict, key: str) -> str:
    """Seconds to an accuracy, mean ± sd over the seeds that reached it, (k/n) when not all did."""
    return _pm(*_stat(row, key), 1) + _reached(row, key)


def table_rows(doc: dict | None) -> list[dict]:
    """The table's rows: the Keras row first, then the distributed rows as the bench ran them."""
    keras = _get(doc, "keras")
    rows = [r for r in _list(_get(doc, "rows")) if isinstance(r, dict)]
    return ([keras] if isinstance(keras, dict) else []) + rows


def _main_table(rows: list[dict]) -> str:
    body = [[_label(r), _g(r.get("model")), _g(r.get("blocks")), _pm(*_stat(r, "test_accuracy"), 4),
             _to(r, "time_to_0_70_s"), _to(r, "time_to_0_80_s"), _pm(*_stat(r, "wall_s"), 1),
             _mb(r, "bytes_up"), _mb(r, "bytes_down"), _mb(r, "steady_bytes_up_per_epoch"),
             _mb(r, "steady_bytes_down_per_epoch")] for r in rows]
    return _table(["Row", "Model", "Blocks", "Final accuracy", "To 0.70 (s)", "To 0.80 (s)", "Wall (s)",
                   "Up, run (MB)", "Down, run (MB)", "Up, steady (MB/epoch)", "Down, steady (MB/epoch)"],
                  body)


def _two_blocks(two) -> list[str]:
    out = ["### Two blocks: GS-ASGD + MS against Keras, time to 0.80", ""]
    if not isinstance(two, dict):
        return out + [NOT_MEASURED]
    rows = [r for r in (two.get("keras"), two.get("gs_asgd_ms")) if isinstance(r, dict)]
    ratio = two.get("keras_over_gs_asgd_ms_to_0_80")
    body = [[_label(r), _g(r.get("blocks")), _pm(*_stat(r, "test_accuracy"), 4), _to(r, "time_to_0_80_s"),
             _pm(*_stat(r, "wall_s"), 1)] for r in rows]
    said = (f"Keras's time to 0.80 over GS-ASGD + MS's: {_g(ratio)} (above 1: GS-ASGD + MS reaches "
            "0.80 first)" if isinstance(ratio, (int, float))
            else "No ratio: a row did not reach 0.80 (or did not run)")
    whose = "table" if two.get("keras_from") == "table" else "comparison"
    return out + [_table(["Row", "Blocks", "Final accuracy", "To 0.80 (s)", "Wall (s)"], body), "",
                  f"Both on the same budget, {_epochs(two.get('epochs'))}; the Keras row is the "
                  f"{whose}'s own. {said}. Two blocks are one per core of this machine: the speed "
                  "comparison, where the 4-block table is not.", "",
                  *(f"- {_label(r)}: {_config_file(r)}, {_command(r)}" for r in rows)]


def _long(run) -> list[str]:
    out = ["### Longer run: GS-ASGD + MS", ""]
    if not isinstance(run, dict):
        return out + [NOT_MEASURED]
    body = [[_label(run), _g(run.get("model")), _g(run.get("blocks")), _g(run.get("epochs")),
             _pm(*_stat(run, "test_accuracy"), 4), _to(run, "time_to_0_80_s"), _to(run, "time_to_0_90_s"),
             _pm(*_stat(run, "wall_s"), 1)]]
    return out + [_table(["Row", "Model", "Blocks", "Epochs", "Final accuracy", "To 0.80 (s)", "To 0.90 (s)",
                          "Wall (s)"], body), "",
                  "One run against 0.90 at the end of a longer schedule (its epochs are the learning-rate "
                  "schedule's length): under the project's rule an accuracy target needs at least "
                  f"{tg.MIN_SEEDS} seeds, so one seed's is shown and not judged.", "",
                  f"- Reproduce: {_config_file(run)}, {_command(run)}"]


def cifar_seed_section(doc: dict | None) -> str:
    """The section's markdown; "Not measured in this run." without the file."""
    out = [TITLE, ""]
    if not isinstance(doc, dict):
        return "\n".join(out + [NOT_MEASURED])
    rows = table_rows(doc)
    spread = "mean ± sample standard deviation" if _get(doc, "std_ddof") == 1 else "mean ± standard deviation"
    seeds = ", ".join(map(str, _list(_get(doc, "seeds")))) or "—"
    out += [measured(doc, NAME), ""]
    if rows:
        out += [_main_table(rows), "",
                f"{_epochs(_get(doc, 'epochs'))} per run, seeds {seeds} (`run.seed`); rows over seeds "
                f"give {spread}. The distributed rows run the blocks shown on `local[N]`, two tasks a core "
                "of this 2-core machine at 4: the table is about accuracy and bytes, its times are reported "
                "but the speed claims come from the 2-block comparison below. To 0.70 / 0.80: seconds to "
                "the first epoch end at that test accuracy, over the seeds that reached it ((k/n) when only "
                "k of n did). Bytes: MB (10^6 bytes) all blocks sent to (up) and received from (down) the "
                "driver over the whole run, and per epoch once the density warm-up is over (the steady "
                "state). Epochs, densities and warm-ups are the conf/ files'.", "",
                "Reproduce each row (its config file and command):", "",
                *(f"- {_label(r)}: {_config_file(r)}, {_command(r)}" for r in rows)]
    else:
        out += ["The table's part did not run (`--parts`)."]
    out += ["", *_two_blocks(_get(doc, "two_blocks")), "", *_long(_get(doc, "long"))]
    block = targets_block(doc, NAME, tg.of_accuracy_cifar(doc), script=SCRIPT)
    return "\n".join(out + (["", block] if block else []))
