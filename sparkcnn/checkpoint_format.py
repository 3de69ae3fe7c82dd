"""The checkpoints' on-disk format: files under a manifest of SHA-256s, written atomically.

Layout under a run directory (one writer per run directory)::

    checkpoints/
      LATEST                  text: the name of the newest complete checkpoint + "\\n"
      <name>/
        arrays.npz            run-level arrays (W, U, ...), .npy members, no object dtypes
        state.json            JSON: version, round, seeds, config, metrics so far, ...
        block-<k>.npz         per-block state (residual, momentum, ...), k = 0, 1, ...
        manifest.json         {"format": "sparkcnn-checkpoint", "version": 1, "name", "seq",
                               "files": {file: {"sha256": hex, "size": bytes}},
                               "manifest_sha256": hex}

``manifest_sha256`` is the SHA-256 of the manifest's canonical JSON without
that key (``json.dumps(sort_keys=True, separators=(",", ":"))``), so a changed
manifest is caught too. ``seq`` counts saves in this run directory and orders
checkpoints for pruning.

Atomicity: files are written and fsynced in ``checkpoints/.tmp-<name>-<random>``,
which is renamed to ``<name>`` in one step; only then is ``LATEST`` replaced
(temp file + ``os.replace``) and are checkpoints beyond ``keep`` removed. A
crash at any point leaves ``LATEST`` naming a complete checkpoint. Loading
reads each listed file once and checks its size and SHA-256; :mod:`sparkcnn.checkpoint`
then parses the bytes checked, with ``allow_pickle=False``. Every failure is a
one-line :class:`BadInput` naming the file.

On an object store (a ``run_dir`` URI, see :mod:`sparkcnn.runfs`) there is no
directory rename: each file is one object written whole, straight into
``<name>/``, the manifest last; ``LATEST`` is written only after all of them, so
it names a checkpoint whose objects are all present (and loading verifies each
against the manifest all the same). A name that ``LATEST`` already names is
saved as ``<name>.<seq>`` rather than overwritten under it; the remains of a
save that crashed before ``LATEST`` moved are overwritten or pruned. Pruning
deletes a checkpoint's manifest last, so a half-pruned one is pruned again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import time

from sparkcnn import runfs
from sparkcnn.errors import BadInput

__all__ = ["LATEST", "MANIFEST", "latest_checkpoint", "read_checkpoint", "write_checkpoint"]

log = logging.getLogger(__name__)

FORMAT = "sparkcnn-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "LATEST"
ARRAYS = "arrays.npz"
STATE = "state.json"
BLOCK_FILE = re.compile(r"block-(0|[1-9][0-9]*)\.npz")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def one_line(exc: BaseException) -> str:
    """``exc``'s message on one line, for a BadInput that names the file."""
    return " ".join(str(exc).split()) or type(exc).__name__


def check_name(name: object, what: str) -> str:
    """``name`` when it can name a checkpoint directory (not hidden, not ``LATEST``); else BadInput."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name == LATEST:
        raise BadInput(f"{what} must be a name of letters, digits, '_', '.', '-' "
                       f"(not starting with '.' or '-'), got {name!r}")
    return name


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _canonical(obj: dict) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _seal(manifest: dict) -> dict:
    """``manifest`` with ``manifest_sha256`` set over the rest of it."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return {**body, "manifest_sha256": _sha256(_canonical(body))}


# -- writing ----------------------------------------------------------------------------

def _fsync_dir(path: str) -> None:
    # Makes a rename or a new entry durable; not every platform can open a directory.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _read_seq(ckpt_dir: str) -> int | None:
    try:
        seq = json.loads(runfs.read_bytes(runfs.join(ckpt_dir, MANIFEST))).get("seq")
    except (OSError, ValueError, AttributeError):
        return None
    return seq if isinstance(seq, int) and not isinstance(seq, bool) else None


def _existing(root: str) -> dict[str, int]:
    """Checkpoint name -> seq for every complete-looking checkpoint under ``root``."""
    out = {}
    for entry in runfs.listdir(root):
        path = runfs.join(root, entry)
        if not entry.startswith(".") and entry != LATEST:
            seq = _read_seq(path)
            if seq is not None:
                out[entry] = seq
    return out


def _remove(root: str, entry: str) -> None:
    """Delete ``root/entry``, first renaming it to a hidden name so no half-deleted checkpoint shows
    (on an object store: its other objects first, the manifest last)."""
    if runfs.is_uri(root):
        path = runfs.join(root, entry)
        for f in runfs.listdir(path):
            if f != MANIFEST:
                runfs.remove(runfs.join(path, f))
        runfs.remove(runfs.join(path, MANIFEST))
        runfs.rmtree(path)
        return
    path = os.path.join(root, entry)
    if not entry.startswith("."):
        hidden = os.path.join(root, f".old-{entry}-{secrets.token_hex(4)}")
        os.replace(path, hidden)
        path = hidden
    shutil.rmtree(path, ignore_errors=True)


