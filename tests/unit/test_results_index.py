"""bench/results/INDEX.md against bench/results/: every folder on the index, every indexed folder
on disk, and the index what bench/results_index.py writes from the folders' provenance."""

import importlib
import os
import re

ri = importlib.import_module("bench.results_index")


def read_index() -> str:
    with open(ri.INDEX, encoding="utf-8") as fh:
        return fh.read()


def test_every_results_folder_is_on_the_index_and_every_indexed_folder_exists():
    disk, indexed = set(ri.folders_on_disk()), ri.folders_in_index(read_index())
    problems = [f"bench/results/{n}/ is not on bench/results/INDEX.md" for n in sorted(disk - set(indexed))]
    problems += [f"bench/results/INDEX.md names {n}/, which does not exist" for n in sorted(set(indexed) - disk)]
    problems += [f"bench/results/INDEX.md names {n}/ twice" for n in sorted({n for n in indexed
                                                                              if indexed.count(n) > 1})]
    assert not problems, ("\n".join(problems) + "\nadd the folder to KEPT in bench/results_index.py and run "
                          "`python bench/results_index.py`, or `git rm -r` it")


def test_the_index_is_what_bench_results_index_writes():
    assert ri.mismatch() == []
    assert read_index() == ri.render(), "bench/results/INDEX.md is stale: run `python bench/results_index.py`"


def test_the_rendered_set_is_on_the_index():
    with open(os.path.join(ri.ROOT, "BENCHMARKS.md"), encoding="utf-8") as fh:
        named = re.search(r"^<!-- results: (.+) -->$", fh.read(), re.M).group(1)
    assert os.path.dirname(named) == "bench/results"
    assert os.path.basename(named) in ri.folders_in_index(read_index())


def test_a_folder_missing_from_kept_or_from_disk_is_reported(tmp_path, monkeypatch):
    for name in ("2026-12-06-final-3", "2026-12-09-new"):
        (tmp_path / name).mkdir()
    (tmp_path / "INDEX.md").write_text("not a folder")
    monkeypatch.setattr(ri, "KEPT", {"2026-12-06-final-3": ("w", "y"), "2026-12-01-gone": ("w", "y")})
    assert ri.mismatch(str(tmp_path)) == [
        "bench/results/2026-12-09-new/ is not in KEPT: add it with its reason, or git rm -r it",
        "KEPT names bench/results/2026-12-01-gone/, which does not exist"]


def test_rows_name_the_benchmarks_and_commits_of_the_files(tmp_path, monkeypatch):
    folder = tmp_path / "2026-12-09-x"
    folder.mkdir()
    prov = '{"provenance": {"git_commit": "%s", "git_dirty": %s, "command": ["python", "bench/%s.py"]}}'
    (folder / "throughput.json").write_text(prov % ("a" * 40, "false", "throughput"))
    (folder / "throughput-2.json").write_text(prov % ("b" * 40, "true", "throughput"))
    (folder / "old.json").write_text('{"rows": 1}')
    monkeypatch.setattr(ri, "KEPT", {"2026-12-09-x": ("what", "why")})
    [row] = [ln for ln in ri.render(str(tmp_path)).splitlines() if ln.startswith("| `")]
    assert row == ("| `2026-12-09-x/` | old, throughput ×2 | not recorded: old; "
                   "bbbbbbb (dirty tree): throughput-2; aaaaaaa: throughput | what | why |")
    assert ri.folders_in_index(row) == ["2026-12-09-x"]
