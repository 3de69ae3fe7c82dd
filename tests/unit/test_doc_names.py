"""Every module, file, class and config key the README, BENCHMARKS.md and docs/ name exists.

Inline code spans (`...`) are read token by token:

- a module path ``sparkcnn.x.y`` (its tail may be a name the module defines: ``sparkcnn.fit``);
- a Python file ``x/y.py`` (at the repository's root or under ``sparkcnn/``; a bare ``y.py``
  anywhere in the repository), a folder ``x/`` (at the root, under ``sparkcnn/`` or under
  ``bench/results/``), any other file under one of the repository's own top folders
  (``conf/fashion_mnist.yaml``), and a results folder or file (``2026-12-04-momentum/``,
  ``archive/accuracy-stream.json``, with ``*`` globs) under ``bench/results/``;
- a config key ``section.field`` whose section is a field of ``sparkcnn.config.Config``
  (``section.*`` names the section alone);
- an identifier starting with a capital letter (``RoundDriver``, ``Config``): a class or a function
  defined somewhere under ``sparkcnn/``; ``Class.name`` also needs ``name`` defined in that class
  or one of its bases.

Fenced code blocks are read for module paths, ``from sparkcnn... import`` names, file paths,
the key after ``--set``, and identifiers of two or more capitalised words (``SparkCNNModel``;
the diagrams' prose is left alone). Figures, placeholders (``<run_id>``), URLs, absolute and
runtime paths are not names. Every bad name is reported with its document and line.
"""

from __future__ import annotations

import ast
import dataclasses
import glob
import os
import re

import pytest

from sparkcnn import config as config_module

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = os.path.join(ROOT, "sparkcnn")
RESULTS = os.path.join(ROOT, "bench", "results")
DOCS = ["README.md", "BENCHMARKS.md"] + sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))

# Capitalised names defined by the libraries the docs talk about, not by sparkcnn.
THIRD_PARTY = {
    "SparkSession",        # pyspark.sql: the session users pass in
    "DataFrame",           # pyspark.sql: what users train on
    "Estimator",           # pyspark.ml: the base of SparkCNNClassifier
    "Transformer",         # pyspark.ml: the base of SparkCNNModel
    "Pipeline",            # pyspark.ml: the README's Pipeline example
    "CrossValidator",      # pyspark.ml.tuning: named as what the Estimator works with
    "MulticlassClassificationEvaluator",  # pyspark.ml.evaluation: the README's example scores with it
    "SparkSubmitOperator",  # Airflow's Spark provider: runs the DAG's job
    "DagBag",              # Airflow: the DAG test loads the DAG through it
    "DoExchange",          # Arrow Flight: the RPC the stream's service speaks
}
# Dotted names that look like a config key but name something else.
NOT_CONFIG = {
    "model.fit",  # Keras's Model.fit, the single-process baseline
}
# Folders named as parts of a run or a dataset, not of the repository.
RUNTIME_DIRS = {
    "test/",  # a prepared dataset's test split (sparkcnn prepare writes <out>/train and <out>/test)
    "train/",  # a prepared dataset's train split, and an image folder's (train/<class>/ images)
}
# Top folders of the repository whose files a doc may name (data/, runs/, dist/ are made by runs).
TRACKED_TOPS = ("bench", "conf", "docker", "docs", "pipelines", "sparkcnn", "tests")
# A dotted token ending in one of these is a file name, not a module or a config key.
EXTENSIONS = {"py", "json", "jsonl", "yaml", "yml", "md", "png", "keras", "txt", "csv", "zip", "whl",
              "toml", "ipynb", "npz", "parquet", "log", "gz", "h5", "conf", "cfg", "sh", "jpg", "cpu", "gpu"}

SPLIT = re.compile(r"[\s,;()\[\]{}\"'`=|!?]+")
IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
CAPITALISED = re.compile(rf"[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*(\.{IDENT})?")
TWO_WORDS = re.compile(r"[A-Z][A-Za-z0-9]*[a-z0-9][A-Z][A-Za-z0-9]*")
RESULT_PATH = re.compile(r"(bench/results/)?(20\d\d-\d\d-\d\d[\w*-]*|archive)(/[\w.*-]+)*/?")
FENCE = re.compile(r"^ {0,3}(```+|~~~+)(.*)$")


