"""The spread the seed tables report: sample standard deviations (ddof = 1), none over one seed."""

import importlib
import json
import statistics

import pytest

accuracy = importlib.import_module("bench.accuracy")
momentum = importlib.import_module("bench.momentum")


def _run(seed: int, acc: float) -> dict:
    return {"seed": seed, "overrides": ["x=1", "run.seed=0"], "accuracy_per_epoch": [acc - 0.1, acc],
            "time_to_0_90_s": None, "test_accuracy": acc, "wall_s": 10.0 + seed}


def test_stream_aggregate_uses_the_sample_standard_deviation():
    accs = [0.90, 0.91, 0.93]
    agg = accuracy._aggregate("v", [_run(i, a) for i, a in enumerate(accs)])
    assert agg["test_accuracy_mean"] == pytest.approx(statistics.fmean(accs))
    assert agg["test_accuracy_std"] == pytest.approx(statistics.stdev(accs))  # 0.0153, not pstdev's 0.0125
    assert agg["test_accuracy_std"] != pytest.approx(statistics.pstdev(accs))
    one = accuracy._aggregate("v", [_run(0, 0.9)])
    assert one["test_accuracy_mean"] == 0.9 and one["test_accuracy_std"] is None


def test_momentum_summary_pairs_the_forms_by_setting_and_blocks():
    runs = [{"setting": "project", "blocks": n, "form": f, "seed": s, "test_accuracy": a,
             "bytes_up": 100, "bytes_down": 300, "pushes": 4}
            for n, f, s, a in [(2, "correction", 42, 0.80), (2, "correction", 43, 0.82),
                               (2, "sparsification_aware", 42, 0.84), (2, "sparsification_aware", 43, 0.85),
                               (8, "correction", 42, 0.70)]]
    rows = momentum.summarise(runs)
    assert [(r["setting"], r["blocks"]) for r in rows] == [("project", 2), ("project", 8)]
    two = rows[0]
    assert two["correction"]["mean"] == pytest.approx(0.81)
    assert two["correction"]["sd"] == pytest.approx(statistics.stdev([0.80, 0.82]))
    assert two["sparsification_aware"]["bytes_per_push"] == 100.0
    assert two["samomentum_minus_correction_points"] == pytest.approx(3.5)
    assert rows[1]["correction"]["sd"] is None and "samomentum_minus_correction_points" not in rows[1]


def test_momentum_summary_gives_training_loss_and_leaves_out_a_seed_the_guard_stopped():
    def run(f, seed, acc, losses):
        return {"setting": "lr_x4", "blocks": 8, "form": f, "seed": seed, "test_accuracy": acc,
                "train_loss_per_epoch": losses, "mean_staleness": 7.0, "bytes_up": 100, "bytes_down": 300,
                "pushes": 4}

    runs = [run("correction", 42, 0.80, [0.9, 0.5]), run("correction", 43, 0.82, [0.8, 0.3]),
            run("sparsification_aware", 42, 0.76, [1.0, 0.7]),
            {"setting": "lr_x4", "blocks": 8, "form": "sparsification_aware", "seed": 43, "test_accuracy": None,
             "stopped": "exchange 9: training loss 9.1 diverged", "wall_s": 3.0}]
    (row,) = momentum.summarise(runs)
    assert row["correction"]["final_train_loss"] == pytest.approx(0.4)
    assert row["correction"]["stopped"] == 0 and row["correction"]["mean_staleness"] == 7.0
    sa = row["sparsification_aware"]
    assert sa["seeds"] == 1 and sa["stopped"] == 1 and sa["final_train_loss"] == pytest.approx(0.7)
    assert row["samomentum_minus_correction_points"] == pytest.approx(-5.0)
    runs[2]["test_accuracy"] = None
    (row,) = momentum.summarise(runs)
    assert row["sparsification_aware"] == {"mean": None, "sd": None, "seeds": 0, "stopped": 2}
    assert "samomentum_minus_correction_points" not in row


