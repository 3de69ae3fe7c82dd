"""The spread the seed tables report: sample standard deviations (ddof = 1), none over one seed."""

import importlib
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


def test_momentum_section_renders_the_committed_ablation():
    import os

    render = importlib.import_module("bench.render")
    folder = os.path.join(render.ROOT, "bench", "results", "2026-12-04-momentum")
    mo = render._load(folder, "momentum")
    text = render.momentum_section(mo, lambda *a: "![figure](momentum.png)")
    rows = [ln for ln in text.splitlines() if ln.startswith("| `")]
    assert len(rows) == len(mo["summary"])
    for row, s in zip(rows, mo["summary"]):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[:2] == [f"`{s['setting']}`", str(s["blocks"])]
        mc, sa = s["correction"], s["sparsification_aware"]
        assert cells[2] == f"{mc['mean']:.4f} ± {mc['sd']:.4f}" and cells[3] == f"{sa['mean']:.4f} ± {sa['sd']:.4f}"
        assert cells[4] == f"{s['samomentum_minus_correction_points']:.2f}"
    n8 = [s for s in mo["summary"] if s["blocks"] == 8]
    for s in n8:  # the verdict follows the figure, whichever way it falls
        verdict = "holds" if s["samomentum_minus_correction_points"] >= -0.3 else "does not hold"
        assert f"`{s['setting']}` {s['samomentum_minus_correction_points']:.2f} points ({verdict})" in text
    assert render.momentum_section(None, lambda *a: "").endswith("Not measured in this run.")