def write_checkpoint(run_dir: str, name: str, files: dict[str, bytes], keep: int) -> str:
    """Write ``files`` (file name -> contents) as checkpoint ``name`` under ``run_dir/checkpoints``,
    with their manifest; return its directory.

    A checkpoint of the same name is replaced: the old one is renamed aside,
    the new one renamed in (a crash between those two renames leaves the old
    one under ``.old-<name>-*``), and the old one deleted at the end. After
    ``LATEST`` names the new checkpoint, all but the newest ``keep`` (by
    ``seq``) are deleted, as are temp directories a crashed save left behind.
    On an object store, see the module docstring. ``name`` and ``keep`` are the
    caller's to check (:func:`check_name`).
    """
    root = runfs.join(run_dir, "checkpoints")
    runfs.makedirs(root)
    existing = _existing(root)
    seq = max(existing.values(), default=0) + 1
    remote = runfs.is_uri(root)
    if remote and _latest_name(root) == name:  # no rename: never overwrite what LATEST names
        name = f"{name}.{seq}"
    manifest = _seal({
        "format": FORMAT, "version": FORMAT_VERSION, "name": name, "seq": seq,
        "saved_at": round(time.time(), 3),  # unix seconds, informative only
        "files": {f: {"sha256": _sha256(data), "size": len(data)} for f, data in files.items()},
    })
    files[MANIFEST] = json.dumps(manifest, sort_keys=True, indent=1).encode()
    final = (_put_objects if remote else _put_directory)(root, name, files)
    log.info("checkpoint %s saved (seq %s, %s files, %s bytes)", final, seq, len(files),
             sum(len(d) for d in files.values()))

    existing[name] = seq
    for old in sorted(existing, key=existing.get)[:-keep]:
        try:  # the new checkpoint is safe; failing to prune must not fail the run
            _remove(root, old)
            log.info("checkpoint %s pruned (keep=%s)", runfs.join(root, old), keep)
        except OSError as exc:
            log.warning("checkpoint %s not pruned: %s", runfs.join(root, old), exc)
    if remote:
        try:
            for entry in runfs.listdir(root):  # no manifest: the remains of a save that crashed
                if entry not in existing and entry != LATEST:
                    runfs.rmtree(runfs.join(root, entry))
        except OSError as exc:
            log.warning("checkpoint %s: leftovers not removed: %s", root, exc)
        return final
    for entry in os.listdir(root):
        if entry.startswith((".tmp-", ".old-")):  # left by a crashed save, or set aside above
            shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
        elif entry.startswith(f".{LATEST}-"):
            os.unlink(os.path.join(root, entry))
    _fsync_dir(root)
    return final


def _put_directory(root: str, name: str, files: dict[str, bytes]) -> str:
    """A local checkpoint: a temp directory renamed to ``name``, then ``LATEST`` replaced."""
    tmp = os.path.join(root, f".tmp-{name}-{secrets.token_hex(6)}")
    final = os.path.join(root, name)
    os.mkdir(tmp)
    try:
        for f, data in files.items():  # manifest last: its presence marks the files complete
            _write(os.path.join(tmp, f), data)
        _fsync_dir(tmp)
        displaced = None
        if os.path.lexists(final):  # same name saved again: set the old one aside, not delete it
            displaced = os.path.join(root, f".old-{name}-{secrets.token_hex(4)}")
            os.replace(final, displaced)
        try:
            os.replace(tmp, final)
        except BaseException:
            if displaced:
                os.replace(displaced, final)
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(root)

    pointer = os.path.join(root, f".{LATEST}-{secrets.token_hex(6)}")
    try:
        _write(pointer, (name + "\n").encode())
        os.replace(pointer, os.path.join(root, LATEST))
    except BaseException:
        if os.path.exists(pointer):
            os.unlink(pointer)
        raise
    _fsync_dir(root)
    return final


def _put_objects(root: str, name: str, files: dict[str, bytes]) -> str:
    """An object-store checkpoint: one whole object per file, the manifest last, then ``LATEST``.

    A stale ``name`` (a crashed save that LATEST never named) loses its manifest first, so
    it cannot pass for complete while its files are overwritten.
    """
    final = runfs.join(root, name)
    runfs.remove(runfs.join(final, MANIFEST))
    for f, data in files.items():  # manifest last: its presence marks the files complete
        runfs.write_bytes(runfs.join(final, f), data)
    runfs.write_bytes(runfs.join(root, LATEST), (name + "\n").encode())
    return final


# -- reading ----------------------------------------------------------------------------