def test_samomentum_moves_the_weights_less_than_momentum_correction_at_the_same_lr():
    """The two policies on one synthetic gradient stream, against dense momentum SGD."""
    small = {**momentum.DISPLACEMENT, "size": 20_000}
    mc, sa = (momentum.displacement(f, small) for f in momentum.FORMS)
    assert 0.5 < mc["along"] < 1.0  # most of the step applied; the rest waits in the residual
    assert sa["along"] < 0.5 * mc["along"]  # an entry sent rarely gains no momentum
    assert momentum.displacement("correction", small) == mc  # one stream per seed


def test_momentum_section_renders_the_committed_ablation():
    import os

    render = importlib.import_module("bench.render")
    folder = os.path.join(render.ROOT, "bench", "results", "2026-12-04-momentum")
    mo = render._load(folder, "momentum")
    text = render.momentum_section(mo, lambda *a: "![figure](momentum.png)")
    rows = [ln for ln in text.splitlines() if ln.startswith("| `") and ", N = 8: " not in ln]  # not the targets
    assert len(rows) == len(mo["summary"])
    for row, s in zip(rows, mo["summary"]):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[:2] == [f"`{s['setting']}`", str(s["blocks"])]
        mc, sa = s["correction"], s["sparsification_aware"]
        assert cells[2] == f"{mc['mean']:.4f} ± {mc['sd']:.4f}" and cells[3] == f"{sa['mean']:.4f} ± {sa['sd']:.4f}"
        assert cells[4] == f"{s['samomentum_minus_correction_points']:.2f}"
    n8 = [s for s in mo["summary"] if s["blocks"] == 8]
    for s in n8:  # the verdict follows the figure, whichever way it falls (2 seeds or more: judged)
        verdict = "holds" if s["samomentum_minus_correction_points"] >= -0.3 else "**misses**"
        assert (f"| `{s['setting']}`, N = 8: SAMomentum − correction >= -0.3 points | "
                f"{s['samomentum_minus_correction_points']:.2f} points (") in text
        assert f"| {verdict} | {mo['seeds']} seeds, mean |" in text
    assert render.momentum_section(None, lambda *a: "").endswith("Not measured in this run.")


def test_every_seed_table_row_runs_its_seeds_and_n8_rows_run_apart(monkeypatch):
    calls = []

    def fake(kind):
        def run(data, name, overrides, epochs, out_dir, config_file):
            calls.append((kind, name, overrides[-1]))
            return {**_run(int(overrides[-1].split("=")[1]), 0.9), "overrides": overrides}
        return run

    monkeypatch.setattr(accuracy, "run_variant", fake("here"))
    monkeypatch.setattr(accuracy, "run_isolated", fake("child"))
    jobs = accuracy.run_seeds("d", "sync-dense", accuracy.VARIANTS["sync-dense"], 1, "o", 3)
    n8 = accuracy.run_seeds("d", "stream-gs-asgd-ms-n8", accuracy.STREAM_VARIANTS["stream-gs-asgd-ms-n8"], 1, "o", 2)
    assert calls == [("here", "sync-dense", "run.seed=42"), ("here", "sync-dense", "run.seed=43"),
                     ("here", "sync-dense", "run.seed=44"), ("child", "stream-gs-asgd-ms-n8", "run.seed=42"),
                     ("child", "stream-gs-asgd-ms-n8", "run.seed=43")]
    assert jobs["seeds"] == [42, 43, 44] and jobs["overrides"] == []
    assert jobs["config_file"] == "conf/seed/fmnist_sync_dense.yaml"
    # the row's command: its file, the bench's shorter run, no seed (the row names its seeds)
    assert jobs["command"].startswith("sparkcnn train --config conf/seed/fmnist_sync_dense.yaml --set ")
    assert jobs["command"].endswith(" --set train.epochs=1") and "run.seed" not in jobs["command"]
    assert {"data.num_blocks=8", "engine.master=local[8]"} <= set(n8["overrides"])
    assert n8["command"].endswith("--set data.num_blocks=8 --set 'engine.master=local[8]'")


