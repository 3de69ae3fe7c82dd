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
                  f"schedule's length), judged on {tg.LONG_SEEDS} seed as its target states, where the "
                  f"table's accuracy targets need {tg.MIN_SEEDS}.", "",
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


LINKS_NAME, LINKS_SCRIPT = "links-cifar10", "cifar_links"  # bench/cifar_links.py's results file
LINKS_TITLE = "## Slow links on CIFAR-10 (JPEG copy): GS-ASGD + MS against ASGD"


def _link_rows(doc: dict) -> list[list[str]]:
    pred = _get(doc, "predicted") or {}
    rows = []
    for rate, by in (_get(doc, "rates") or {}).items():
        for name, c in (by or {}).items():
            if not isinstance(c, dict):
                continue
            p = (pred.get(rate) or {}).get(name) or {}
            reps = _list(c.get("repetitions"))
            reached = sum(isinstance(r.get("time_to_0_60_s"), (int, float)) for r in reps if isinstance(r, dict))
            rows.append([rate, LABELS.get(name, name), _g(c.get("time_to_0_60_s")) + (
                f" ({reached}/{len(reps)} reached)" if reps and reached < len(reps) else ""),
                _g(p.get("time_to_0_60_s")) if p else "—", _g(c.get("images_per_s")),
                _g(p.get("images_per_s")) if p else "—", _g(p.get("bound")) if p else "—",
                _g(c.get("test_accuracy")), _g((c.get("bytes_up_per_step") or 0) * 1e-3),
                _g((c.get("bytes_down_per_step") or 0) * 1e-3), _g(len(reps) or c.get("reps"))])
    return rows


def cifar_links_section(doc: dict | None) -> str:
    """The slow-link section's markdown, from links-cifar10.json; "Not measured in this run." without it."""
    out = [LINKS_TITLE, ""]
    if not isinstance(doc, dict):
        return "\n".join(out + [NOT_MEASURED])
    r100 = _get(doc, "ratio_at_100mbit") or {}
    cells = {name: c for by in (_get(doc, "rates") or {}).values() for name, c in (by or {}).items()
             if isinstance(c, dict)}
    out += [measured(doc, LINKS_NAME), "",
            _table(["Link", "Row", "To 0.60 (s), median", "To 0.60 (s), model", "Images/s", "Images/s, model",
                    "Model's bound", "Final accuracy", "Up (kB/step)", "Down (kB/step)", "Repetitions"],
                   _link_rows(doc)), "",
            f"ResNet-20 at 2 blocks on the 2-host test bed (one core a host, each host's link shaped both ways), "
            f"{_epochs(_get(doc, 'epochs'))} a run, seed 42; each cell the median of its repetitions, the rates "
            "in turn within a repetition. To 0.60: seconds from the run's start to the first epoch end at 0.60 "
            "test accuracy. The model's columns are bench/linkmodel.py's prediction from the same row's "
            f"unshaped cell and β = {_g(_get(doc, 'beta_ns_per_byte'))} ns per shaped byte (from "
            f"{_g(_get(doc, 'linkmodel'))}); its time to 0.60 scales the unshaped one by the predicted "
            f"images/s. At 100 Mbit/s, ASGD's time to 0.60 over GS-ASGD + MS's: {_g(r100.get('measured'))} "
            f"measured, {_g(r100.get('predicted'))} predicted (reported, not a target).", "",
            "Reproduce each row (its config file and command; the bench adds the link and the repetition):", "",
            *(f"- {LABELS.get(name, name)}: {_config_file(c)}, {_command(c)}" for name, c in cells.items())]
    block = targets_block(doc, LINKS_NAME, tg.of_links(doc), script=LINKS_SCRIPT)
    return "\n".join(out + (["", block] if block else []))


def cifar_headline(doc: dict | None, links: dict | None) -> str:
    """The README's one line on CIFAR-10: GS-ASGD + MS against ASGD and Keras in the seed table,
    and its time to 0.60 against ASGD's at 10 Mbit/s, each with its verdict."""
    rows = {_name(r): r for r in table_rows(doc)}
    if not rows and not isinstance(links, dict):
        return "- **CIFAR-10 (JPEG copy):** not measured in this run."
    ms, asgd, keras = (rows.get(k, {}) for k in ("stream-gs-asgd-ms", "stream-asgd", "keras"))
    parts = []
    if rows:
        claim = tg.of_accuracy_cifar(doc)[1]
        parts.append(f"GS-ASGD + MS {_pm(*_stat(ms, 'test_accuracy'), 4)} against ASGD "
                     f"{_pm(*_stat(asgd, 'test_accuracy'), 4)} and Keras `model.fit` "
                     f"{_pm(*_stat(keras, 'test_accuracy'), 4)} after {_epochs(_get(doc, 'epochs'))} at "
                     f"{_g(ms.get('blocks'))} blocks (the seeds' claim {claim.verdict})")
    speed = next((t for t in tg.of_links(links) if t.name.startswith("gs_asgd_ms_0_60_speedup_at_10mbit")), None)
    if speed:
        said = f"reaches 0.60 {speed.figure}x sooner than ASGD" if speed.figure != "—" else "has no ratio to ASGD's"
        parts.append(f"at 10 Mbit/s a host it {said} (target 3x: {speed.verdict})")
    return "- **CIFAR-10 (JPEG copy), ResNet-20:** " + "; ".join(parts) + "."
