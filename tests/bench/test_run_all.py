"""bench/run_all.py's bookkeeping: the dated folder, the archive move, the plan, bad arguments."""

import importlib
import os
import subprocess

import pytest

ra = importlib.import_module("bench.run_all")


@pytest.fixture
def results(tmp_path, monkeypatch):
    monkeypatch.setattr(ra, "RESULTS", str(tmp_path))
    return tmp_path


def test_a_second_run_of_the_day_gets_its_own_folder(results):
    assert ra.dated_folder("2026-12-01") == str(results / "2026-12-01")
    (results / "2026-12-01").mkdir()
    (results / "2026-12-01-2").mkdir()
    assert ra.dated_folder("2026-12-01") == str(results / "2026-12-01-3")


def test_older_results_move_to_the_archive_untouched(results):
    (results / "throughput.json").write_text('{"a": 1}')
    (results / "2026-11-30").mkdir()
    (results / "2026-11-30" / "scale.json").write_text('{"b": 2}')
    (results / "notes.txt").write_text("kept")
    assert ra.archive_older() == ["2026-11-30", "throughput.json"]
    assert (results / "archive" / "throughput.json").read_text() == '{"a": 1}'
    assert (results / "archive" / "2026-11-30" / "scale.json").read_text() == '{"b": 2}'
    assert sorted(os.listdir(results)) == ["archive", "notes.txt"]
    (results / "throughput.json").write_text('{"a": 3}')
    with pytest.raises(SystemExit, match="archive/throughput.json exists"):
        ra.archive_older()
    assert (results / "archive" / "throughput.json").read_text() == '{"a": 1}'  # nothing overwritten


def test_the_archive_move_leaves_the_tree_clean_for_the_benchmarks(tmp_path):
    """Each benchmark reads ``git_dirty`` at its start, after run_all has moved the older
    results: moved results are not a modified tree; any other change is."""
    from bench._common import tree_dirty

    def git(*args):
        subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "throughput.json").write_text("{}")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "c")
    assert not tree_dirty(str(tmp_path))
    os.makedirs(tmp_path / "bench" / "results" / "archive")
    os.rename(tmp_path / "bench" / "results" / "throughput.json",
              tmp_path / "bench" / "results" / "archive" / "throughput.json")
    assert not tree_dirty(str(tmp_path))
    (tmp_path / "code.py").write_text("x = 2\n")
    assert tree_dirty(str(tmp_path))


def test_the_full_plan_runs_the_seed_table_and_every_benchmark():
    full, quick = ra.benchmarks(False, 3), ra.benchmarks(True, 3)
    assert list(full) == ["accuracy", "accuracy-cifar10", "throughput", "jobcost", "scale", "balance",
                          "cifar", "costmodel", "links", "linkmodel", "links-cifar10", "psload", "shardmodel",
                          "servermodel", "momentum", "divergence"]
    # no standalone cluster, and not the CIFAR-10 benches (hours on the real data)
    assert list(quick) == ["accuracy", "throughput", "jobcost", "scale", "cifar", "psload",
                           "shardmodel", "servermodel", "momentum", "divergence"]
    assert full["divergence"][full["divergence"].index("--seeds") + 1] == "10"
    assert {"--keras", "--stream", "all"} <= set(full["accuracy"]) and "--quick" not in full["accuracy"]
    assert full["accuracy"][full["accuracy"].index("--seeds") + 1] == "3"
    assert all("--quick" in argv for name, argv in quick.items()
               if name not in ("jobcost", "shardmodel", "servermodel", "momentum", "divergence"))
    assert all(os.path.isfile(os.path.join(ra.ROOT, "bench", argv[0])) for argv in full.values())
    # the CIFAR-10 seed table: 2 seeds a row fit its budget, fewer when run_all is asked for fewer
    cifar = full["accuracy-cifar10"]
    assert cifar[0] == "cifar_seeds.py" and cifar[cifar.index("--seeds") + 1] == "2"
    # both CIFAR-10 benches keep their runs in the results folder, so that they can go on later
    assert cifar[cifar.index("--runs") + 1] == "{out}/cifar10-runs"
    links = full["links-cifar10"]
    assert links[0] == "cifar_links.py" and links[links.index("--linkmodel") + 1] == "{out}/linkmodel.json"
    one = ra.benchmarks(False, 1)["accuracy-cifar10"]
    assert one[one.index("--seeds") + 1] == "1"
    assert "accuracy-cifar10" in ra.fresh.READ  # the render reads what run_all saves


