"""Run configuration: loaded from YAML with overrides, into :class:`~sparkcnn.config_sections.Config`.

A config file is a mapping of sections (``run``, ``data``, ``model``, ...);
``--set section.key=value`` overrides one field (the value is parsed as YAML,
so ``--set train.epochs=5`` gives an int). Unknown keys, wrong types and
out-of-range values raise :class:`BadInput` naming the field, e.g.
"compression.density must be in (0, 1], got 1.5". The sections, their fields
and their rules live in :mod:`sparkcnn.config_sections`.
"""

from __future__ import annotations

import re
import typing

import yaml

from sparkcnn.config_sections import Config, check_field
from sparkcnn.errors import BadInput


# a number in exponent form that YAML 1.1 leaves a string: 1e-4, 5E3, 2.e+9
_EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _coerce(key: str, tp, value):
    """Check ``value`` against the annotated field type; ints widen to floats."""
    if tp is bool:
        check_field(isinstance(value, bool), key, "true or false", value)
    elif tp is int:
        check_field(isinstance(value, int) and not isinstance(value, bool), key, "an integer", value)
    elif tp is float:
        if isinstance(value, str) and _EXPONENT.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads 1e-4 (no dot, or no exponent sign) as a string
        check_field(isinstance(value, (int, float)) and not isinstance(value, bool), key, "a number", value)
        value = float(value)
    elif tp is str:
        check_field(isinstance(value, str), key, "a string", value)
    elif tp is list:
        check_field(isinstance(value, (list, tuple)), key, "a list", value)
        value = list(value)
    return value


def from_dict(data: dict, source: str = "config") -> Config:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise BadInput(f"{source}: top level must be a mapping of sections, got {type(data).__name__}")
    sections = {}
    hints = typing.get_type_hints(Config)
    for name, value in data.items():
        if name not in hints:
            raise BadInput(f"{source}: unknown config key {name!r} (sections: {', '.join(hints)})")
        cls = hints[name]
        if not isinstance(value, dict):
            raise BadInput(f"{source}: {name} must be a mapping, got {value!r}")
        fhints = typing.get_type_hints(cls)
        kwargs = {}
        for k, v in value.items():
            if k not in fhints:
                raise BadInput(f"{source}: unknown config key '{name}.{k}' (known: {', '.join(fhints)})")
            kwargs[k] = _coerce(f"{name}.{k}", fhints[k], v)
        sections[name] = cls(**kwargs)
    return Config(**sections).validate()


def parse_override(text: str) -> tuple[list[str], object]:
    if "=" not in text:
        raise BadInput(f"--set {text!r}: expected section.key=value")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise BadInput(f"--set {text!r}: key must look like section.key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return parts, value


def load(path: str | None = None, overrides: typing.Iterable[str] = ()) -> Config:
    """Load a YAML config file (or the defaults) and apply ``section.key=value`` overrides."""
    data: dict = {}
    source = "--set"
    if path:
        source = path
        from sparkcnn import runfs

        runfs.check(path, "config file")
        try:
            if not runfs.isfile(path):
                raise BadInput(f"config file not found: {path}")
            data = yaml.safe_load(runfs.read_text(path)) or {}
        except OSError as e:
            raise BadInput(f"config file {path}: unreadable ({' '.join(str(e).split())})") from None
        except yaml.YAMLError as e:
            line = getattr(getattr(e, "problem_mark", None), "line", None)
            where = f" line {line + 1}" if line is not None else ""
            raise BadInput(f"{path}{where}: not valid YAML") from None
        if not isinstance(data, dict):
            raise BadInput(f"{path}: top level must be a mapping of sections")
    for text in overrides:
        (sec, key), value = parse_override(text)
        data.setdefault(sec, {})
        if not isinstance(data[sec], dict):
            raise BadInput(f"{source}: {sec} must be a mapping")
        data[sec][key] = value
    return from_dict(data, source)


def file_sets(path: str | None, section: str, key: str) -> bool:
    """Whether the YAML config file at ``path`` gives ``section.key`` itself (a default does not).

    For callers that choose a value when the user chose none; ``path`` was read by
    :func:`load` already, so it exists and parses.
    """
    if not path:
        return False
    with open(path, encoding="utf-8") as fh:
        data = yaml.safe_load(fh) or {}
    return isinstance(data.get(section), dict) and key in data[section]


def dump(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
