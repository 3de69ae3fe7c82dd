"""Checkpoints of the full run state: what a checkpoint holds, pickle-free.

A checkpoint is three kinds of file, each parsed without pickle::

    arrays.npz        run-level arrays (W, U, ...), .npy members, no object dtypes
    state.json        JSON: version, round, seeds, config, metrics so far, ...
    block-<k>.npz     per-block state (residual, momentum, ...), k = 0, 1, ...

:func:`save_checkpoint` renders and checks them all before anything is written;
:func:`load_checkpoint` parses the bytes the manifest vouched for. Where they go,
the manifest, atomicity, pruning and the checks of every byte are the on-disk
format's (:mod:`sparkcnn.checkpoint_format`); every failure is a one-line
:class:`BadInput` naming the file.
"""

from __future__ import annotations

import io
import json
import zipfile
from dataclasses import dataclass, field

import numpy as np

from sparkcnn import runfs
from sparkcnn.checkpoint_format import (ARRAYS, BLOCK_FILE, STATE, check_name, one_line, read_checkpoint,
                                        write_checkpoint)
from sparkcnn.errors import BadInput

__all__ = ["Checkpoint", "int_keys", "json_keys", "load_checkpoint", "save_checkpoint"]


@dataclass
class Checkpoint:
    arrays: dict[str, np.ndarray]
    state: dict
    blocks: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)
    name: str = ""
    path: str = ""  # the checkpoint directory it was read from


def json_keys(counts: dict[int, int]) -> dict[str, int]:
    """A block- or staleness-keyed counter as a JSON object (its keys become strings)."""
    return {str(k): int(v) for k, v in counts.items()}


def int_keys(obj: dict[str, int]) -> dict[int, int]:
    """The inverse of :func:`json_keys`, as read back from a checkpoint's state."""
    return {int(k): int(v) for k, v in obj.items()}


def _npz_bytes(arrays: dict[str, np.ndarray], what: str) -> bytes:
    """An .npz (zip of .npy members, as np.savez writes it) refusing object dtypes."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for key, value in arrays.items():
            if not isinstance(key, str) or not key or "/" in key or "\\" in key:
                raise BadInput(f"checkpoint {what}: array name must be a non-empty string without '/', "
                               f"got {key!r}")
            arr = np.asarray(value)
            if arr.dtype.hasobject:
                raise BadInput(f"checkpoint {what}: array {key!r} has object dtype "
                               "(no pickle in checkpoints)")
            with zf.open(key + ".npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, arr, allow_pickle=False)
    return buf.getvalue()


def _render(arrays: dict, state: dict, blocks: dict | None) -> dict[str, bytes]:
    """File name -> contents of one checkpoint, validated before anything is written."""
    if not isinstance(state, dict):
        raise BadInput(f"checkpoint state must be a dict, got {type(state).__name__}")
    try:
        state_json = json.dumps(state, sort_keys=True, indent=1).encode()
    except (TypeError, ValueError) as exc:
        raise BadInput(f"checkpoint state.json: state is not JSON-serialisable ({one_line(exc)})") from None
    files = {ARRAYS: _npz_bytes(arrays, ARRAYS), STATE: state_json}
    for k, block in sorted((blocks or {}).items()):
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
            raise BadInput(f"checkpoint blocks: block id must be an int >= 0, got {k!r}")
        files[f"block-{int(k)}.npz"] = _npz_bytes(block, f"block-{int(k)}.npz")
    return files


def save_checkpoint(run_dir: str, name: str, *, arrays: dict[str, np.ndarray], state: dict,
                    blocks: dict[int, dict[str, np.ndarray]] | None = None, keep: int = 2) -> str:
    """Write checkpoint ``name`` under ``run_dir/checkpoints``; return its directory.

    Every value is checked before anything is written; the files are then written
    atomically, and older checkpoints beyond ``keep`` pruned
    (:func:`~sparkcnn.checkpoint_format.write_checkpoint`).
    """
    check_name(name, "checkpoint name")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise BadInput(f"checkpoint keep must be an int >= 1, got {keep!r}")
    files = _render(arrays, state, blocks)
    return write_checkpoint(run_dir, name, files, keep)


def _load_npz(path: str, data: bytes) -> dict[str, np.ndarray]:
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            return {key: npz[key] for key in npz.files}
    except ValueError as exc:
        if "allow_pickle" in str(exc):
            raise BadInput(f"checkpoint {path}: holds an object array (pickle is not allowed)") from None
        raise BadInput(f"checkpoint {path}: not a valid .npz ({one_line(exc)})") from None
    except (OSError, EOFError, zipfile.BadZipFile) as exc:
        raise BadInput(f"checkpoint {path}: not a valid .npz ({one_line(exc)})") from None


def load_checkpoint(path_or_run_dir: str) -> Checkpoint:
    """Read and verify a checkpoint (a run dir means the one its LATEST names).

    Only files listed in the manifest are read; anything else in the
    directory is ignored.
    """
    ckpt, data = read_checkpoint(path_or_run_dir)
    state_path = runfs.join(ckpt, STATE)
    try:
        state = json.loads(data[STATE])
    except ValueError as exc:
        raise BadInput(f"checkpoint {state_path}: malformed JSON ({one_line(exc)})") from None
    if not isinstance(state, dict):
        raise BadInput(f"checkpoint {state_path}: expected a JSON object, got {type(state).__name__}")
    blocks = {int(BLOCK_FILE.fullmatch(f).group(1)): _load_npz(runfs.join(ckpt, f), d)
              for f, d in data.items() if BLOCK_FILE.fullmatch(f)}
    return Checkpoint(arrays=_load_npz(runfs.join(ckpt, ARRAYS), data[ARRAYS]),
                      state=state, blocks=dict(sorted(blocks.items())), name=runfs.name(ckpt), path=ckpt)
