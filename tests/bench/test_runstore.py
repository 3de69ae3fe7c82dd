"""bench/runstore.py: a bench's runs kept on disk, reused only while they describe the tree."""

import importlib
import json
import subprocess

import pytest

runstore = importlib.import_module("bench.runstore")
fresh = importlib.import_module("bench.fresh")


def git(root, *args):
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)


@pytest.fixture()
def repo(tmp_path, monkeypatch):
    """A repository with the parts a result depends on, committed; runs made at its HEAD."""
    root = tmp_path / "repo"
    for rel, text in {"sparkcnn/a.py": "A = 1\n", "conf/x.yaml": "a: 1\n", "pyproject.toml": "[x]\n",
                      "bench/seeds.py": "from bench import helper\n", "bench/helper.py": "H = 1\n"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    git(root, "init", "-q")
    git(root, "add", ".")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    made = {"git_commit": head.strip(), "git_dirty": False, **fresh.installed_versions()}
    monkeypatch.setattr(runstore, "provenance", lambda: dict(made, machine={}))
    return root


def counting():
    calls = []

    def run(data, name, overrides, epochs, out_dir, config_file):
        calls.append(name)
        return {"name": name, "test_accuracy": 0.5 + len(calls) / 100}

    return run, calls


def store(repo, tmp_path, **kw):
    return runstore.RunStore(str(tmp_path / "runs"), "bench/seeds.py", root=str(repo), **kw)


def test_a_fresh_run_is_reused_and_another_key_is_trained(repo, tmp_path):
    run, calls = counting()
    s = store(repo, tmp_path)
    first = s.runner(run)("data/x", "row", ["a=1"], 2, "/o", config_file="conf/x.yaml")
    again = store(repo, tmp_path).runner(run)("data/x", "row", ["a=1"], 2, "/o", config_file="conf/x.yaml")
    assert calls == ["row"] and again["test_accuracy"] == first["test_accuracy"] == 0.51
    assert again["made"]["git_commit"] == first["made"]["git_commit"]
    store(repo, tmp_path).runner(run)("data/x", "row", ["a=2"], 2, "/o", config_file="conf/x.yaml")
    store(repo, tmp_path).runner(run)("data/x", "row", ["a=1"], 3, "/o", config_file="conf/x.yaml")
    assert calls == ["row"] * 3  # another override, another epoch count: trained, not reused
    kept = list((tmp_path / "runs").iterdir())
    assert len(kept) == 3 and all(json.loads(p.read_text())["key"]["name"] == "row" for p in kept)


@pytest.mark.parametrize("change", ["conf/x.yaml", "bench/helper.py", "sparkcnn/new.py"])
def test_a_change_to_what_the_run_measured_trains_it_again(repo, tmp_path, change, capsys):
    run, calls = counting()
    store(repo, tmp_path).runner(run)("d", "row", [], 1, "/o", config_file="conf/x.yaml")
    (repo / change).write_text("changed = 2\n")  # a bench module the script imports counts too
    store(repo, tmp_path).runner(run)("d", "row", [], 1, "/o", config_file="conf/x.yaml")
    assert calls == ["row", "row"]
    assert "not reused" in capsys.readouterr().err


def test_a_run_made_from_a_dirty_tree_or_unreadable_is_trained_again(repo, tmp_path, monkeypatch):
    run, calls = counting()
    s = store(repo, tmp_path)
    s.runner(run)("d", "row", [], 1, "/o", config_file="c")
    path = next((tmp_path / "runs").iterdir())
    record = json.loads(path.read_text())
    record["made"]["git_dirty"] = True
    path.write_text(json.dumps(record))
    assert "uncommitted changes" in s.stale(record)
    s.runner(run)("d", "row", [], 1, "/o", config_file="c")
    path.write_text("{not json")
    s.runner(run)("d", "row", [], 1, "/o", config_file="c")
    assert calls == ["row"] * 3 and json.loads(path.read_text())["made"]["git_dirty"] is False


def test_the_budget_stops_before_a_run_and_kept_runs_still_come_back(repo, tmp_path, monkeypatch):
    run, calls = counting()
    store(repo, tmp_path).runner(run)("d", "one", [], 1, "/o", config_file="c")
    s = store(repo, tmp_path, budget_min=1)
    s.deadline = 0.0  # the budget is spent
    assert s.runner(run)("d", "one", [], 1, "/o", config_file="c")["name"] == "one"  # kept: no time needed
    with pytest.raises(runstore.Incomplete, match="budget spent: 0 run"):
        s.runner(run)("d", "two", [], 1, "/o", config_file="c")
    assert calls == ["one"] and (s.reused, s.made) == (1, 0)
