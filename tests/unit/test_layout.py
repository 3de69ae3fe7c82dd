"""The package's layout holds: short modules, short lines, and no import cycle.

A module over :data:`MAX_LINES` lines holds two ideas (STYLE.md: one concept per module,
about 100-300 lines); lines over :data:`LINE_LENGTH` characters (pyproject.toml's line-length)
are found by ruff's E501. An import cycle, even one closed by an import inside a
function, means two modules are one concept split in the wrong place: which loads first
then depends on who imports whom, and a function-level import hides that until it runs.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "sparkcnn"
MAX_LINES = 400
LINE_LENGTH = 110  # pyproject.toml's [tool.ruff] line-length


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (a package is its __init__)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _ruff() -> list[str] | None:
    """The command that runs ruff: the module of this interpreter, else one on PATH."""
    probe = subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True)
    if probe.returncode == 0:
        return [sys.executable, "-m", "ruff"]
    exe = shutil.which("ruff")
    return [exe] if exe else None


def test_modules_are_short_and_lines_within_the_limit():
    """Every module under sparkcnn/ has at most 400 lines, and ruff's E501 passes at 110."""
    long_modules = {}
    for path in _modules().values():
        with open(path, "rb") as fh:
            lines = fh.read().count(b"\n")  # what `wc -l` counts
        if lines > MAX_LINES:
            long_modules[str(path.relative_to(REPO))] = lines
    problems = []
    if long_modules:
        problems.append(f"modules over {MAX_LINES} lines (split them by concept): "
                        + ", ".join(f"{p} ({n})" for p, n in sorted(long_modules.items())))
    ruff = _ruff()
    if ruff is not None:
        proc = subprocess.run([*ruff, "check", "--no-cache", "--output-format", "concise", "--select", "E501",
                               "--line-length", str(LINE_LENGTH), "sparkcnn"],
                              cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            problems.append(f"lines over {LINE_LENGTH} characters (ruff E501):\n{proc.stdout}{proc.stderr}")
    assert not problems, "\n".join(problems)
    if ruff is None:
        pytest.skip("ruff is not installed, so line lengths went unchecked (it is in the dev extra: "
                    "pip install -e '.[dev]')")


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute name ``from <...> import`` names in ``module``."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]  # a module's own package is level 1
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, from every import statement of its source
    (at module level, in functions, under ``if TYPE_CHECKING``). ``from pkg import name`` is an
    import of ``pkg.name`` when that is a module, else of ``pkg``; ``import a.b`` is an import of
    the longest of ``a.b``, ``a`` that is one of the package's modules. The parent packages that
    Python initialises on the way are not counted: every module would import its own package."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    for n in range(len(parts), 0, -1):
                        if ".".join(parts[:n]) in modules:
                            edges.add(".".join(parts[:n]))
                            break
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(name, is_package, node)
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    if sub in modules:
                        edges.add(sub)
                    elif target in modules:
                        edges.add(target)
        edges.discard(name)
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module
    (Tarjan's algorithm, then a shortest path back to the start inside the component)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):  # recursion as deep as the longest import chain: a few dozen
        if v not in index:
            visit(v)

    cycles = []
    for component in components:
        start = min(component)
        paths = {start: [start]}
        frontier = [start]
        cycle = None
        while frontier and cycle is None:  # breadth first: the shortest way back to start
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & component):
                    if w == start:
                        cycle = paths[v] + [start]
                        break
                    if w not in paths:
                        paths[w] = paths[v] + [w]
                        nxt.append(w)
                if cycle:
                    break
            frontier = nxt
        cycles.append(cycle)
    return sorted(cycles)


def test_find_cycles_reports_one_cycle_per_component():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"], ["e", "f", "e"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_the_import_graph_has_no_cycle():
    """No module imports, directly or through others, a module that imports it back."""
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)