# -- what exists ------------------------------------------------------------------------------------

def _modules() -> dict[str, str]:
    """Dotted module name -> its file, for every module and package under sparkcnn/."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(PKG):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for f in filenames:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join(rel)] = os.path.join(dirpath, f)
    return out


MODULES = _modules()
TREES = {name: ast.parse(open(path, encoding="utf-8").read()) for name, path in MODULES.items()}


def _top_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
                if isinstance(t, ast.Name) and t.id == "__all__" and isinstance(node.value, (ast.List, ast.Tuple)):
                    names.update(e.value for e in node.value.elts if isinstance(e, ast.Constant))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


TOP_NAMES = {name: _top_names(tree) for name, tree in TREES.items()}
def _definitions() -> tuple[dict[str, list[tuple[list[str], set[str]]]], set[str]]:
    """(class name -> [(its base names, the names its body and its methods' ``self.x =`` define)],
    every function name), over every class and function under sparkcnn/, nested ones too."""
    classes: dict[str, list[tuple[list[str], set[str]]]] = {}
    functions: set[str] = set()
    for tree in TREES.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.add(node.name)
            if not isinstance(node, ast.ClassDef):
                continue
            body = set()
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    body.add(item.name)
                elif isinstance(item, ast.Assign):
                    body.update(n.id for t in item.targets for n in ast.walk(t) if isinstance(n, ast.Name))
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    body.add(item.target.id)
            body.update(a.attr for a in ast.walk(node) if isinstance(a, ast.Attribute) and isinstance(a.ctx, ast.Store)
                        and isinstance(a.value, ast.Name) and a.value.id == "self")
            bases = [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                     for b in node.bases]
            classes.setdefault(node.name, []).append((bases, body))
    return classes, functions


CLASSES, FUNCTIONS = _definitions()
SECTIONS = {f.name: {g.name for g in dataclasses.fields(f.default_factory())}
            for f in dataclasses.fields(config_module.Config)}


def _aliases() -> set[str]:
    """``section.key`` of any deprecated-alias table config.py keeps (a dict named *ALIAS* or *DEPRECAT*)."""
    out = set()
    for name, value in vars(config_module).items():
        if isinstance(value, dict) and re.search(r"(?i)alias|deprecat", name):
            for k in value:
                if isinstance(k, str) and "." in k:
                    out.add(k)
                elif isinstance(k, tuple) and len(k) == 2:
                    out.add(".".join(map(str, k)))
    return out


ALIASES = _aliases()


def _repo_files() -> set[str]:
    """Base names of the files in the repository's own folders."""
    out = set()
    for top in TRACKED_TOPS:
        for _, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__" and not d.startswith(".")]
            out.update(filenames)
    out.update(f for f in os.listdir(ROOT) if os.path.isfile(os.path.join(ROOT, f)))
    return out


BASENAMES = _repo_files()


# -- the checks -------------------------------------------------------------------------------------

def check_module(token: str) -> str | None:
    parts = token.split(".")
    for i in range(len(parts), 0, -1):
        mod = ".".join(parts[:i])
        if mod in MODULES:
            rest = parts[i:]
            if not rest or rest[0] in TOP_NAMES[mod] or ".".join(parts[:i + 1]) in MODULES:
                return None
            return f"no module {mod}.{rest[0]}, nor a name {rest[0]!r} in {mod}"
    return "no such module"


def _class_has(name: str, attr: str, seen: set[str] | None = None) -> bool:
    seen = seen if seen is not None else set()
    if name in seen:
        return False
    seen.add(name)
    for bases, body in CLASSES.get(name, []):
        if attr in body:
            return True
        for b in bases:
            if b not in CLASSES or _class_has(b, attr, seen):  # a base from elsewhere may define it
                return True
    return False


def check_identifier(token: str) -> str | None:
    name, _, attr = token.partition(".")
    if name in THIRD_PARTY:
        return None
    if name not in CLASSES and name not in FUNCTIONS:
        return "no class or function of that name under sparkcnn/"
    if attr and name in CLASSES and not _class_has(name, attr):
        return f"class {name} defines no {attr!r}"
    return None


def check_config(token: str) -> str | None:
    section, field = token.split(".", 1)
    if field == "*" or token in ALIASES or field in SECTIONS[section]:
        return None
    return f"config section {section!r} has no field {field!r}"


def check_path(token: str) -> str | None:
    path = token.rstrip("/")
    if token.endswith(".py") and "/" not in token:
        return None if token in BASENAMES else "no such file in the repository"
    bases = [ROOT, PKG]
    if RESULT_PATH.fullmatch(token):
        bases = [ROOT, RESULTS]
    elif token.endswith("/") and token in RUNTIME_DIRS:
        return None
    elif token.endswith("/"):
        bases = [ROOT, PKG, RESULTS]
    for base in bases:
        if glob.glob(os.path.join(base, path)):
            return None
    return "no such " + ("folder" if token.endswith("/") else "file")


def tokens(code: str) -> list[tuple[str, bool]]:
    """(token, whether it follows ``--set``) for the words of a piece of code. A flag (``-x``,
    ``-XX:Opt=1``) and a URL are no names; ``a:b`` is two tokens, ``key:`` one."""
    words = [w for w in SPLIT.split(code) if w]
    out = []
    for i, word in enumerate(words):
        if word.startswith("-") or "://" in word:
            continue
        after_set = i > 0 and words[i - 1] == "--set"
        out += [(part, after_set) for part in word.split(":") if part]
    return out


def classify(token: str, fenced: bool, after_set: bool) -> tuple[str, callable] | None:
    """Which check ``token`` needs, or None when it is not a name."""
    token = token.strip(".")
    if not token or token.startswith(("-", "/", "~", "$")) or re.search(r"[<>$@#%&+^]", token):
        return None
    if after_set:
        sec = token.split(".")[0]
        return ("config key", check_config) if sec in SECTIONS and token.count(".") == 1 else None
    last = token.rsplit(".", 1)[-1]
    if "/" in token or (token.endswith(".py") and token.count(".") == 1):
        if "*" in token and not RESULT_PATH.fullmatch(token):
            return None
        folder = not fenced and re.fullmatch(r"[\w.-]+(/[\w.-]+)*/", token)
        if token.endswith(".py") or RESULT_PATH.fullmatch(token) or folder or token.split("/")[0] in TRACKED_TOPS:
            return "path", check_path
        return None
    if re.fullmatch(rf"sparkcnn(\.{IDENT})+", token) and last not in EXTENSIONS:
        return "module", check_module
    if fenced:
        if TWO_WORDS.fullmatch(token.split(".")[0]) and re.fullmatch(rf"{IDENT}(\.{IDENT})?", token):
            return "class", check_identifier
        return None
    m = re.fullmatch(rf"({IDENT})\.({IDENT}|\*)", token)
    if m and m.group(1) in SECTIONS and last not in EXTENSIONS and token not in NOT_CONFIG:
        return "config key", check_config
    if CAPITALISED.fullmatch(token) and last not in EXTENSIONS and token not in ("True", "False", "None"):
        return "class", check_identifier
    return None


def spans(text: str):
    """(line number, code, fenced) for every inline code span and every fenced block's line."""
    lines = text.split("\n")
    prose, fence = [], None
    for i, line in enumerate(lines, 1):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)[0] * 3
            prose.append("")
        elif fence is not None:
            if line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                fence = None
            else:
                yield i, line, True
            prose.append("")
        else:
            prose.append(line)
    body = "\n".join(prose)
    for m in re.finditer(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", body, re.S):
        yield body.count("\n", 0, m.start()) + 1, m.group(2), False


def imported_names(code: str):
    """``sparkcnn.x.Name`` for each name of a ``from sparkcnn.x import Name, ...`` line."""
    m = re.match(r"\s*from\s+(sparkcnn(?:\.\w+)*)\s+import\s+(.+)", code)
    if m:
        for part in m.group(2).strip("() \\").split(","):
            name = part.strip().split(" as ")[0].strip()
            if re.fullmatch(IDENT, name):
                yield f"{m.group(1)}.{name}"


def bad_names(doc: str, root: str = ROOT) -> list[str]:
    """``doc:line: kind `name`: why`` for every bad name of ``doc`` (a path under ``root``)."""
    with open(os.path.join(root, doc), encoding="utf-8") as fh:
        text = fh.read()
    out = []
    for line, code, fenced in spans(text):
        found = tokens(code)
        found += [(t, False) for t in imported_names(code)] if fenced else []
        for token, after_set in found:
            kind = classify(token, fenced, after_set)
            if kind:
                why = kind[1](token.strip("."))
                if why:
                    out.append(f"{doc}:{line}: {kind[0]} `{token.strip('.')}`: {why}")
    return sorted(set(out), key=lambda s: (int(s.split(":")[1]), s))


@pytest.mark.parametrize("doc", DOCS)
def test_every_name_a_doc_gives_exists(doc):
    bad = bad_names(doc)
    assert not bad, f"{len(bad)} name(s) in {doc} that sparkcnn does not have:\n" + "\n".join(bad)


def test_the_checks_tell_good_names_from_bad():
    def names(code: str, fenced: bool = False) -> list[str]:
        return [t for t, after_set in tokens(code) if classify(t, fenced, after_set)]

    good = ["sparkcnn.fit", "sparkcnn.ml.SparkCNNClassifier", "sparkcnn.server.run", "server/run.py",
            "sparkcnn/config.py", "protocol.py", "bench/psload.py", "transport/", "2026-12-06-final-3/",
            "conf/fashion_mnist.yaml", "train.epochs", "chaos.*", "Run", "Config", "SparkSession",
            "SparkCNNModel.from_keras"]
    for token in good:
        kind = classify(token, False, False)
        assert kind and kind[1](token) is None, (token, kind and kind[1](token))
    bad = {"sparkcnn.engine.driver": "no module sparkcnn.engine,", "sparkcnn.nofit": "nor a name 'nofit' in sparkcnn",
           "engine/driver.py": "no such file", "psservice.py": "no such file", "engine/": "no such folder",
           "2026-12-05-throughput-7/": "no such folder", "train.epoch": "has no field 'epoch'",
           "NoSuchEngine": "no class or function", "Run.no_such_method": "defines no",
           "RoundDriver": "no class or function"}
    for token, why in bad.items():
        kind = classify(token, False, False)
        assert kind and why in (kind[1](token) or ""), (token, kind and kind[1](token))
    assert classify("train.epochs", True, False) is None  # in code: a name of the program's, not a key
    assert classify("train.epochs", True, True)[0] == "config key"  # ...unless after --set
    assert names("model.fit model.keras sparkcnn.json s3://bucket/runs runs/<id>/ H W_x True None") == []
    assert names("-XX:TieredStopAtLevel=1 --set train.epochs=5 package.module:function") == ["train.epochs"]
    assert names("Spark task TF", fenced=True) == []
    assert list(imported_names("from sparkcnn.ml import SparkCNNClassifier, SparkCNNModel as M")) == [
        "sparkcnn.ml.SparkCNNClassifier", "sparkcnn.ml.SparkCNNModel"]


def test_bad_names_report_their_line(tmp_path):
    doc = tmp_path / "d.md"
    doc.write_text("# t\n\nSee `engine/driver.py` and\n`RoundDriver`, `train.epochz`.\n\n```\nsparkcnn train "
                   "--set ps.shardz=2\nfrom sparkcnn.engine import RoundDriver\n```\n", encoding="utf-8")
    assert bad_names("d.md", str(tmp_path)) == [
        "d.md:3: path `engine/driver.py`: no such file",
        "d.md:4: class `RoundDriver`: no class or function of that name under sparkcnn/",
        "d.md:4: config key `train.epochz`: config section 'train' has no field 'epochz'",
        "d.md:7: config key `ps.shardz`: config section 'ps' has no field 'shardz'",
        "d.md:8: class `RoundDriver`: no class or function of that name under sparkcnn/",
        "d.md:8: module `sparkcnn.engine.RoundDriver`: no module sparkcnn.engine, nor a name 'engine' in sparkcnn",
        "d.md:8: module `sparkcnn.engine`: no module sparkcnn.engine, nor a name 'engine' in sparkcnn"]