def _latest_name(root: str) -> str | None:
    """What ``root/LATEST`` says, unchecked; None when it is missing or unreadable."""
    try:
        return runfs.read_bytes(runfs.join(root, LATEST)).decode().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _read_latest(root: str) -> str:
    path = runfs.join(root, LATEST)
    try:
        text = runfs.read_bytes(path).decode()
    except FileNotFoundError:
        raise BadInput(f"checkpoint {path}: missing (no checkpoint saved in this run yet?)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"checkpoint {path}: unreadable ({one_line(exc)})") from None
    name = text.strip()
    if not _NAME.fullmatch(name) or name == LATEST:
        raise BadInput(f"checkpoint {path}: does not hold a checkpoint name, got {text[:40]!r}")
    if not runfs.isdir(runfs.join(root, name)):
        raise BadInput(f"checkpoint {path}: names {name!r}, which is missing")
    return runfs.join(root, name)


def latest_checkpoint(run_dir: str) -> str | None:
    """The directory ``run_dir/checkpoints/LATEST`` names, or None when there is no LATEST."""
    root = runfs.join(run_dir, "checkpoints")
    if not runfs.exists(runfs.join(root, LATEST)):
        return None
    return _read_latest(root)


def _resolve(path: str) -> str:
    """A checkpoint directory from a run dir, a checkpoints dir or a checkpoint dir."""
    if not runfs.isdir(path):
        raise BadInput(f"checkpoint {path}: no such directory")
    if runfs.exists(runfs.join(path, MANIFEST)):
        return path
    for root in (runfs.join(path, "checkpoints"), path):
        if runfs.exists(runfs.join(root, LATEST)):
            return _read_latest(root)
    if runfs.isdir(runfs.join(path, "checkpoints")):
        return _read_latest(runfs.join(path, "checkpoints"))  # raises: LATEST missing
    raise BadInput(f"checkpoint {runfs.join(path, MANIFEST)}: missing (not a checkpoint or run directory)")


def _manifest(ckpt: str) -> dict[str, dict]:
    """The verified ``files`` table of ``ckpt``'s manifest."""
    path = runfs.join(ckpt, MANIFEST)
    try:
        m = json.loads(runfs.read_bytes(path))
    except FileNotFoundError:
        raise BadInput(f"checkpoint {path}: missing") from None
    except (OSError, ValueError) as exc:
        raise BadInput(f"checkpoint {path}: malformed JSON ({one_line(exc)})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise BadInput(f"checkpoint {path}: not a {FORMAT} manifest")
    if m.get("version") != FORMAT_VERSION:
        raise BadInput(f"checkpoint {path}: unknown format version {m.get('version')!r} "
                       f"(this sparkcnn reads version {FORMAT_VERSION})")
    if m.get("manifest_sha256") != _seal(m)["manifest_sha256"]:
        raise BadInput(f"checkpoint {path}: SHA-256 mismatch (file changed or corrupt)")
    files = m.get("files")
    ok = isinstance(files, dict) and all(
        isinstance(f, str) and (f in (ARRAYS, STATE) or BLOCK_FILE.fullmatch(f))
        and isinstance(e, dict) and isinstance(e.get("sha256"), str)
        and isinstance(e.get("size"), int) for f, e in files.items())
    if not ok or ARRAYS not in files or STATE not in files:
        raise BadInput(f"checkpoint {path}: malformed file table")
    return files


def _verified_bytes(ckpt: str, name: str, entry: dict) -> bytes:
    path = runfs.join(ckpt, name)
    try:
        data = runfs.read_bytes(path)
    except FileNotFoundError:
        raise BadInput(f"checkpoint {path}: missing (listed in {MANIFEST})") from None
    except OSError as exc:
        raise BadInput(f"checkpoint {path}: unreadable ({one_line(exc)})") from None
    if len(data) != entry["size"]:
        raise BadInput(f"checkpoint {path}: size {len(data)} bytes, manifest says {entry['size']} "
                       f"(truncated or changed)")
    if _sha256(data) != entry["sha256"]:
        raise BadInput(f"checkpoint {path}: SHA-256 mismatch (file changed or corrupt)")
    return data


def read_checkpoint(path_or_run_dir: str) -> tuple[str, dict[str, bytes]]:
    """(checkpoint directory, file name -> contents) of a checkpoint, each file checked against
    the manifest (a run dir means the checkpoint its LATEST names).

    Only files listed in the manifest are read; anything else in the
    directory is ignored.
    """
    ckpt = _resolve(os.fspath(path_or_run_dir))  # a local path or a URI (sparkcnn.runfs)
    files = _manifest(ckpt)
    return ckpt, {f: _verified_bytes(ckpt, f, e) for f, e in sorted(files.items())}