def test_seed_table_names_its_spread_and_its_blocks():
    render = importlib.import_module("bench.render")
    row = {**accuracy._aggregate("stream-gs-asgd-ms-n8", [_run(0, 0.80), _run(1, 0.82)]),
           "overrides": list(accuracy.STREAM_VARIANTS["stream-gs-asgd-ms-n8"].sets)}
    text = render.seed_table({"std_ddof": 1, "stream": [row]}, lambda *a: "")
    assert text.startswith("## Seed experiment (Fashion-MNIST, 2 blocks, 8 where the row says so)")
    assert "mean ± sample standard deviation" in text
    assert f"0.8100 ± {statistics.stdev([0.80, 0.82]):.4f}" in text
    assert "population, ddof 0" in render.seed_table({"stream": [row]}, lambda *a: "")


def test_a_result_is_written_into_a_folder_not_made_yet(tmp_path, capsys):
    """A long bench run ends with its file even when ``--out`` names a new folder: the same text
    as printed, with its provenance."""
    from bench._common import emit

    out = tmp_path / "2026-12-05-new" / "links.json"
    emit({"cells": 1}, str(out))
    printed = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == printed and printed["cells"] == 1 and "provenance" in printed
    assert [p.name for p in out.parent.iterdir()] == ["links.json"]  # no temporary file left


def test_a_seed_the_guard_stops_is_a_collapsed_row_not_a_failed_bench(monkeypatch):
    from sparkcnn.errors import Diverged

    def here(data, name, overrides, epochs, out_dir, config_file):
        seed = int(overrides[-1].split("=")[1])
        if seed == 43:
            raise Diverged("exchange 367: training loss 2.772, at or above chance level")
        return {**_run(seed, 0.90 + (seed - 42) / 100), "overrides": overrides}

    def child(data, name, overrides, epochs, out_dir, config_file):
        raise accuracy.Collapsed("exchange 12: the run collapsed")

    monkeypatch.setattr(accuracy, "run_variant", here)
    monkeypatch.setattr(accuracy, "run_isolated", child)
    row = accuracy.run_seeds("d", "stream-gs-asgd", accuracy.STREAM_VARIANTS["stream-gs-asgd"], 1, "o", 3)
    assert row["seeds"] == [42, 43, 44] and row["collapsed"] == 1
    assert row["runs"][1]["collapsed"].startswith("exchange 367")
    assert row["test_accuracy_mean"] == pytest.approx(0.91)  # the two seeds that ran to the end
    assert row["test_accuracy_std"] == pytest.approx(statistics.stdev([0.90, 0.92]))
    assert accuracy._summary(row) == "0.9100 +- 0.0141 (1 of 3 seeds collapsed)"
    n8 = accuracy.run_seeds("d", "stream-gs-asgd-ms-n8", accuracy.STREAM_VARIANTS["stream-gs-asgd-ms-n8"], 1, "o", 2)
    assert n8["collapsed"] == 2 and n8["test_accuracy_mean"] is None and n8["accuracy_per_epoch_mean"] == []
    assert accuracy._summary(n8) == "no seed ran to the end (2 of 2 seeds collapsed)"
    checks = accuracy._stream_checks({"stream-asgd": {**row, "name": "stream-asgd"}, "stream-gs-asgd-ms": n8})
    assert checks["stream-gs-asgd-ms mean within 0.7pt of stream-asgd"] is False  # no accuracy: not met
    render = importlib.import_module("bench.render")
    text = render.seed_table({"std_ddof": 1, "stream": [row, n8]}, lambda *a: "")
    assert "(`stream-gs-asgd`, 3 seeds, 1 collapsed)" in text and "(`stream-gs-asgd-ms-n8`, 2 seeds, 2 collapsed)" in text
    assert "over the seeds that ran to the end" in text
    whole = render.seed_table({"std_ddof": 1, "stream": [accuracy._aggregate("v", [_run(0, 0.9)])]}, lambda *a: "")
    assert "collapsed" not in whole  # the legend says it only where a row has a collapsed seed


