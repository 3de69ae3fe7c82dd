"""bench/render.py on copies of the committed benchmark results: the tables, the README blocks,
--check, and the checks that the repository's BENCHMARKS.md and README still match their
results: the README's every measured figure inside a rendered block, and the README short."""

import importlib
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

render = importlib.import_module("bench.render")

ROOT = render.ROOT
COMMITTED = os.path.join(ROOT, "bench", "results")
# today's committed JSONs under the names bench/run_all.py saves them as (copies; never modified)
COPIES = {"accuracy-stream.json": "accuracy.json", "throughput.json": "throughput.json",
          "jobcost.json": "jobcost.json", "scale.json": "scale.json", "balance.json": "balance.json"}
README = ("# sparkcnn\n\nIntro.\n\n<!-- benchmarks:begin -->\nold headline\n<!-- benchmarks:end -->\n"
          "\n## Usage\n\nTail.\n")
README_LINES = 450  # the README is for users: method and history live in BENCHMARKS.md and docs/

# A measured figure: a number with a unit of time, speed, size, share or ratio, or an accuracy
# (three or more decimals, or two beside the word). Config defaults are written without units
# ("after this many seconds") or in the allow-list below.
def committed_path(name: str) -> str:
    """Where the file is: bench/results/, or bench/results/archive/ once a full run_all moved it."""
    here = os.path.join(COMMITTED, name)
    return here if os.path.exists(here) else os.path.join(COMMITTED, "archive", name)


def committed(name: str) -> dict:
    with open(committed_path(name), encoding="utf-8") as fh:
        return json.load(fh)


@pytest.fixture()
def results(tmp_path):
    out = tmp_path / "results"
    out.mkdir()
    for src, dst in COPIES.items():
        shutil.copyfile(committed_path(src), out / dst)
    return out


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(ROOT, "bench", "render.py"), *map(str, args)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def section(text: str, heading: str) -> str:
    """The markdown from ``heading`` up to the next heading of level 2."""
    start = text.index(heading)
    nxt = text.find("\n## ", start + len(heading))
    return text[start:] if nxt < 0 else text[start:nxt]


def test_stream_gs_asgd_ms_row_shows_its_accuracy_and_ratios(results):
    ms = next(r for r in committed("accuracy-stream.json")["stream"] if r["name"] == "stream-gs-asgd-ms")
    doc = render.render(str(results))["benchmarks"]
    [row] = [ln for ln in doc.splitlines() if "`stream-gs-asgd-ms`" in ln]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0].startswith("GS-ASGD + MS")
    assert cells[1] == "1"  # H: one step per exchange
    assert cells[2] == f"{ms['test_accuracy_mean']:.4f} ± {ms['test_accuracy_std']:.4f}"
    assert cells[6] == f"{ms['bytes_up_mean'] / 1e6:.1f} ± {ms['bytes_up_std'] / 1e6:.1f}"
    assert cells[9] == f"{ms['steady_downlink_ratio_mean']:.1f} ± {ms['steady_downlink_ratio_std']:.1f}"
    # never reached by sparsification-aware momentum in this data: a dash and the count of seeds
    [sa] = [ln for ln in doc.splitlines() if "`stream-gs-asgd-samomentum`" in ln]
    assert "— (0/3)" in sa


def test_a_row_over_one_seed_shows_no_spread(results):
    acc = committed("accuracy-stream.json")
    one = {**acc, "stream": [{**r, "seeds": r["seeds"][:1]} for r in acc["stream"]]}
    (results / "accuracy.json").write_text(json.dumps(one), encoding="utf-8")
    doc = render.render(str(results))["benchmarks"]
    [row] = [ln for ln in doc.splitlines() if "`stream-gs-asgd-ms`" in ln]
    cells = [c.strip() for c in row.strip("|").split("|")]
    ms = next(r for r in acc["stream"] if r["name"] == "stream-gs-asgd-ms")
    assert cells[2] == f"{ms['test_accuracy_mean']:.4f}"  # a std over one seed would read as none measured
    assert "±" not in row


def test_every_table_follows_its_machine_command_date_line_and_precedes_a_paragraph(results):
    doc = render.render(str(results))["benchmarks"]
    lines = doc.splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.startswith("|") and not lines[i - 1].startswith("|")]
    assert len(starts) >= 6  # seed, reference, throughput, scale, balance, jobcost
    for i in starts:
        before = next(ln for ln in reversed(lines[:i]) if ln.strip())
        assert re.match(r"Measured on .+ cores, .+ GiB, .+; command .+; date .+; commit .+\(\w+\.json\)\.$", before), \
            before
        end = next(j for j in range(i, len(lines)) if not lines[j].startswith("|"))
        after = next(ln for ln in lines[end:] if ln.strip())
        assert not after.startswith(("#", "|", "!")), after  # a paragraph explaining the columns
    thr = committed("throughput.json")["provenance"]
    line = next(ln for ln in section(doc, "## Throughput").splitlines() if ln.startswith("Measured on"))
    assert f"command `python bench/throughput.py`; date {thr['date']}; commit `{thr['git_commit'][:7]}`" in line
    assert f"{thr['machine']['cores']} cores, {thr['machine']['memory_gib']:.1f} GiB, {thr['machine']['cpu']}" in line


