"""Checkpoints (pure tier): round trip, corruption refused by name, crash safety, pruning."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest

from sparkcnn import checkpoint_format
from sparkcnn.checkpoint import load_checkpoint, save_checkpoint
from sparkcnn.checkpoint_format import latest_checkpoint
from sparkcnn.errors import BadInput

FILES = ["arrays.npz", "state.json", "block-0.npz", "block-3.npz", "manifest.json"]


def make_run(seed: int = 0):
    rng = np.random.default_rng(seed)
    arrays = {
        "W": rng.standard_normal(1000).astype(np.float32),
        "U": rng.standard_normal(1000).astype(np.float32),
        "rng_state": rng.integers(0, 2**63, 4, dtype=np.uint64),
        "special": np.array([np.nan, -0.0, np.inf, 1e-45], np.float32),  # bit patterns must survive
        "mask": rng.random((3, 4)) < 0.5,
        "version": np.int64(120 + seed),
    }
    state = {"version": 120 + seed, "round": 40, "seeds": [42, 7], "run_id": "fmnist-x",
             "config": {"compression": {"density": 0.001}, "engine": {"mode": "sync"}},
             "metrics": [{"round": 1, "loss": 2.3, "acc": None}]}
    blocks = {k: {"residual": rng.standard_normal(50).astype(np.float32),
                  "momentum": rng.standard_normal(50).astype(np.float16)} for k in (0, 3)}
    return arrays, state, blocks


def assert_same_arrays(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key, w in want.items():
        w = np.asarray(w)
        assert got[key].dtype == w.dtype and got[key].shape == w.shape, key
        assert got[key].tobytes() == w.tobytes(), key


@pytest.fixture
def run(tmp_path):
    """A run dir with one checkpoint 'r000120'; returns (run_dir, ckpt_dir, (arrays, state, blocks))."""
    run_dir = str(tmp_path / "run")
    contents = make_run()
    arrays, state, blocks = contents
    path = save_checkpoint(run_dir, "r000120", arrays=arrays, state=state, blocks=blocks)
    return run_dir, path, contents


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        data[offset % len(data)] ^= 0xFF
        f.seek(0)
        f.write(data)


def reseal(ckpt_dir: str, **changes) -> None:
    """Rewrite the manifest after a deliberate change, so only the change is tested."""
    mpath = os.path.join(ckpt_dir, "manifest.json")
    with open(mpath) as f:
        m = json.load(f)
    for name in m["files"]:
        with open(os.path.join(ckpt_dir, name), "rb") as f:
            data = f.read()
        m["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    m.update(changes)
    with open(mpath, "w") as f:
        json.dump(checkpoint_format._seal(m), f)


def refused(target: str, match: str) -> str:
    with pytest.raises(BadInput, match=match) as info:
        load_checkpoint(target)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


# -- round trip -------------------------------------------------------------------------

def test_round_trip(run):
    run_dir, path, (arrays, state, blocks) = run
    assert path == os.path.join(run_dir, "checkpoints", "r000120")
    assert sorted(os.listdir(path)) == sorted(FILES)
    for target in (run_dir, os.path.join(run_dir, "checkpoints"), path):
        got = load_checkpoint(target)
        assert_same_arrays(got.arrays, arrays)
        assert got.state == state
        assert sorted(got.blocks) == [0, 3]
        for k in blocks:
            assert_same_arrays(got.blocks[k], blocks[k])
        assert (got.name, got.path) == ("r000120", path)
    assert latest_checkpoint(run_dir) == path


def test_no_blocks(tmp_path):
    path = save_checkpoint(str(tmp_path), "c1", arrays={"W": np.zeros(3, np.float32)}, state={})
    got = load_checkpoint(path)
    assert got.blocks == {} and got.state == {}
    assert sorted(os.listdir(path)) == ["arrays.npz", "manifest.json", "state.json"]


def test_latest_follows_newest_and_none_without(tmp_path, run):
    assert latest_checkpoint(str(tmp_path / "elsewhere")) is None
    run_dir, _, _ = run
    arrays, state, _ = make_run(1)
    newer = save_checkpoint(run_dir, "r000121", arrays=arrays, state=state)
    assert latest_checkpoint(run_dir) == newer
    assert load_checkpoint(run_dir).state["version"] == 121


def test_unlisted_files_are_ignored(run):
    run_dir, path, (_, state, _) = run
    with open(os.path.join(path, "notes.txt"), "w") as f:
        f.write("hello")
    assert load_checkpoint(run_dir).state == state


# -- corruption is refused, naming the file -----------------------------------------------

@pytest.mark.parametrize("offset", [0, 77, -1, -30])
@pytest.mark.parametrize("name", FILES)
def test_flipped_byte_refused(run, name, offset):
    run_dir, path, _ = run
    flip(os.path.join(path, name), offset)
    msg = refused(run_dir, "checkpoint ")
    assert os.path.join(path, name) in msg


@pytest.mark.parametrize("name", FILES)
def test_truncated_file_refused(run, name):
    run_dir, path, _ = run
    target = os.path.join(path, name)
    os.truncate(target, os.path.getsize(target) // 2)
    msg = refused(run_dir, "checkpoint ")
    assert target in msg
    if name != "manifest.json":
        assert "truncated" in msg


def test_sha_mismatch_message(run):
    run_dir, path, _ = run
    flip(os.path.join(path, "arrays.npz"), 200)
    refused(run_dir, f"^checkpoint {os.path.join(path, 'arrays.npz')}: SHA-256 mismatch "
                     r"\(file changed or corrupt\)$")


@pytest.mark.parametrize("name", ["arrays.npz", "state.json", "block-3.npz"])
def test_missing_file_refused(run, name):
    run_dir, path, _ = run
    os.remove(os.path.join(path, name))
    refused(run_dir, f"{os.path.join(path, name)}: missing \\(listed in manifest.json\\)")


def test_missing_manifest_refused(run):
    _, path, _ = run
    os.remove(os.path.join(path, "manifest.json"))
    refused(path, f"{os.path.join(path, 'manifest.json')}: missing")


def test_missing_latest_refused(run):
    run_dir, _, _ = run
    os.remove(os.path.join(run_dir, "checkpoints", "LATEST"))
    refused(run_dir, f"{os.path.join(run_dir, 'checkpoints', 'LATEST')}: missing")
    assert latest_checkpoint(run_dir) is None


@pytest.mark.parametrize("content, match", [
    ("r000999\n", "names 'r000999', which is missing"),
    ("../../etc\n", "does not hold a checkpoint name"),
    ("", "does not hold a checkpoint name"),
])
def test_bad_latest_refused(run, content, match):
    run_dir, _, _ = run
    latest = os.path.join(run_dir, "checkpoints", "LATEST")
    with open(latest, "w") as f:
        f.write(content)
    refused(run_dir, f"{latest}: {match}")
    with pytest.raises(BadInput, match=match):
        latest_checkpoint(run_dir)


def test_not_a_directory_refused(tmp_path):
    refused(str(tmp_path / "nope"), "no such directory")
    refused(str(tmp_path), "manifest.json: missing")


def test_unknown_format_version_refused(run):
    run_dir, path, _ = run
    reseal(path, version=2)
    refused(run_dir, "manifest.json: unknown format version 2 \\(this sparkcnn reads version 1\\)")


def test_malformed_state_json_refused(run):
    run_dir, path, _ = run
    with open(os.path.join(path, "state.json"), "w") as f:
        f.write('{"version": 1,')
    reseal(path)
    refused(run_dir, "state.json: malformed JSON")


def test_object_array_in_npz_refused(run):
    run_dir, path, _ = run
    np.savez(os.path.join(path, "block-0.npz"), residual=np.array([{"a": 1}, None], dtype=object))
    reseal(path)
    refused(run_dir, f"{os.path.join(path, 'block-0.npz')}: holds an object array \\(pickle is not allowed\\)")


@pytest.mark.parametrize("kwargs, match", [
    (dict(arrays={"W": np.array([1, "x"], dtype=object)}, state={}),
     "arrays.npz: array 'W' has object dtype"),
    (dict(arrays={}, state={}, blocks={2: {"m": np.array([None])}}),
     "block-2.npz: array 'm' has object dtype"),
    (dict(arrays={}, state={"w": np.zeros(2)}), "state.json: state is not JSON-serialisable"),
    (dict(arrays={}, state={}, blocks={-1: {}}), "block id must be an int >= 0, got -1"),
    (dict(arrays={"a/b": np.zeros(1)}, state={}), "array name must be a non-empty string without '/'"),
])
def test_save_refuses_bad_content(tmp_path, kwargs, match):
    with pytest.raises(BadInput, match=match):
        save_checkpoint(str(tmp_path), "c1", **kwargs)
    assert not os.path.exists(tmp_path / "checkpoints" / "c1")


@pytest.mark.parametrize("name", ["", ".hidden", "a/b", "LATEST", "../x", "-r1"])
def test_save_refuses_bad_name(tmp_path, name):
    with pytest.raises(BadInput, match="checkpoint name must be"):
        save_checkpoint(str(tmp_path), name, arrays={}, state={})


# -- crash safety ---------------------------------------------------------------------------

def crash_on(monkeypatch, call: int) -> None:
    """Make the ``call``-th os.replace (1-based) raise, as a crash at that point would."""
    real, count = os.replace, [0]

    def replace(src, dst):
        count[0] += 1
        if count[0] == call:
            raise OSError("simulated crash")
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)


def visible(run_dir: str) -> list[str]:
    return sorted(os.listdir(os.path.join(run_dir, "checkpoints")))


def test_crash_renaming_checkpoint_keeps_previous(run, monkeypatch):
    run_dir, path, (arrays, state, _) = run
    crash_on(monkeypatch, 1)
    new_arrays, new_state, _ = make_run(1)
    with pytest.raises(OSError, match="simulated crash"):
        save_checkpoint(run_dir, "r000121", arrays=new_arrays, state=new_state)
    assert visible(run_dir) == ["LATEST", "r000120"]  # no half checkpoint, no temp dir
    got = load_checkpoint(run_dir)
    assert_same_arrays(got.arrays, arrays)
    assert got.state == state


def test_crash_updating_latest_keeps_previous(run, monkeypatch):
    run_dir, path, (_, state, _) = run
    crash_on(monkeypatch, 2)
    new_arrays, new_state, _ = make_run(1)
    with pytest.raises(OSError, match="simulated crash"):
        save_checkpoint(run_dir, "r000121", arrays=new_arrays, state=new_state)
    assert load_checkpoint(run_dir).state == state  # LATEST still names the old one
    assert load_checkpoint(os.path.join(run_dir, "checkpoints", "r000121")).state == new_state
    assert not [e for e in visible(run_dir) if e.startswith(".")]


def test_crash_replacing_same_name_restores_old(run, monkeypatch):
    run_dir, path, (_, state, _) = run
    crash_on(monkeypatch, 2)  # 1: set the old one aside, 2: rename the new one in
    new_arrays, new_state, _ = make_run(1)
    with pytest.raises(OSError, match="simulated crash"):
        save_checkpoint(run_dir, "r000120", arrays=new_arrays, state=new_state)
    assert visible(run_dir) == ["LATEST", "r000120"]
    assert load_checkpoint(run_dir).state == state


def test_same_name_replaced(run):
    run_dir, path, _ = run
    arrays, state, _ = make_run(1)
    assert save_checkpoint(run_dir, "r000120", arrays=arrays, state=state) == path
    got = load_checkpoint(run_dir)
    assert got.state == state and got.blocks == {}
    assert visible(run_dir) == ["LATEST", "r000120"]


def test_leftovers_of_a_crash_are_cleaned(run):
    run_dir, _, _ = run
    os.mkdir(os.path.join(run_dir, "checkpoints", ".tmp-r000121-dead"))
    arrays, state, _ = make_run(1)
    save_checkpoint(run_dir, "r000122", arrays=arrays, state=state)
    assert visible(run_dir) == ["LATEST", "r000120", "r000122"]


# -- pruning ---------------------------------------------------------------------------------

@pytest.mark.parametrize("keep, names, left", [
    (2, ["r1", "r2", "r3", "r4"], ["r3", "r4"]),
    (3, ["r1", "r2", "r3", "r4"], ["r2", "r3", "r4"]),
    (1, ["r1", "r2"], ["r2"]),
    (1, ["b", "a"], ["a"]),              # by save order, not by name
    (2, ["r1", "r2", "r1"], ["r1", "r2"]),  # a re-saved name counts as new
    (5, ["r1", "r2"], ["r1", "r2"]),
])
def test_keep_prunes_oldest(tmp_path, keep, names, left):
    run_dir = str(tmp_path)
    for i, name in enumerate(names):
        save_checkpoint(run_dir, name, arrays={"i": np.array(i)}, state={"i": i}, keep=keep)
    assert visible(run_dir) == sorted(["LATEST", *left])
    assert load_checkpoint(run_dir).state == {"i": len(names) - 1}
    for name in left:
        load_checkpoint(os.path.join(run_dir, "checkpoints", name))


def test_keep_must_be_positive(tmp_path):
    with pytest.raises(BadInput, match="checkpoint keep must be an int >= 1, got 0"):
        save_checkpoint(str(tmp_path), "c1", arrays={}, state={}, keep=0)
