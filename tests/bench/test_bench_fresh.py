"""bench/fresh.py: a result is fresh only when what decides what it measured is unchanged since its
commit (library, conf/, its bench script and the bench modules it imports, pyproject.toml, installed
versions), its tree was clean, and it is on its folder's manifest. Each case in a small temporary
git repository: no copy of this one."""

import importlib
import json
import os
import subprocess
import sys

import pytest

fresh = importlib.import_module("bench.fresh")
VERSIONS = {"python": "3.11.0", "tensorflow": "2.16.0", "keras": "3.3.0", "pyspark": "3.5.1", "numpy": "1.26.4",
            "pyarrow": "15.0.0"}


def git(root, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", "-C", str(root), *args],
                          capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture()
def repo(tmp_path):
    """A repository with a library, a config, a bench script importing a bench module, the render,
    and one result of that script at HEAD on its folder's manifest."""
    root = tmp_path / "repo"
    files = {"sparkcnn/core.py": "x = 1\n", "conf/default.yaml": "lr: 0.05\n", "pyproject.toml": "[project]\n",
             "bench/_common.py": "EXIT_MISSED = 3\n", "bench/helper.py": "y = 2\n",
             "bench/speed.py": "from bench._common import EXIT_MISSED\nfrom bench import helper\n",
             "bench/render.py": "# shows results\n", "bench/other.py": "z = 3\n", "docs/notes.md": "notes\n"}
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    git(root, "init", "-q")
    git(root, "add", ".")
    git(root, "commit", "-q", "-m", "c")
    results = root / "bench" / "results" / "run"
    results.mkdir(parents=True)
    result(results, "throughput.json", git_commit=git(root, "rev-parse", "HEAD"))
    fresh.write_manifest(str(results), ["throughput.json"])
    return root, results


def result(folder, name: str, **prov) -> None:
    prov = {"git_dirty": False, "command": ["python", "bench/speed.py"], **VERSIONS, **prov}
    (folder / name).write_text(json.dumps({"x": 1, "provenance": prov}))


def stale_lines(root, results, **versions):
    return fresh.stale(str(results), {**VERSIONS, **versions}, root=str(root))


def test_a_result_of_the_code_at_its_commit_is_fresh_and_what_shows_it_does_not_count(repo):
    root, results = repo
    assert stale_lines(root, results) == ([], 1)
    (root / "bench" / "render.py").write_text("# drawn differently\n")  # shows results, measures nothing
    (root / "bench" / "other.py").write_text("z = 4\n")  # not imported by the script
    (root / "docs" / "notes.md").write_text("more notes\n")
    (results / "notes.txt").write_text("not a result the render reads")
    assert stale_lines(root, results) == ([], 1)
    assert fresh.bench_imports("bench/speed.py", str(root)) == ["bench/_common.py", "bench/helper.py",
                                                                "bench/speed.py"]


@pytest.mark.parametrize("rel", ["conf/default.yaml", "bench/speed.py", "bench/helper.py", "bench/_common.py",
                                 "sparkcnn/core.py", "pyproject.toml"])
def test_a_change_to_what_the_result_measured_makes_it_stale_committed_or_not(repo, rel):
    root, results = repo
    (root / rel).write_text((root / rel).read_text() + "# changed\n")
    lines, checked = stale_lines(root, results)
    assert checked == 1 and len(lines) == 1 and f"e.g. {rel}" in lines[0], lines
    git(root, "commit", "-q", "-am", "change")
    assert f"e.g. {rel}" in stale_lines(root, results)[0][0]


def test_an_untracked_file_under_conf_makes_it_stale(repo):
    root, results = repo
    (root / "conf" / "extra.yaml").write_text("density: 0.01\n")
    (lines, _) = stale_lines(root, results)
    assert len(lines) == 1 and "conf/extra.yaml, untracked" in lines[0]


def test_other_installed_versions_make_it_stale(repo):
    root, results = repo
    (lines, _) = stale_lines(root, results, numpy="2.0.0")
    assert lines == ["throughput.json: numpy 1.26.4 when run, 2.0.0 installed"]


def test_a_result_off_the_manifest_or_edited_since_is_stale(repo):
    root, results = repo
    head = git(root, "rev-parse", "HEAD")
    result(results, "links.json", git_commit=head)  # put there by hand: not on the manifest
    (lines, checked) = stale_lines(root, results)
    assert checked == 2 and lines == ["links.json: not on the folder's manifest.json"]
    (results / "throughput.json").write_text((results / "throughput.json").read_text().replace('"x": 1', '"x": 2'))
    (lines, _) = stale_lines(root, results)
    assert "throughput.json: changed since bench/run_all.py wrote it" in lines[0]  # in the order the render reads
    os.remove(results / "manifest.json")
    assert all("has no manifest.json" in ln for ln in stale_lines(root, results)[0])


def test_a_dirty_run_or_one_without_commit_or_script_is_stale(repo):
    root, results = repo
    head = git(root, "rev-parse", "HEAD")
    result(results, "accuracy.json", git_commit=head, git_dirty=True)
    result(results, "scale.json", git_commit="0" * 40)
    result(results, "jobcost.json", git_commit=head, command=["python", "-c", "1"])
    fresh.write_manifest(str(results), ["accuracy.json", "scale.json", "jobcost.json"])
    lines = dict(ln.split(": ", 1) for ln in stale_lines(root, results)[0])
    assert "uncommitted changes" in lines["accuracy.json"]
    assert "not in this repository" in lines["scale.json"]
    assert "no bench script" in lines["jobcost.json"]


def test_the_render_refuses_a_file_off_the_manifest(repo):
    render = importlib.import_module("bench.render")
    root, results = repo
    (results / "throughput.json").write_text((results / "throughput.json").read_text().replace('"x": 1', '"x": 2'))
    d, refused = render.load_results(str(results))
    assert d["throughput"] is None and [n for n, _ in refused] == ["throughput.json"]
    assert "**Refused, so not shown:** `throughput.json`" in render.render(str(results))["benchmarks"]


def test_the_results_line_of_a_rendered_document():
    assert fresh.results_dir_of("# t\n\n<!-- results: bench/results/x -->\n\nbody") == "bench/results/x"
    assert fresh.results_dir_of("# no line") is None


def _render(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(fresh.ROOT, "bench", "render.py"), *map(str, args)],
                          cwd=fresh.ROOT, capture_output=True, text=True, timeout=120)


def test_render_check_fresh_judges_the_folder_the_document_names(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    result(results, "accuracy.json", git_commit=git(fresh.ROOT, "rev-parse", "HEAD"))
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text(f"# sparkcnn benchmarks\n\n<!-- results: {results} -->\n\nbody\n")
    stale = _render("--check-fresh", "--out", doc)  # no manifest: never fresh
    assert stale.returncode == 1 and "0 of 1 results" in stale.stdout
    assert [ln for ln in stale.stdout.splitlines() if ln.startswith("stale:")][0].startswith(
        f"stale: {results}/accuracy.json: the folder has no manifest.json")
    doc.write_text("# no results line\n")
    missing = _render("--check-fresh", "--out", doc)
    assert missing.returncode == 2 and "no '<!-- results: DIR -->' line" in missing.stderr
    assert doc.read_text() == "# no results line\n"  # nothing written
