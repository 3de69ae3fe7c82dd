"""Benchmarks measure sparkcnn through its public seams only, never by patching it.

A bench that wraps an engine method or reads a private attribute measures code that the next
refactor silently changes; the figures it needs come from the records' typed ``timings``, the
``Run``, the stream's service, the CLI, ``sparkcnn.fit``, ``sparkcnn.testing`` and config keys.
This reads every ``bench/*.py`` (its syntax tree, nothing is run) and fails on:

- ``mock.patch``/``patch.object``/``patch.dict``/``monkeypatch.setattr``/``setattr`` whose
  target is not plainly something else (a module the bench imported from outside sparkcnn, or
  a dotted name as text that does not start with ``sparkcnn``);
- an assignment to an attribute of a name imported from sparkcnn (``Run.accept = ...``);
- a non-dunder ``_name`` attribute read or written on a sparkcnn object: a name imported from
  sparkcnn, a value computed from one, or ``self`` in a class derived from a sparkcnn class.
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench")
PATCHERS = {"patch", "object", "dict", "multiple", "setattr", "setitem", "delattr"}
PATCH_ROOTS = {"mock", "patch", "unittest", "monkeypatch", "mocker"}


def _root(node: ast.AST) -> str | None:
    """The name an attribute chain, call or subscript starts from (``a`` of ``a.b(c).d``)."""
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _targets(node: ast.AST) -> list[str]:
    return [n.id for n in ast.walk(node) if isinstance(n, ast.Name)]


class _Scan:
    """The names of one bench bound to sparkcnn, and the names it imported from elsewhere."""

    def __init__(self, tree: ast.Module):
        self.tree, self.sparkcnn, self.other = tree, set(), set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    name = (a.asname or a.name).split(".")[0]
                    (self.sparkcnn if a.name.split(".")[0] == "sparkcnn" else self.other).add(name)
            elif isinstance(node, ast.ImportFrom):
                ours = (node.module or "").split(".")[0] == "sparkcnn"
                for a in node.names:
                    (self.sparkcnn if ours else self.other).add(a.asname or a.name)
        self.imported = set(self.sparkcnn)
        self.other -= self.sparkcnn
        self._derive()

    def _mentions(self, node: ast.AST | None) -> bool:
        return node is not None and any(isinstance(n, ast.Name) and n.id in self.sparkcnn
                                        for n in ast.walk(node))

    def _derive(self) -> None:
        """Values computed from sparkcnn names are sparkcnn objects too (flow-insensitive)."""
        while True:
            before = len(self.sparkcnn)
            for node in ast.walk(self.tree):
                if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    if self._mentions(node.value):
                        self.sparkcnn.update(n for t in targets for n in _targets(t) if n != "self")
                elif isinstance(node, (ast.For, ast.comprehension)) and self._mentions(node.iter):
                    self.sparkcnn.update(_targets(node.target))
                elif isinstance(node, ast.withitem) and node.optional_vars is not None:
                    if self._mentions(node.context_expr):
                        self.sparkcnn.update(_targets(node.optional_vars))
            if len(self.sparkcnn) == before:
                return

    def _derived_classes(self) -> list[ast.ClassDef]:
        return [c for c in ast.walk(self.tree) if isinstance(c, ast.ClassDef)
                and any(self._mentions(b) for b in c.bases)]

    def problems(self) -> list[str]:
        out = []
        ours_self, own = set(), set()  # ``self`` in classes derived from sparkcnn's; what they set
        for c in self._derived_classes():
            for n in ast.walk(c):
                if isinstance(n, ast.Name) and n.id == "self":
                    ours_self.add(id(n))
                elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and _root(n) == "self":
                    own.add(n.attr)
            own.update(n.name for n in c.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
        for node in ast.walk(self.tree):
            where = f"line {getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                patcher = (isinstance(f, ast.Name) and name in ("patch", "setattr")
                           or isinstance(f, ast.Attribute) and name in PATCHERS and _root(f) in PATCH_ROOTS)
                if patcher and node.args and not self._plainly_other(node.args[0]):
                    out.append(f"{where}: {ast.unparse(f)}({ast.unparse(node.args[0])}, ...) patches what "
                               f"may be sparkcnn")
                if (isinstance(f, ast.Name) and f.id in ("getattr", "hasattr") and len(node.args) > 1
                        and self._mentions(node.args[0]) and isinstance(node.args[1], ast.Constant)
                        and _private(str(node.args[1].value))):
                    out.append(f"{where}: {f.id}(..., {node.args[1].value!r}) reads a private attribute")
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Attribute) and _root(t) in self.imported:
                        out.append(f"{where}: assigns {ast.unparse(t)} of a sparkcnn name")
            elif isinstance(node, ast.Attribute) and node.attr in SPARKCNN_PRIVATE:
                base = node.value
                if self._mentions(base) or (isinstance(base, ast.Name) and id(base) in ours_self
                                            and node.attr not in own):
                    out.append(f"{where}: {ast.unparse(node)} is private to sparkcnn")
        return out

    def _plainly_other(self, target: ast.AST) -> bool:
        if isinstance(target, ast.Constant):
            return isinstance(target.value, str) and not target.value.startswith("sparkcnn")
        root = _root(target)
        return root in self.other and not self._mentions(target)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _sparkcnn_privates() -> frozenset[str]:
    """Every private name sparkcnn defines: module-level names, functions, classes, methods and
    attributes it assigns. A ``_x`` read on a value computed from sparkcnn that sparkcnn does not
    define is another library's (pyspark's ``sc._jvm`` on the run's session), not this check's."""
    names = set()
    for folder, _, files in os.walk(os.path.join(ROOT, "sparkcnn")):
        for f in files:
            if not f.endswith(".py"):
                continue
            with open(os.path.join(folder, f), encoding="utf-8") as fh:
                tree = ast.parse(fh.read())
            for n in ast.walk(tree):
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(n.name)
                elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                    names.add(n.attr)
                elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                    names.add(n.id)
    return frozenset(n for n in names if _private(n))


SPARKCNN_PRIVATE = _sparkcnn_privates()


def problems_of(source: str) -> list[str]:
    return _Scan(ast.parse(source)).problems()


BENCHES = sorted(f for f in os.listdir(BENCH) if f.endswith(".py"))


# what a bench may still do, each with its reason: exactly these problems, no others
ALLOWED = {"pushpath.py": ({"assigns PSService.serve_stream of a sparkcnn name"},
                           "it profiles the service's threads, of a base revision too: Flight calls the "
                           "handler on gRPC's own threads, which no Python-level hook reaches (Python "
                           "3.11 has no setprofile for all threads), so the one wrapper installs it")}


@pytest.mark.parametrize("name", BENCHES)
def test_bench_uses_public_seams_only(name):
    with open(os.path.join(BENCH, name), encoding="utf-8") as fh:
        found = problems_of(fh.read())
    allowed, _why = ALLOWED.get(name, (set(), ""))
    found = [f for f in found if f.split(": ", 1)[1] not in allowed]
    assert not found, f"bench/{name}:\n  " + "\n  ".join(found)


@pytest.mark.parametrize("source", [
    "from unittest import mock\nfrom sparkcnn.server.run import Run\nmock.patch.object(Run, 'accept', f)",
    "from unittest import mock\nmock.patch('sparkcnn.server.run.Run.accept', f)",
    "from unittest.mock import patch\nfrom sparkcnn.transport import pushes\n"
    "patch.object(pushes.PushHandler, 'push')",
    "import sparkcnn.server.run as r\nr.Run.accept = f",
    "from sparkcnn.ps_downlink import SparseDownlink\nx = SparseDownlink._select",
    "from sparkcnn.train import build_engine\nengine, _ = build_engine(c, b, 'x')\nengine.server._applied(t)",
    "from sparkcnn.backends.inprocess import LocalBackend\n"
    "class B(LocalBackend):\n    def f(self):\n        return self._slot",
    "from unittest import mock\ndef parts():\n    return []\nfor owner, attr in parts():\n"
    "    mock.patch.object(owner, attr, None)",
    "from sparkcnn import config\nsetattr(config, 'x', 1)",
])
def test_the_check_finds_patches_and_private_reads(source):
    assert problems_of(source)


@pytest.mark.parametrize("source", [
    "import os\nfrom unittest import mock\nmock.patch.dict(os.environ, {'A': '1'})",
    "from sparkcnn.server.records import Timings\nTimings().__class__",
    "from bench import throughput\nthroughput._stream_once(1)",
    "class C:\n    def f(self):\n        self._x = 1\n        return self._x",
    "from sparkcnn.backends.inprocess import LocalBackend\n"
    "class B(LocalBackend):\n    engine = None\n    def f(self):\n        return self.engine",
    "from sparkcnn.train import build_engine\nengine, _ = build_engine(c, b, 'x')\n"
    "engine.backend.spark.sparkContext._jvm",
])
def test_the_check_leaves_public_use_alone(source):
    assert not problems_of(source)
