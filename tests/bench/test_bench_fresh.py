"""bench/fresh.py: a result is fresh only when sparkcnn/ at its commit is sparkcnn/ at HEAD."""

import importlib
import json
import subprocess

import pytest

fresh = importlib.import_module("bench.fresh")


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", fresh.ROOT, *args], capture_output=True, text=True, check=True).stdout.strip()


def _result(folder, name: str, **prov) -> None:
    (folder / name).write_text(json.dumps({"x": 1, "provenance": prov}))


def test_results_at_head_are_fresh_and_older_library_code_is_stale(tmp_path):
    head = _git("rev-parse", "HEAD")
    changes = _git("rev-list", "-n", "2", "HEAD", "--", "sparkcnn").splitlines()
    if len(changes) < 2:
        pytest.skip("this clone's history holds no older state of sparkcnn/ (shallow clone)")
    root = changes[1]  # before the latest change to sparkcnn/: its library differs from HEAD's
    _result(tmp_path, "a.json", git_commit=head, git_dirty=False)
    assert fresh.stale(str(tmp_path)) == ([], 1)
    _result(tmp_path, "b.json", git_commit=root, git_dirty=False)
    _result(tmp_path, "c.json", git_commit=head, git_dirty=True)
    _result(tmp_path, "d.json", git_dirty=False)
    _result(tmp_path, "e.json", git_commit="0" * 40, git_dirty=False)
    (tmp_path / "notes.txt").write_text("not a result")
    lines, checked = fresh.stale(str(tmp_path))
    assert checked == 5
    assert [ln.split(":")[0] for ln in lines] == ["b.json", "c.json", "d.json", "e.json"]
    assert f"sparkcnn/ differs from HEAD" in lines[0] and root[:7] in lines[0]
    assert "uncommitted changes" in lines[1]
    assert "no provenance.git_commit" in lines[2]
    assert "not in this repository" in lines[3]


def test_the_results_line_of_a_rendered_document():
    assert fresh.results_dir_of("# t\n\n<!-- results: bench/results/x -->\n\nbody") == "bench/results/x"
    assert fresh.results_dir_of("# no line") is None


def _render(*args) -> subprocess.CompletedProcess:
    import os
    import sys

    return subprocess.run([sys.executable, os.path.join(fresh.ROOT, "bench", "render.py"), *map(str, args)],
                          cwd=fresh.ROOT, capture_output=True, text=True, timeout=120)


def test_render_check_fresh_judges_the_folder_the_document_names(tmp_path):
    head = _git("rev-parse", "HEAD")
    results = tmp_path / "results"
    results.mkdir()
    _result(results, "accuracy.json", git_commit=head, git_dirty=False)
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text(f"# sparkcnn benchmarks\n\n<!-- results: {results} -->\n\nbody\n")
    ok = _render("--check-fresh", "--out", doc)
    assert ok.returncode == 0 and "1 of 1 results" in ok.stdout, ok.stdout + ok.stderr
    _result(results, "links.json", git_commit=head, git_dirty=True)
    stale = _render("--check-fresh", "--out", doc)
    assert stale.returncode == 1
    assert [ln for ln in stale.stdout.splitlines() if ln.startswith("stale:")] == [
        f"stale: {results}/links.json: run at {head[:7]} from a tree with uncommitted changes"]
    doc.write_text("# no results line\n")
    missing = _render("--check-fresh", "--out", doc)
    assert missing.returncode == 2 and "no '<!-- results: DIR -->' line" in missing.stderr
    assert doc.read_text() == "# no results line\n"  # nothing written