def test_missing_files_render_as_not_measured_and_the_rest_is_still_there(results):
    doc = render.render(str(results))["benchmarks"]
    assert section(doc, "## CIFAR-10 (JPEG copy)").splitlines()[2] == "Not measured in this run."
    assert "### Cost model: held-out validation\n\nNot measured in this run." in doc
    assert section(doc, "## How this run was made").strip().endswith("Not measured in this run.")
    assert doc.startswith("# ") and f"<!-- results: {results} -->" in doc.splitlines()[4]
    assert re.fullmatch(r"\*\*Targets: \d+ hold, \d+ miss, \d+ not judged, of \d+\*\* .*", doc.splitlines()[2])
    assert "**This is a quick run" not in doc
    limit = committed("throughput.json")["compute_limit_images_per_s"]
    assert f"| {limit:.1f} |" in section(doc, "## Reference rows")


def test_partial_and_new_schemas_render_without_crashing(results):
    (results / "throughput.json").write_text(json.dumps({"stream": {"async_h1_sparse": {"error": "no server"},
                                                                    "odd": "not a dict"}, "by_steps_per_round": []}))
    (results / "cifar.json").write_text(json.dumps({"model": "resnet20", "modes": [
        {"mode": "sync_h10_dense", "steps_per_exchange": 10, "images_per_s": 321.25, "bytes_up_per_exchange": 4096,
         "bytes_down_per_exchange": 8192}, {"mode": "stream_async_h1_sparse", "error": "refused"}]}))
    (results / "costmodel.json").write_text(json.dumps({
        "validation": [{"setup": "cluster", "case": "stream_async_h1", "predicted": 2400.0, "measured": 2461.5,
                        "error": -0.025, "bound": "cpu"}, {"setup": "local"}],
        "max_abs_error": 0.1234,
        "speedup_curve": {"constants_from": "cluster", "n": [1, 2, 256], "1gbit_h1_stream_sparse": [1.0, 1.9, 40.5],
                          "10gbit_h1_stream_sparse": [1.0, 1.95, 201.25]}}))
    scale = committed("scale.json")
    scale["driver_apply_merged_s"] = {"0.2M": {"2": 0.00031, "8": 0.0004}}
    (results / "scale.json").write_text(json.dumps(scale))
    (results / "run_all.json").write_text(json.dumps({"quick": True, "benchmarks": [
        {"name": "cifar", "command": "python bench/cifar.py --quick", "exit": 1, "wall_s": 3.4, "error": "exit 1"}]}))
    doc = render.render(str(results))["benchmarks"]
    assert "| Stream, async, H = 1, sparse (error: no server) | — |" in doc
    assert "| sync_h10_dense | 10 | 321.2 | — | 4096 | 8192 |" in doc  # no test accuracy recorded: a dash
    assert "| stream_async_h1_sparse | — | error: refused | — | — |" in doc
    assert "| cluster | stream_async_h1 | 2400.0 | 2461.5 | -2.5 % | cpu |" in doc
    assert "| local | — | — | — | — | — |" in doc and "Largest absolute error: 12.3 %." in doc
    assert "| 1 Gbit/s, H = 1, stream, sparse | 1.0 | 1.9 | 40.5 |" in doc
    assert "| 10 Gbit/s, H = 1, stream, sparse | 1.0 | 1.9 | 201.2 |" in doc and "| N = 256 |" in doc
    assert "| 0.2M, one payload merged by the executors | 0.31 | 0.40 | — | — | — |" in doc
    assert "| cifar | `python bench/cifar.py --quick` | 1 (exit 1) | — | 3 |" in doc
    assert "**This is a quick run" in doc.split("## ", 1)[0]


def test_figures_are_written_where_the_document_links_them(results, tmp_path):
    doc_path = tmp_path / "BENCHMARKS.md"
    out = render.render(str(results), str(results / "figures"), doc=str(doc_path))
    links = re.findall(r"!\[[^]]*\]\(([^)]+\.png)\)", out["benchmarks"])
    assert {os.path.basename(p) for p in links} == {"accuracy.png", "balance.png", "overlap.png"}
    for link in links:
        assert not os.path.isabs(link)
        assert os.path.getsize(tmp_path / link) > 1000
    assert out == render.render(str(results), doc=str(doc_path))  # the text does not depend on drawing


