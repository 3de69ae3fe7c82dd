"""Audit hook for executors' Python workers: refuse any open of a data file outside Spark's own
directories, so a test can prove that training data reaches the executors through Spark.

Installed by putting this directory on the executors' ``PYTHONPATH`` (see
``tests/cluster_env.py``: ``audit_conf``); Python imports ``sitecustomize`` at start-up, so
the hook is in PySpark's daemon before it forks any worker, and an audit hook cannot be
removed. An open of a data file elsewhere raises :class:`DataOpenRefused` naming the file,
which fails the task, and appends ``<pid> <what> <path>`` to ``SPARKCNN_AUDIT_LOG`` when
that is set, so a refusal that some caller catches still leaves a trace. Each process that
installs the hook logs ``<pid> installed <working directory>`` there first.

Data files: names ending ``.parquet``, ``-idx1-ubyte``/``-idx3-ubyte`` (``.gz``), ``.bin``,
``.jpg``/``.jpeg``/``.png``, and CIFAR-10 batches (``data_batch_*``, ``test_batch``).
Allowed: the worker's working directory at start-up (the executor's work directory, where
``--py-files`` and ``--files`` land), ``SPARK_LOCAL_DIRS`` (the executor's local
directories, where Spark keeps blocks and sparkcnn spills its own) and
``SPARKCNN_AUDIT_ALLOW`` (``os.pathsep``-separated).

Seen: every ``open`` audit event (``open``, ``io.open``, ``os.open``, and through them
numpy, gzip, PIL). Arrow's C++ readers open files without an audit event, so pyarrow's
path-taking readers are wrapped when pyarrow is imported (``pyarrow.memory_map``,
``pyarrow.input_stream``, ``pyarrow.parquet``'s ``ParquetFile``, ``ParquetDataset``,
``read_table``, ``read_metadata``, ``read_schema``, ``pyarrow.dataset.dataset``): any
local path they are given outside the allowed directories is refused, whatever its name.
Not seen: C/C++ code opening files on its own (TensorFlow's ``tf.io``, Spark's JVM).
"""

import functools
import importlib.abc
import os
import re
import sys
import threading

DATA_NAME = re.compile(r"(\.parquet|-idx[13]-ubyte(\.gz)?|\.bin|\.jpe?g|\.png)$|^(data_batch_.*|test_batch)$",
                       re.IGNORECASE)
_START_DIR = os.path.realpath(os.getcwd())
_busy = threading.local()


class DataOpenRefused(RuntimeError):
    """A data file was opened outside Spark's directories (not an OSError: nothing may swallow it)."""


def _allowed_roots() -> list[str]:
    local = os.environ.get("SPARK_LOCAL_DIRS", "").split(",")  # Spark's list separator
    extra = os.environ.get("SPARKCNN_AUDIT_ALLOW", "").split(os.pathsep)
    return [_START_DIR] + [os.path.realpath(p) for p in local + extra if p]


def _inside(path: str) -> bool:
    real = os.path.realpath(path)
    return any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in _allowed_roots())


def _local_path(obj):
    """The local filesystem path ``obj`` names, or None (file objects, descriptors, other schemes)."""
    if isinstance(obj, (str, bytes, os.PathLike)):
        path = os.fsdecode(os.fspath(obj))
        if path.startswith("file://"):
            return path[len("file://"):]
        return None if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]+://", path) else path
    return None


def _refuse(what: str, path: str) -> None:
    log = os.environ.get("SPARKCNN_AUDIT_LOG")
    if log:
        with open(log, "a", encoding="utf-8") as fh:
            fh.write(f"{os.getpid()} {what} {os.path.abspath(path)}\n")
    raise DataOpenRefused(f"audit: {what} {os.path.abspath(path)}: data read outside Spark's own directories "
                          f"(training data must reach the executors through Spark)")


def _check(what: str, obj, any_name: bool = False) -> None:
    if getattr(_busy, "on", False):
        return
    _busy.on = True
    try:
        for item in obj if isinstance(obj, (list, tuple)) else [obj]:
            path = _local_path(item)
            if path and (any_name or DATA_NAME.search(os.path.basename(path))) and not _inside(path):
                _refuse(what, path)
    finally:
        _busy.on = False


def _hook(event: str, args) -> None:
    if event == "open" and args:
        _check("open", args[0])


def _guard(fn, what: str):
    @functools.wraps(fn)
    def guarded(source, *a, **kw):
        _check(what, source, any_name=True)
        return fn(source, *a, **kw)

    return guarded


def _guard_init(cls, what: str) -> None:
    init = cls.__init__

    @functools.wraps(init)
    def guarded(self, source, *a, **kw):
        _check(what, source, any_name=True)
        return init(self, source, *a, **kw)

    cls.__init__ = guarded


def _patch(module) -> None:
    name = module.__name__
    if name == "pyarrow":
        for fn in ("memory_map", "input_stream"):
            setattr(module, fn, _guard(getattr(module, fn), f"pyarrow.{fn}"))
    elif name == "pyarrow.parquet.core":
        for fn in ("read_table", "read_metadata", "read_schema"):
            setattr(module, fn, _guard(getattr(module, fn), f"pyarrow.parquet.{fn}"))
        for cls in ("ParquetFile", "ParquetDataset"):
            _guard_init(getattr(module, cls), f"pyarrow.parquet.{cls}")
    elif name == "pyarrow.dataset":
        module.dataset = _guard(module.dataset, "pyarrow.dataset.dataset")


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Wraps pyarrow's readers right after their module runs, before anything imports them."""

    NAMES = ("pyarrow", "pyarrow.parquet.core", "pyarrow.dataset")

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.NAMES:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                exec_module = spec.loader.exec_module

                def exec_and_patch(module, _exec=exec_module):
                    _exec(module)
                    _patch(module)

                spec.loader.exec_module = exec_and_patch
                return spec
        return None


sys.meta_path.insert(0, _PatchAfterImport())
sys.addaudithook(_hook)
if os.environ.get("SPARKCNN_AUDIT_LOG"):
    with open(os.environ["SPARKCNN_AUDIT_LOG"], "a", encoding="utf-8") as _fh:
        _fh.write(f"{os.getpid()} installed {_START_DIR}\n")