def test_a_child_run_the_guard_stopped_is_told_from_a_failed_one(monkeypatch):
    import subprocess

    for tail, expected in (("Traceback ...\nsparkcnn.errors.Diverged: exchange 5: the run collapsed\n",
                            accuracy.Collapsed),
                           ("Traceback ...\nValueError: something else\n", RuntimeError)):
        monkeypatch.setattr(accuracy.subprocess, "run", lambda argv, _t=tail, **kw: subprocess.CompletedProcess(
            argv, 1, "", _t))
        with pytest.raises(expected) as e:
            accuracy.run_isolated("d", "stream-gs-asgd-ms-n8", ["engine.master=local[8]"], 1, "o")
        assert ("exchange 5" in str(e.value)) if expected is accuracy.Collapsed else ("ValueError" in str(e.value))


def _momentum_json(sa8: float, sa8_loss: float) -> dict:
    def cell(mean, loss, stopped=0):
        return {"mean": mean, "sd": 0.001, "seeds": 2 - stopped, "stopped": stopped, "final_train_loss": loss,
                "bytes_per_push": 40000.0}

    return {"epochs": 3, "seeds": 2, "settings": {"project": [], "lr_x4": ["train.lr=0.2"]},
            "summary": [{"setting": "project", "blocks": 2, "correction": cell(0.88, 0.40),
                         "sparsification_aware": cell(0.877, 0.41), "samomentum_minus_correction_points": -0.3},
                        {"setting": "project", "blocks": 8, "correction": cell(0.7529, 0.70),
                         "sparsification_aware": cell(sa8, sa8_loss),
                         "samomentum_minus_correction_points": round(100 * (sa8 - 0.7529), 2)},
                        {"setting": "lr_x4", "blocks": 8, "correction": cell(0.80, 0.55, stopped=1),
                         "sparsification_aware": {"mean": None, "sd": None, "seeds": 0, "stopped": 2}}],
            "displacement": {"stream": {"size": 100000, "steps": 1000, "density": 0.001, "lr": 0.05,
                                        "momentum": 0.9, "mean_sd": 0.1, "noise_sd": 1.0, "seed": 0},
                             "correction": {"along": 0.733}, "sparsification_aware": {"along": 0.186}}}


def test_the_readme_line_gives_the_measured_reason_when_samomentum_misses_its_target():
    render = importlib.import_module("bench.render")
    line = render.momentum_finding(_momentum_json(0.7354, 0.80))
    assert line.startswith("- **Sparsification-aware momentum, 8 blocks:** -1.75 points against momentum "
                           "correction after 3 epochs (0.7354 against 0.7529), so `correction` is the default.")
    assert "it trains slower (last epoch's training loss 0.800 against 0.700)" in line
    assert "moves the weights 0.186 of dense momentum SGD's way, correction 0.733; at 4x the lr the guard " \
        "stopped every seed." in line
    mo = _momentum_json(0.7354, 0.80)
    mo["summary"][2]["sparsification_aware"] = {"mean": 0.7601, "sd": 0.002, "stopped": 0}
    assert render.momentum_finding(mo).endswith("at 4x the lr it reaches 0.7601, 0.72 points above correction "
                                                "at the project's lr, while correction at 4x the lr reaches 0.8000.")
    mo["summary"][2]["sparsification_aware"]["mean"] = 0.7401
    assert "at 4x the lr it reaches 0.7401, 1.28 points below correction at the project's lr" in \
        render.momentum_finding(mo)
    assert render.momentum_finding(_momentum_json(0.7354, 0.60)).count("not slower training (") == 1
    assert render.momentum_finding(_momentum_json(0.7520, 0.80)).endswith(
        "(0.7520 against 0.7529): meets the target (within 0.3 points, or better).")
    assert render.momentum_finding(None) is None


def test_the_momentum_section_shows_training_loss_stopped_seeds_and_the_displacement():
    render = importlib.import_module("bench.render")
    text = render.momentum_section(_momentum_json(0.7354, 0.80), lambda *a: "")
    assert "| `project` | 8 | 0.7529 ± 0.0010 | 0.7354 ± 0.0010 | -1.75 |" in text
    assert "| 0.700 / 0.800 | 40.0 / 40.0 |" in text
    assert "| `lr_x4` | 8 | 0.8000 ± 0.0010 (1 stopped) | all 2 seeds stopped by the guard | — |" in text
    assert ("fixed mean plus noise 10 times the spread of the means). What the server applied, projected on the "
            "displacement of dense momentum SGD on the same stream: momentum correction 0.733, SAMomentum 0.186.") \
        in text