def test_check_passes_on_the_rendered_files_and_fails_after_a_one_character_edit(results, tmp_path):
    doc, readme = tmp_path / "BENCHMARKS.md", tmp_path / "README.md"
    readme.write_text(README)
    assert cli(results, "--out", doc, "--readme", readme).returncode == 0
    assert (results / "figures" / "accuracy.png").exists()
    ok = cli(results, "--out", doc, "--readme", readme, "--check")
    assert (ok.returncode, ok.stdout) == (0, "")
    text = doc.read_text()
    i = text.index("Final accuracy")
    doc.write_text(text[:i] + "f" + text[i + 1:])
    bad = cli(results, "--out", doc, "--readme", readme, "--check")
    assert bad.returncode == 1
    assert "-| Variant | H | final accuracy" in bad.stdout and "+| Variant | H | Final accuracy" in bad.stdout
    assert doc.read_text() != text  # --check wrote nothing back


def test_readme_without_markers_exits_2_and_nothing_is_written(results, tmp_path):
    doc, readme = tmp_path / "BENCHMARKS.md", tmp_path / "README.md"
    original = b"# sparkcnn\n\nNo block here.\n<!-- benchmarks:end -->\n"
    readme.write_bytes(original)
    proc = cli(results, "--out", doc, "--readme", readme)
    assert proc.returncode == 2
    assert str(readme) in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert readme.read_bytes() == original
    assert not doc.exists() and not (results / "figures").exists()


def test_readme_block_is_replaced_between_the_markers_and_the_rest_kept(results, tmp_path):
    doc, readme = tmp_path / "docs" / "BENCHMARKS.md", tmp_path / "README.md"
    doc.parent.mkdir()
    readme.write_text(README)
    assert cli(results, "--out", doc, "--readme", readme).returncode == 0
    text = readme.read_text()
    head, rest = text.split("<!-- benchmarks:begin -->\n")
    block, tail = rest.split("<!-- benchmarks:end -->\n")
    assert head == "# sparkcnn\n\nIntro.\n\n" and tail == "\n## Usage\n\nTail.\n"
    assert "old headline" not in block
    ms = next(r for r in committed("accuracy-stream.json")["stream"] if r["name"] == "stream-gs-asgd-ms")
    bullets = [ln for ln in block.splitlines() if ln.startswith("- ")]
    assert len(bullets) == 4 and f"{ms['test_accuracy_mean']:.4f}" in bullets[0]
    assert bullets[3] == "- **CIFAR-10 (JPEG copy):** not measured in this run."
    assert "[BENCHMARKS.md](docs/BENCHMARKS.md)" in block  # relative to the README


def test_missing_or_empty_results_dir_exits_2(tmp_path):
    for d in (tmp_path / "absent", tmp_path):
        proc = cli(d, "--out", tmp_path / "B.md", "--check")
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "B.md").exists()


def test_committed_benchmarks_match_their_results():
    doc = os.path.join(ROOT, "BENCHMARKS.md")
    if not os.path.exists(doc):
        if os.environ.get("SPARKCNN_REQUIRE_BENCHMARKS") == "1":
            pytest.fail("BENCHMARKS.md does not exist: run `python bench/run_all.py` and commit what it renders")
        pytest.skip("BENCHMARKS.md does not exist yet (set SPARKCNN_REQUIRE_BENCHMARKS=1 to require it)")
    with open(doc, encoding="utf-8") as fh:
        found = re.search(r"^<!-- results: (.+) -->$", fh.read(), re.M)
    assert found, "BENCHMARKS.md has no `<!-- results: DIR -->` line naming the results it was rendered from"
    proc = cli(found.group(1), "--out", "BENCHMARKS.md", "--readme", "README.md", "--check")
    assert proc.returncode == 0, (
        "BENCHMARKS.md or the README's headline no longer match "
        f"{found.group(1)}: re-render with `python bench/render.py {found.group(1)} --readme README.md`\n"
        f"{proc.stdout[-4000:]}{proc.stderr[-2000:]}")


# -- the repository's README: short, and every measured figure rendered ---------------------------

def committed_results_dir() -> str:
    """The results folder the committed BENCHMARKS.md names (``<!-- results: DIR -->``)."""
    with open(os.path.join(ROOT, "BENCHMARKS.md"), encoding="utf-8") as fh:
        found = re.search(r"^<!-- results: (.+) -->$", fh.read(), re.M)
    assert found, "BENCHMARKS.md has no `<!-- results: DIR -->` line naming the results it was rendered from"
    return os.path.join(ROOT, found.group(1))


def read_readme() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        return fh.read()


def figures_outside_blocks(text: str) -> list[str]:
    """``"line N: figure ..."`` for every measured figure of ``text`` outside its rendered blocks
    (what ``render.py --check`` refuses)."""
    blocks, why = render.readme_blocks(text)
    assert why is None, why
    return render.hand_figures(text)


