"""Run-directory storage: a local folder, or a prefix on an object store, written by the driver.

The few operations the run directory needs (read, write whole, list, exists,
remove) for two kinds of location:

- a local path: plain POSIX files; a file is written to a temp sibling, fsynced
  and renamed over the target (``os.replace``), so readers see the old file or
  the new one, never part of one;
- a URI (``s3://bucket/prefix``, ``gs://``, ``hdfs://``, ... whatever
  ``pyarrow.fs.FileSystem.from_uri`` resolves, else an ``fsspec`` protocol):
  each file is one object. On S3 and GCS one upload is atomic per object (a
  multipart upload shows nothing until it completes), so an object is written
  with one stream and appears whole or not at all; on other filesystems it is
  written to a temp name and moved into place. Nothing appends: a file that
  grows (``metrics.jsonl``) is rewritten whole.

Credentials and endpoints are the filesystem's own conventions: for S3 the AWS
variables (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
``AWS_REGION``, ``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3``) or the AWS config
files and instance roles. :func:`check` tries them before a run writes
anything: bad credentials or a missing bucket are a one-line :class:`BadInput`
naming the URI. Later failures stay ``OSError`` (a retry may fix them).
Only the driver touches the run directory; executors never do.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import secrets
import threading

from sparkcnn.errors import BadInput

__all__ = ["check", "exists", "files", "is_uri", "isdir", "isfile", "join", "listdir", "makedirs", "name",
           "read_bytes", "read_text", "remove", "replace_dir", "rmtree", "shown", "write_bytes", "write_text"]

# filesystems whose single upload is atomic per object: written in place, no temp object to leave
_ATOMIC_PUT = ("s3", "gcs")
_lock = threading.Lock()
_fsspec_lock = threading.RLock()
_cache: dict[tuple, object] = {}


def is_uri(path: str) -> bool:
    """Whether ``path`` names a filesystem other than the local one (``scheme://...``)."""
    return "://" in str(path)


def join(base: str, *parts: str) -> str:
    return posixpath.join(base, *parts) if is_uri(base) else os.path.join(base, *parts)


def name(path: str) -> str:
    """The last component of a path or URI (a run directory's name is its run id)."""
    if is_uri(path):
        return posixpath.basename(str(path).rstrip("/"))
    return os.path.basename(os.path.normpath(path))


def _env_key() -> tuple:
    # a filesystem is cached per scheme/authority and per the environment it was resolved from
    return tuple((k, v) for k, v in sorted(os.environ.items()) if k.startswith(("AWS_", "GOOGLE_", "AZURE_")))


def _fs(uri: str):
    """``(pyarrow filesystem, path inside it)`` for a URI; the filesystem is made once per
    scheme, authority (bucket, host) and environment."""
    import pyarrow.fs as pafs

    scheme, _, rest = uri.partition("://")
    key = (scheme, rest.split("/", 1)[0], _env_key())
    with _lock:
        fs = _cache.get(key)
    if fs is None:
        try:
            fs, _ = pafs.FileSystem.from_uri(uri)
        except (ValueError, TypeError):  # pyarrow.ArrowInvalid: a scheme pyarrow lacks; try fsspec
            fs = _fsspec(uri, scheme)
        with _lock:
            _cache[key] = fs
    if fs.type_name in _ATOMIC_PUT:
        inner = rest  # bucket/key, as these filesystems name objects
    elif fs.type_name.startswith("py::"):  # fsspec's: its own reading (s3fs: bucket/key; ftp: /path)
        import fsspec.core

        inner = fsspec.core.strip_protocol(uri)
    elif fs.type_name == "local":
        inner = rest.partition("/")[2] and "/" + rest.partition("/")[2]  # file:///x -> /x
    else:  # hdfs, abfs, ...: the filesystem's own reading of the URI
        inner = pafs.FileSystem.from_uri(uri)[1]
    return fs, inner.rstrip("/") or inner


@contextlib.contextmanager
def _opened(uri: str):
    """``_fs(uri)``, held alone while used when fsspec carries it: such a filesystem may have one
    connection for all (ftp://), which two threads (records, checkpoints) must not share at once."""
    fs, inner = _fs(uri)
    with _fsspec_lock if fs.type_name.startswith("py::") else contextlib.nullcontext():
        yield fs, inner


def _fsspec(uri: str, scheme: str):
    import pyarrow.fs as pafs

    try:
        import fsspec.core

        # the URI's host, port and user go to the filesystem (ftp://user:password@host:port/...)
        impl, _ = fsspec.core.url_to_fs(uri)
    except (ImportError, ValueError, TypeError) as e:
        raise BadInput(f"{shown(uri)}: no filesystem for {scheme}:// ({_one_line(e)})") from None
    except OSError as e:  # the filesystem connects when it is made (ftp://): unreachable, refused
        raise BadInput(f"{shown(uri)}: cannot access it ({_one_line(e)})") from None
    return pafs.PyFileSystem(pafs.FSSpecHandler(impl))


def shown(uri: str) -> str:
    """``uri`` as messages show it: a password in it (``user:password@host``) is masked."""
    scheme, sep, rest = str(uri).partition("://")
    authority, slash, tail = rest.partition("/")
    user, at, host = authority.rpartition("@")
    if not (sep and at and ":" in user):
        return str(uri)
    return f"{scheme}://{user.split(':', 1)[0]}:***@{host}{slash}{tail}"


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


# -- checks ----------------------------------------------------------------------------------------

def check(path: str, what: str = "run directory") -> None:
    """BadInput (one line naming ``path``) when ``path``'s store cannot be reached as configured:
    bad credentials, a missing bucket, an unknown scheme. Reads only; a local path passes."""
    if not is_uri(path):
        return
    try:
        with _opened(path) as (fs, inner):
            _reach(fs, inner, path, what)
    except BadInput as e:
        raise BadInput(e.args[0] if e.args[0].startswith(what) else f"{what} {e.args[0]}") from None
    except Exception as e:  # OSError, ValueError, an fsspec protocol's own (ftplib.error_perm)
        hint = "; credentials come from the AWS variables or config" if path.startswith("s3://") else ""
        raise BadInput(f"{what} {shown(path)}: cannot access it ({_one_line(e)}{hint})") from None


def _reach(fs, inner: str, path: str, what: str) -> None:
    bucket = inner.split("/", 1)[0]
    if fs.type_name in _ATOMIC_PUT:  # HeadBucket: fails on bad credentials, NotFound when missing
        import pyarrow.fs as pafs

        if fs.get_file_info(bucket).type == pafs.FileType.NotFound:
            raise BadInput(f"{what} {shown(path)}: bucket {bucket!r} does not exist")
    fs.get_file_info(inner)  # lists the prefix: the read access a resume needs


def makedirs(path: str) -> None:
    """Create a local directory (and parents); an object store has no directories to create."""
    if not is_uri(path):
        os.makedirs(path, exist_ok=True)


# -- reading ---------------------------------------------------------------------------------------

def _info(path: str):
    with _opened(path) as (fs, inner):
        return fs.get_file_info(inner)


def exists(path: str) -> bool:
    if not is_uri(path):
        return os.path.exists(path)
    import pyarrow.fs as pafs

    return _info(path).type != pafs.FileType.NotFound


def isfile(path: str) -> bool:
    if not is_uri(path):
        return os.path.isfile(path)
    import pyarrow.fs as pafs

    return _info(path).type == pafs.FileType.File


def isdir(path: str) -> bool:
    """A local directory, or a prefix that holds at least one object."""
    if not is_uri(path):
        return os.path.isdir(path)
    import pyarrow.fs as pafs

    return _info(path).type == pafs.FileType.Directory


def listdir(path: str) -> list[str]:
    """Names directly under ``path`` (files and sub-directories); [] when it does not exist."""
    if not is_uri(path):
        return os.listdir(path) if os.path.isdir(path) else []
    import pyarrow.fs as pafs

    with _opened(path) as (fs, inner):
        infos = fs.get_file_info(pafs.FileSelector(inner, allow_not_found=True))
    return sorted({posixpath.basename(i.path.rstrip("/")) for i in infos})


def files(path: str) -> list[str]:
    """Every file under ``path``, at any depth, as '/'-separated paths relative to it; [] when missing."""
    if not is_uri(path):
        return sorted(os.path.relpath(os.path.join(d, f), path).replace(os.sep, "/")
                      for d, _, names in os.walk(path) for f in names)
    import pyarrow.fs as pafs

    with _opened(path) as (fs, inner):
        infos = fs.get_file_info(pafs.FileSelector(inner, recursive=True, allow_not_found=True))
    return sorted(posixpath.relpath(i.path, inner) for i in infos if i.type == pafs.FileType.File)


def read_bytes(path: str) -> bytes:
    """The whole file; FileNotFoundError when it is missing, as for a local file."""
    if not is_uri(path):
        with open(path, "rb") as f:
            return f.read()
    import pyarrow.fs as pafs

    with _opened(path) as (fs, inner):
        if fs.get_file_info(inner).type != pafs.FileType.File:
            raise FileNotFoundError(f"{shown(path)}: no such object")
        with fs.open_input_stream(inner) as f:
            return f.read()


def read_text(path: str) -> str:
    return read_bytes(path).decode("utf-8")


# -- writing ---------------------------------------------------------------------------------------

def write_bytes(path: str, data: bytes, *, fsync: bool = True) -> None:
    """Replace ``path`` with ``data`` whole: readers see the old contents or the new, never part."""
    if not is_uri(path):
        tmp = os.path.join(os.path.dirname(path) or ".",
                           f".{os.path.basename(path)}.tmp-{secrets.token_hex(4)}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return
    with _opened(path) as (fs, inner):
        if fs.type_name in _ATOMIC_PUT:
            with fs.open_output_stream(inner) as f:  # shown only once the upload completes
                f.write(data)
            return
        parent, base = posixpath.split(inner)
        tmp = posixpath.join(parent, f".{base}.tmp-{secrets.token_hex(4)}")
        import pyarrow.fs as pafs

        if fs.get_file_info(parent).type == pafs.FileType.NotFound:  # ftp:// refuses an existing one
            fs.create_dir(parent, recursive=True)
        with fs.open_output_stream(tmp) as f:
            f.write(data)
        fs.move(tmp, inner)


def write_text(path: str, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def remove(path: str) -> None:
    """Delete one file; a missing one is no error."""
    if not is_uri(path):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return
    with _opened(path) as (fs, inner):
        try:
            fs.delete_file(inner)
        except FileNotFoundError:
            pass


def rmtree(path: str) -> None:
    """Delete a directory and everything under it; a missing one is no error."""
    if not is_uri(path):
        import shutil

        shutil.rmtree(path, ignore_errors=True)
        return
    with _opened(path) as (fs, inner):
        try:
            fs.delete_dir(inner)
        except FileNotFoundError:
            pass


def replace_dir(src: str, dst: str, *, last: str | None = None) -> None:
    """Put the directory ``src`` in the place of ``dst`` (replacing what ``dst`` held); ``src`` is gone after.

    A local path: two renames (``dst`` aside, ``src`` in), so ``dst`` is the old directory or
    the new one. An object store has no rename of a prefix: ``dst``'s ``last`` file goes first,
    then the rest of ``dst``, then each file of ``src`` is moved over (S3: a copy on the server
    and a delete), ``last`` after all others. A reader that finds ``last`` therefore finds the
    whole new set; one that stops midway finds no ``last``, and what was not moved yet is still
    under ``src``.
    """
    if not is_uri(dst):
        old = None
        if os.path.exists(dst):
            old = f"{dst.rstrip(os.sep)}.old-{secrets.token_hex(4)}"
            os.rename(dst, old)
        os.rename(src, dst)
        if old:
            import shutil

            shutil.rmtree(old) if os.path.isdir(old) else os.remove(old)
        return
    import pyarrow.fs as pafs

    names = sorted(files(src), key=lambda n: n == last)  # stable: ``last`` moves after all others
    if last:
        remove(join(dst, last))
    rmtree(dst)
    for n in names:
        with _opened(join(src, n)) as (fs, inner_src), _opened(join(dst, n)) as (_, inner_dst):
            parent = posixpath.dirname(inner_dst)
            if fs.type_name not in _ATOMIC_PUT and fs.get_file_info(parent).type == pafs.FileType.NotFound:
                fs.create_dir(parent, recursive=True)  # ftp:// and friends move into a directory only
            fs.move(inner_src, inner_dst)
    rmtree(src)