@pytest.mark.parametrize("argv, message", [(["--only", "nope"], "unknown benchmark 'nope'"),
                                           (["--seeds", "0"], "--seeds must be >= 1")])
def test_bad_arguments_exit_2_with_one_line(results, capsys, argv, message):
    assert ra.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert os.listdir(results) == []  # nothing written, nothing archived


def test_results_carry_no_path_of_the_machine():
    from bench._common import ROOT, _STARTED, portable_path

    assert portable_path(os.path.join(ROOT, "bench", "costmodel.py")) == os.path.join("bench", "costmodel.py")
    assert portable_path("/somewhere/else/data") == "<tmp>/data"
    assert not any(os.path.isabs(a) for a in _STARTED["command"][1:])


def test_a_folder_filled_over_several_invocations_lists_every_benchmark(tmp_path):
    import json

    path = str(tmp_path / "run_all.json")
    first = {"quick": False, "archived": [], "provenance": {"git_commit": "a"},
             "benchmarks": [{"name": "accuracy", "exit": 0}, {"name": "psload", "exit": 1}]}
    ra.write_record(path, first)
    assert json.loads(open(path).read()) == first  # a fresh folder: the record as it is
    ra.write_record(path, {"quick": False, "archived": [], "provenance": {"git_commit": "b"},
                           "benchmarks": [{"name": "psload", "exit": 0}, {"name": "links", "exit": 0}]})
    merged = json.loads(open(path).read())
    assert merged["benchmarks"] == [{"name": "accuracy", "exit": 0}, {"name": "psload", "exit": 0},
                                    {"name": "links", "exit": 0}]  # the rerun replaces its earlier entry
    assert merged["provenance"] == {"git_commit": "b"}
    assert merged["invocations"] == [{"git_commit": "a"}, {"git_commit": "b"}]
    ra.write_record(path, {"quick": False, "archived": [], "provenance": {"git_commit": "c"},
                           "benchmarks": [{"name": "peers", "exit": 0}]})
    assert [p["git_commit"] for p in json.loads(open(path).read())["invocations"]] == ["a", "b", "c"]


def test_a_missed_target_exits_with_its_own_code_and_a_crash_with_1():
    from bench._common import EXIT_MISSED

    assert EXIT_MISSED not in (0, 1, 2)
    ok, missed, crashed = {"exit": 0}, {"exit": EXIT_MISSED}, {"exit": 1}
    assert ra.exit_code([ok, ok]) == 0
    assert ra.exit_code([ok, missed]) == EXIT_MISSED
    assert ra.exit_code([ok, {"exit": 0, "missed": ["p99"]}]) == EXIT_MISSED  # a bench that exits 0 on a miss
    assert ra.exit_code([missed, crashed]) == 1 and ra.exit_code([ok, {"exit": 0, "error": "no JSON"}]) == 1
    assert ra.exit_code([ok], render_rc=2) == 1


def test_a_bench_exits_with_exit_missed_when_what_it_printed_misses(monkeypatch, capsys):
    from bench import _common

    monkeypatch.setattr(_common, "_EMITTED", [])
    assert _common.exit_status("psload", 2) == 2  # its own failure stands
    _common.emit({"target": {"pushes_per_s": 1000.0, "p99_ms": 50.0, "at_workers": 4, "met": True}, "cases": [
        {"workers": 4, "shards": 1, "pushes_per_s": 1100.0, "refused": 0, "repetitions": 5,
         "each": [{"reply_ms": {"p99": p}} for p in (3.0, 4.0, 90.0, 5.0, 4.0)]}]})
    assert _common.exit_status("psload") == _common.EXIT_MISSED  # one repetition's p99 over the bound
    monkeypatch.setattr(_common, "_EMITTED", [])
    _common.emit({"checks": {"sync-dense>=0.91": False}, "runs": [{"name": "sync-dense", "seeds": [1]}]})
    assert _common.exit_status("accuracy") == 0  # one seed: not judged, so not a miss
    capsys.readouterr()