def test_readme_is_short():
    lines = read_readme().count("\n")
    assert lines < README_LINES, f"README.md has {lines} lines; move method and history to docs/ or BENCHMARKS.md"


def test_readme_has_no_measured_figure_outside_its_rendered_blocks():
    found = figures_outside_blocks(read_readme())
    assert not found, ("README.md holds measured figures outside the blocks bench/render.py writes; render them or "
                       "remove them:\n" + "\n".join(found))


def test_docs_pages_carry_no_measured_figure():
    """docs/ holds method and design prose; its figures live in BENCHMARKS.md, rendered."""
    found = []
    for name in sorted(os.listdir(os.path.join(ROOT, "docs"))):
        if name.endswith(".md"):
            with open(os.path.join(ROOT, "docs", name), encoding="utf-8") as fh:
                found += [f"docs/{name}:{i + 1}: {m.group(0)!r}" for i, line in enumerate(fh)
                          for m in render.FIGURE.finditer(line)]
    assert not found, "docs/ pages hold measured figures; point to BENCHMARKS.md instead:\n" + "\n".join(found)


def test_a_figure_typed_outside_a_block_is_found_and_inside_one_is_not():
    text = read_readme()
    assert figures_outside_blocks(text) == []
    glance_end = "<!-- benchmarks:end glance -->\n"
    typed = ["GS-ASGD reaches 0.912 accuracy.", "Reaches 0.78 test accuracy.", "A job costs ~105 ms.",
             "It runs at 2,335.9 images/s.", "Up to 84.3 % of the limit.", "It sends 94.5x fewer bytes.",
             "The archive is 0.5 GB.", "The suite takes 6 minutes.", "481× smaller."]
    for line in typed:
        outside = text.replace(glance_end, glance_end + line + "\n")
        assert len(figures_outside_blocks(outside)) == 1, line
        inside = text.replace(glance_end, line + "\n" + glance_end)
        assert figures_outside_blocks(inside) == [], line
    settings = ["`train.lr` 0.05, momentum 0.9, density 0.001, warm-up 0.25", "2 blocks on `local[2]`, H = 10",
                "Python ≥ 3.10, Java 17", "SHA-256", "after this many seconds"]
    for line in settings:
        assert figures_outside_blocks(text.replace(glance_end, glance_end + line + "\n")) == [], line


def test_readme_blocks_are_what_render_gives_for_the_committed_results():
    text = read_readme()
    blocks, why = render.readme_blocks(text)
    assert why is None, why
    assert sorted(name for name, _, _ in blocks) == sorted(render.BLOCKS)  # the glance, transports, headline
    rendered = render.render(committed_results_dir(), readme=os.path.join(ROOT, "README.md"))
    lines = text.splitlines(keepends=True)
    for name, b, e in blocks:
        assert "".join(lines[b + 1:e]) == rendered[render.BLOCKS[name]], f"README block {name or 'headline'!r}"
    assert rendered["glance"].count("\n|") >= 5 and "| GS-ASGD + MS |" in rendered["glance"]
    assert "| Stream, async, H = 1, sparse |" in rendered["transports"]