def test_each_rendered_row_names_its_config_file_and_command(monkeypatch):
    """A row trained from its conf/seed file shows the file in the README's glance table and its
    whole command under the seed table, H and transport read from its runs' resolved config; a
    row of results that predate the record shows a dash."""
    from sparkcnn import config

    def here(data, name, overrides, epochs, out_dir, config_file):
        cfg = config.load(f"{accuracy.ROOT}/{config_file}", overrides).to_dict()
        return {**_run(int(overrides[-1].split("=")[1]), 0.9), "overrides": overrides, "config": cfg}

    monkeypatch.setattr(accuracy, "run_variant", here)
    ms = accuracy.STREAM_VARIANTS["stream-gs-asgd-ms"]
    row = accuracy.run_seeds("data/fashion-mnist", "stream-gs-asgd-ms", ms, 10, "o", 3)
    assert row["overrides"] == [] and row["config_file"] == "conf/seed/fmnist_gs_asgd_ms.yaml"
    # the file's own data path and epochs: no --set for them
    assert row["command"] == "sparkcnn train --config conf/seed/fmnist_gs_asgd_ms.yaml"
    old = {**accuracy._aggregate("sync-dense", [_run(42, 0.91)]), "overrides": ["train.steps_per_round=10"]}
    keras = {"test_accuracy": 0.9, **accuracy.reproduction(accuracy.seed_file("fmnist", "keras"), ())}
    acc = {"std_ddof": 1, "runs": [old], "stream": [row], "reference": {"keras": keras}}
    render = importlib.import_module("bench.render")
    text = render.seed_table(acc, lambda *a: "")
    assert ("- GS-ASGD + MS (stream-gs-asgd-ms): `sparkcnn train --config conf/seed/fmnist_gs_asgd_ms.yaml`, "
            "seeds 42, 43, 44 (`--set run.seed=S`)") in text
    assert "- Sync SGD, dense (sync-dense): —" in text
    assert "- Keras `model.fit`: `python bench/keras_fit.py --config conf/seed/fmnist_keras.yaml`" in \
        render.reference_table(acc, None)
    glance = render.glance_block(acc)
    assert "| GS-ASGD + MS | stream, async, H = 1 | 0.9000 ± 0.0000 |" in glance
    assert glance.count("| `conf/seed/fmnist_gs_asgd_ms.yaml` |") == 1
    assert "| Sync SGD, dense | jobs, sync, H = 10 |" in glance and "| — |\n| GS-ASGD + MS" in glance
    assert "| `conf/seed/fmnist_keras.yaml` |" in glance


def test_a_links_cell_names_the_command_of_its_variant():
    """bench/links.py's variants are the seed rows' files; the links section lists each variant's
    command once, from the first rate that ran it."""
    links = importlib.import_module("bench.links")
    assert links.VARIANTS["stream-gs-asgd-ms"].config == "conf/seed/fmnist_gs_asgd_ms.yaml"
    assert links.VARIANTS["jobs-sync-dense"].config == "conf/seed/fmnist_sync_dense.yaml"
    cmd = accuracy.reproduction(links.VARIANTS["stream-asgd"].config, ["run.seed=42"], epochs=5)["command"]
    cell = {"images_per_s": 100.0, "command": cmd}
    doc = {"rates": {"unshaped": {"stream-asgd": cell, "jobs-sync-dense": {"images_per_s": 90.0}},
                     "100mbit": {"stream-asgd": {**cell, "command": "other"}}}}
    text = importlib.import_module("bench.render").links_section(doc, lambda *a: "")
    assert ("- ASGD, H = 1 (stream-asgd): `sparkcnn train --config conf/seed/fmnist_asgd.yaml "
            "--set train.epochs=5 --set run.seed=42`") in text
    assert "- Sync SGD (jobs), H = 10 (jobs-sync-dense): —" in text and "`other`" not in text