def test_check_fails_on_a_hand_figure_outside_the_rendered_block(results, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(README)
    doc = tmp_path / "BENCHMARKS.md"
    assert cli(results, "--out", doc, "--readme", readme).returncode == 0
    assert cli(results, "--out", doc, "--readme", readme, "--check").returncode == 0
    readme.write_text(readme.read_text() + "\nOur runs reach 0.912 accuracy at 2,335 images/s.\n")
    proc = cli(results, "--out", doc, "--readme", readme, "--check")
    assert proc.returncode == 1
    assert "'0.912'" in proc.stdout and "'2,335 images/s'" in proc.stdout
    assert render.hand_figures("x\n<!-- benchmarks:begin -->\n0.912 at 3 ms\n<!-- benchmarks:end -->\n") == []
    assert [f.split(":")[0] for f in render.hand_figures("ran 12 ms\ncap 8 × parameters + 1 MiB\n")] == ["line 1"]


def test_check_covers_the_named_blocks_and_refuses_unknown_or_broken_ones(results, tmp_path):
    doc, readme = tmp_path / "BENCHMARKS.md", tmp_path / "README.md"
    readme.write_text(README + "\n<!-- benchmarks:begin glance -->\n<!-- benchmarks:end glance -->\n"
                      "\n<!-- benchmarks:begin transports -->\nold\n<!-- benchmarks:end transports -->\n")
    assert cli(results, "--out", doc, "--readme", readme).returncode == 0
    text = readme.read_text()
    acc = committed("accuracy-stream.json")
    ms = next(r for r in acc["stream"] if r["name"] == "stream-gs-asgd-ms")
    glance = text.split("<!-- benchmarks:begin glance -->")[1].split("<!-- benchmarks:end glance -->")[0]
    assert f"| GS-ASGD + MS | stream, async, H = 1 | {ms['test_accuracy_mean']:.4f} ± " in glance
    assert "old" not in text.split("<!-- benchmarks:begin transports -->")[1]
    assert cli(results, "--out", doc, "--readme", readme, "--check").returncode == 0
    edited = text.replace(f"{ms['test_accuracy_mean']:.4f} ±", "0.9999 ±")
    readme.write_text(edited)
    bad = cli(results, "--out", doc, "--readme", readme, "--check")
    assert bad.returncode == 1 and "-| GS-ASGD + MS | stream, async, H = 1 | 0.9999" in bad.stdout
    assert readme.read_text() == edited  # --check wrote nothing back
    for broken, why in ((text.replace("begin glance", "begin glimpse").replace("end glance", "end glimpse"),
                         "unknown block"),
                        (text.replace("<!-- benchmarks:end transports -->\n", ""), "has no end line"),
                        (text + "\n<!-- benchmarks:begin glance -->\n<!-- benchmarks:end glance -->\n", "twice")):
        readme.write_text(broken)
        proc = cli(results, "--out", doc, "--readme", readme)
        assert proc.returncode == 2 and why in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert readme.read_text() == broken


def test_the_held_out_link_validation_renders_its_cells_fit_and_verdict(results):
    assert "### Links: the cost model on held-out rates\n\nNot measured in this run." in render.render(
        str(results))["benchmarks"]
    (results / "linkmodel.json").write_text(json.dumps({
        "cells": [{"rate": "1gbit", "variant": "stream-asgd", "role": "fit", "measured_images_per_s": 3828.0,
                   "predicted_images_per_s": 3700.4, "error": -0.0333, "bound": "cpu", "test_accuracy": 0.71},
                  {"rate": "20mbit", "variant": "jobs-sync-dense", "role": "held out", "measured_images_per_s": 210.0,
                   "predicted_images_per_s": 250.0, "error": 0.19, "bound": "cpu + wire"}, "not a cell"],
        "fit": {"beta_ns_per_byte": 3.456}, "max_abs_held_out_error": 0.19, "target": 0.25, "passed": True,
        "links": {"epochs": 1, "data": {"train_rows": 12000}}}))
    doc = section(render.render(str(results))["benchmarks"], "### Links: the cost model on held-out rates")
    assert "| 1gbit | ASGD, H = 1 | fit | 3828 | 3700 | -3.3 % | cpu | 0.7100 |" in doc
    assert "| 20mbit | Sync SGD (jobs), H = 10 | held out | 210 | 250 | 19.0 % | cpu + wire | — |" in doc
    assert "3.46 ns per byte" in doc and "1 epoch on 12000 training rows" in doc
    assert "Largest held-out error: 19.0 % (target 25 %); its verdict is in the table below." in doc
    # the bench said it passed; one repetition is not enough under the rule
    assert "| largest held-out error <= 0.25 | 0.190 | not judged | 1 repetition (needs 5) |" in doc


def test_the_links_section_says_how_many_repetitions_each_cell_is_the_median_of(results):
    cell = {"images_per_s": 5316.0, "time_to_0_88_s": 25.2, "test_accuracy": 0.8975, "bytes_up_per_step": 16500.0,
            "bytes_down_per_step": 20000.0, "exposed_comm_ms_per_step": 0.4}
    links = {"rates": {"unshaped": {"stream-gs-asgd-ms": cell}, "100mbit": {"stream-gs-asgd-ms": cell}},
             "checks": {}, "epochs": 5, "testbed": {"hosts": 2, "cores_per_host": 1, "shaping": "tbf"}}
    for reps, said in ((5, "each cell the median of 5 repetitions, run in turn across the rates"),
                       (1, "one repetition")):
        (results / "links.json").write_text(json.dumps({**links, "reps": reps}))
        doc = section(render.render(str(results))["benchmarks"], "## Links: separate hosts behind shaped links")
        assert f"5 epochs per cell, one seed; {said}; time to 0.88" in doc
        assert "| 100mbit | GS-ASGD + MS, H = 1 | 5316 | 25.2 | 0.8975 | 16.5 | 20.0 | 0.4 |" in doc


def test_the_balance_section_gives_each_runs_accuracy_and_no_share_to_a_run_that_did_not_train(results):
    bal = json.loads((results / "balance.json").read_text())
    bal["balanced"].update({"test_accuracy": 0.7714, "epochs": 3, "records": 23})
    bal["unbalanced"]["test_accuracy"] = 0.7601
    bal.update({"solo_test_accuracy": 0.7420, "solo_records": 14, "trained": {"balanced": True, "solo": True},
                "accuracy_gate": "async and solo runs within 0.05 of the unbalanced sync run's test accuracy"})
    (results / "balance.json").write_text(json.dumps(bal))
    doc = section(render.render(str(results))["benchmarks"], "## Load balance and overlap")
    said = ("Test accuracy: sync same H 0.7601, async 0.7714 (3 passes, 23 jobs), solo 0.7420 (14 jobs); "
            "async and solo runs within 0.05 of the unbalanced sync run's test accuracy: ")
    assert said + "met." in doc
    share = f"{bal['balanced_images_per_s'] / bal['solo_sum_images_per_s'] * 100:.1f} %"
    assert share in doc
    bal["trained"]["solo"] = False
    (results / "balance.json").write_text(json.dumps(bal))
    doc = section(render.render(str(results))["benchmarks"], "## Load balance and overlap")
    assert said + "**not met**, so no share of the solo sum." in doc and share not in doc


def test_the_balance_bench_sizes_its_async_runs_by_jobs_not_seconds():
    """7 jobs at 1.5 s each on a fast machine left 1 after the warm-up and drain: too few."""
    balance = importlib.import_module("bench.balance")
    # 20 jobs of 1.5 s at 3,000 images/s are 90,000 samples: 3 passes over 30,720
    assert balance.epochs_for(20, 1.5, 3000.0, 30720) == 3
    assert balance.epochs_for(20, 1.5, 1000.0, 30720) == 1  # a slower machine: one pass is enough
    assert balance.epochs_for(20, 1.5, 3000.0, 90000) == 1
    assert balance.epochs_for(20, 1.5, 3000.0, 89999) == 2


def test_no_two_lines_of_the_accuracy_figure_look_alike():
    """The seed table has 12 rows and Keras: more than the 10 colours of the cycle."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [{"name": f"v{i}", "steps_per_round": 1, "accuracy_per_epoch_mean": [0.8, 0.85 + i / 1000]}
            for i in range(12)]
    fig, ax = plt.subplots()
    render._draw_accuracy(ax, rows, {"accuracy_per_epoch": [0.84, 0.9]})
    looks = {(line.get_color(), line.get_linestyle()) for line in ax.lines}
    plt.close(fig)
    assert len(ax.lines) == 13 and len(looks) == 13


# -- every target a bench judges is rendered, holding or not ----------------------------------------

def targets_in_json(folder: str) -> int:
    """How many targets the folder's JSONs hold, counted from the JSONs alone."""
    def load(name):
        try:
            with open(os.path.join(folder, f"{name}.json"), encoding="utf-8") as fh:
                return json.load(fh)
        except OSError:
            return {}

    scale = load("scale").get("targets") or {}
    momentum = [r for r in load("momentum").get("summary") or []
                if r.get("blocks") == 8 and r.get("samomentum_minus_correction_points") is not None]
    return (len(load("accuracy").get("checks") or {}) + len(load("throughput").get("targets") or {})
            + len(load("balance").get("targets") or {})
            + sum(len(v) if isinstance(v, dict) else 1 for v in scale.values())
            + ("within_25pct" in load("costmodel")) + len(load("links").get("checks") or {})
            + ("passed" in load("linkmodel")) + ("target" in load("psload")) + ("target" in load("shardmodel"))
            + ("servers_target" in load("psload")) + ("cpu_target" in load("psload"))
            + 2 * ("target" in load("servermodel")) + ("target" in load("cifar"))
            + len(momentum) + len(load("accuracy-cifar10").get("targets") or {})
            + len(load("links-cifar10").get("checks") or {}))


VERDICT_ROW = re.compile(r"^\| .+ \| (holds|\*\*misses\*\*|not judged) \| [^|]+ \|$", re.M)


def test_every_target_in_the_json_is_rendered_and_counted_in_the_summary_line(results):
    for folder in (str(results), committed_results_dir()):
        doc = render.render(folder)["benchmarks"]
        rows = VERDICT_ROW.findall(doc)
        assert len(rows) == targets_in_json(folder) > 0, folder
        hold, miss, nj = rows.count("holds"), rows.count("**misses**"), rows.count("not judged")
        line = f"**Targets: {hold} hold, {miss} miss, {nj} not judged, of {len(rows)}**"
        assert doc.splitlines()[2].startswith(line)
        assert render.render(folder)["headline"].count(line) == 1  # the README's results at a glance


def test_todays_links_and_linkmodel_are_not_judged_and_psload_is_judged_on_every_repetition():
    doc = render.render(committed_results_dir())["benchmarks"]
    links = section(doc, "## Links: separate hosts behind shaped links")
    assert not re.search(r"\| (holds|\*\*misses\*\*) \|", links)  # 1 repetition, and 3 for the model
    psload = section(doc, "## Parameter server under load")
    assert "| **misses** |" in psload and "2 over the bound" in psload


def test_one_limit_divides_every_row_and_a_run_that_did_not_train_gets_no_efficiency(results):
    thr = json.loads((results / "throughput.json").read_text())
    old = section(render.render(str(results))["benchmarks"], "## Throughput")
    assert "| not judged |" in old and "no single compute limit" in old  # limits of its own per case: none shown
    thr["compute_limit"] = {"images_per_s": 10000.0, "repetitions": [9800.0, 10000.0, 10100.0, 9900.0, 10200.0]}
    thr["stream"] = {"async_h1_sparse": {"steps_per_exchange": 1, "mode": "async", "images_per_s": 8000.0,
                                         "test_accuracy": 0.81, "trained": True},
                     "async_h1_dense": {"steps_per_exchange": 1, "mode": "async", "images_per_s": 5000.0,
                                        "test_accuracy": 0.47, "trained": False}}
    (results / "throughput.json").write_text(json.dumps(thr))
    out = render.render(str(results))
    doc = section(out["benchmarks"], "## Throughput")
    assert "| Stream, async, H = 1, sparse | 8000.0 | 0.8100 | 80.0 % |" in doc
    assert "| Stream, async, H = 1, dense | 5000.0 | 0.4700 | did not train |" in doc
    assert "10000.0 images/s, the median of 5 repetitions measured once for the run (9800.0 to 10200.0)" in doc
    assert "80.0 % of it (Stream, async, H = 1, sparse, 8000.0 images/s, test accuracy 0.8100)" in out["headline"]


def servers_psload(ratio: float) -> dict:
    """A psload result with one and two server processes at N = 16 and 64, five repetitions each."""
    cases = [{"workers": n, "shards": 1, "servers": k, "offered_pushes_per_s": 1000.0, "pushes_per_s": 990.0,
              "reply_ms": {"p50": 1.0, "p99": 4.0}, "server_cpu_ms_per_push": 0.6 * (ratio if k == 2 else 1),
              "driver_cpu_ms_per_push": 0.6 if k == 1 else 0.05, "refused": 0, "repetitions": 5,
              "server_process_cpu_ms_per_push": [] if k == 1 else [0.3 * ratio - 0.025] * 2,
              "capacity_pushes_per_s": 1000 / (0.6 if k == 1 else 0.3 * ratio - 0.025)}
             for n in (16, 64) for k in (1, 2)]
    ratios = {"16": ratio, "64": ratio}
    return {"cases": cases, "servers_target": {"servers": 2, "within": 0.1, "cpu_ratio": ratios, "refused": 0,
                                               "repetitions": 5, "met": ratio <= 1.1}}


def test_the_servers_block_shows_each_k_and_its_verdict_and_a_readme_line_names_its_folder(results, tmp_path):
    assert render.render(str(results))["servers"].strip() == render.NOT_MEASURED  # no psload.json here
    (results / "psload.json").write_text(json.dumps(servers_psload(1.25)))
    block = render.render(str(results))["servers"]
    assert "| 64 | 2 | 0.750 | 0.050 | 0.350, 0.350 | 2857 | 990 | 4.0 |" in block
    assert "N = 16: 1.250x" in block and "**misses** (5 repetitions, median)" in block
    psload = section(render.render(str(results))["benchmarks"], "## Parameter server under load")
    assert "K = 2 server processes: summed CPU per push within 10 % of K = 1's" in psload
    # a README line names another folder for the block: its psload.json is shown, not RESULTS_DIR's
    other = tmp_path / "servers"
    other.mkdir()
    (other / "psload.json").write_text(json.dumps(servers_psload(1.05)))
    readme = tmp_path / "README.md"
    readme.write_text(README + f"\n<!-- results servers: {os.path.relpath(other, ROOT)} -->\n"
                      "<!-- benchmarks:begin servers -->\n<!-- benchmarks:end servers -->\n")
    block = render.render(str(results), readme=str(readme))["servers"]
    assert "N = 64: 1.050x" in block and ": holds (5 repetitions, median)" in block
    assert f"({os.path.relpath(other, ROOT)}/psload.json)" in block
    assert cli(results, "--out", tmp_path / "B.md", "--readme", readme).returncode == 0
    assert cli(results, "--out", tmp_path / "B.md", "--readme", readme, "--check").returncode == 0


# -- the CIFAR-10 seed table beside the Fashion-MNIST one ------------------------------------------------

CIFAR_FIXTURE = os.path.join(os.path.dirname(__file__), "data", "accuracy-cifar10.json")


def _cells(doc: str, label: str) -> list[str]:
    [row] = [ln for ln in doc.splitlines() if ln.startswith(f"| {label}")]
    return [c.strip() for c in row.strip("|").split("|")]


def test_the_cifar_seed_table_renders_beside_the_fashion_mnist_one(results):
    shutil.copyfile(CIFAR_FIXTURE, results / "accuracy-cifar10.json")
    doc = render.render(str(results))["benchmarks"]
    assert doc.index("## Seed experiment (Fashion-MNIST, 2 blocks") < doc.index(
        "## Seed experiment on CIFAR-10 (JPEG copy)")
    cifar = section(doc, "## Seed experiment on CIFAR-10 (JPEG copy)")
    assert "(accuracy-cifar10.json)" in cifar.splitlines()[2]  # its machine, command, date and commit
    ms = _cells(cifar, "GS-ASGD + MS (+ model-parameter sparsification) (2 seeds)")
    # model, blocks, accuracy, to 0.70, to 0.80, wall, MB up / down over the run, then per steady epoch
    assert ms[1:] == ["resnet20", "4", "0.8475 ± 0.0010", "440.0 ± 12.5", "880.0 ± 20.0", "1400.0 ± 10.0",
                      "1200.0 ± 0.0", "3100.0 ± 0.0", "11.0 ± 0.0", "130.0 ± 0.0"]
    table = cifar[:cifar.index("### Two blocks")]
    assert _cells(table, "Keras `model.fit`, one process (2 seeds)")[1:3] == ["resnet20", "1"]
    assert _cells(cifar, "GS-ASGD + MS + SAMomentum (2 seeds, 1 collapsed)")[3] == "0.8420"  # no sd of one
    two = section(doc, "### Two blocks: GS-ASGD + MS against Keras, time to 0.80")
    assert _cells(two, "GS-ASGD + MS, 2 blocks (2 seeds)")[1:4] == ["2", "0.8490 ± 0.0020", "500.0 (1/2)"]
    assert "over GS-ASGD + MS's: 1.240" in two and "15 epochs" in two
    long = section(doc, "### Longer run: GS-ASGD + MS")
    assert _cells(long, "GS-ASGD + MS, longer run (1 seed)")[1:5] == ["resnet20", "2", "90", "0.9050"]
    # every row names its file and its command, the seeds beside it
    for variant in ("keras", "sync_dense", "asgd", "gs_asgd", "gs_asgd_ms", "gs_asgd_samomentum"):
        assert f"`conf/seed/cifar10_{variant}.yaml`, `" in cifar
    assert "--set data.num_blocks=2 --set data.test_blocks=2 --set 'engine.master=local[2]'`" in two
    assert "--set train.epochs=90" in long
    verdicts = VERDICT_ROW.findall(cifar)
    assert verdicts == ["**misses**", "holds", "holds"]  # the longer run's target asks for one seed
    assert "Targets of `bench/cifar_seeds.py`: 2 hold, 1 miss, 0 not judged, of 3." in cifar


def test_the_cifar_targets_are_counted_with_the_rest(results):
    before = render.render(str(results))["benchmarks"]
    heading = "## Seed experiment on CIFAR-10 (JPEG copy)"
    assert section(before, heading).splitlines()[2] == render.NOT_MEASURED
    shutil.copyfile(CIFAR_FIXTURE, results / "accuracy-cifar10.json")
    doc = render.render(str(results))["benchmarks"]
    rows = VERDICT_ROW.findall(doc)
    assert len(rows) == targets_in_json(str(results)) == len(VERDICT_ROW.findall(before)) + 3
    hold, miss, nj = rows.count("holds"), rows.count("**misses**"), rows.count("not judged")
    line = f"**Targets: {hold} hold, {miss} miss, {nj} not judged, of {len(rows)}**"
    assert doc.splitlines()[2].startswith(line)


LINKS_FIXTURE = os.path.join(os.path.dirname(__file__), "data", "links-cifar10.json")  # a 1-epoch sample run


def test_the_cifar_slow_links_render_each_cell_the_model_beside_it_and_their_targets(results):
    before = render.render(str(results))
    heading = "## Slow links on CIFAR-10 (JPEG copy): GS-ASGD + MS against ASGD"
    assert section(before["benchmarks"], heading).splitlines()[2] == render.NOT_MEASURED
    shutil.copyfile(LINKS_FIXTURE, results / "links-cifar10.json")
    out = render.render(str(results))
    links = section(out["benchmarks"], heading)
    asgd = _cells(links, "10mbit | ASGD (stream")
    assert asgd[1] == "ASGD (stream, async, H = 1, dense)" and asgd[2] == "— (0/1 reached)"
    assert asgd[4:7] == ["102.2", "152.1", "wire"]  # measured images/s, the model's, its bound
    assert "`conf/seed/cifar10_gs_asgd_ms.yaml`, `sparkcnn train --config conf/seed/cifar10_gs_asgd_ms.yaml" in links
    with open(LINKS_FIXTURE, encoding="utf-8") as fh:  # four trained gates and the speed-up
        assert len(VERDICT_ROW.findall(links)) == len(json.load(fh)["checks"]) == 5
    assert "Targets of `bench/cifar_links.py`: 0 hold, 0 miss, 5 not judged, of 5." in links
    assert "at 10 Mbit/s a host it has no ratio to ASGD's (target 3x: not judged)" in out["headline"]
