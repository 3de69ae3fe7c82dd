"""Seed-table rows as ``conf/`` files: the settings a row ran and the command that reproduces it.

A row is a config file (``conf/seed/<dataset>_<variant>.yaml``, one per row of the seed table)
plus the ``--set`` overrides a bench puts on top of it (another block count, a shorter run, a
seed). The benches take a row's settings from its file, and every run they record carries
:func:`reproduction`: the file, and the command that trains the same config::

    sparkcnn train --config conf/seed/fmnist_gs_asgd_ms.yaml --set run.seed=43

The Keras reference rows (``*_keras.yaml``) are not Spark runs: their command is
``python bench/keras_fit.py --config ...``, which reads the same sections.

:func:`file_sets` reads named keys of a file as ``section.key=value`` overrides, so that a bench
variant made of a row's parts (the jobs transport with the stream rows' sparsification) takes
them from the file rather than repeating them.
"""

from __future__ import annotations

import os
import shlex

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEED_DIR = "conf/seed"  # the seed tables' row files, relative to the repository
# the settings a bench sets for its own bookkeeping: where a run is written and what it is called
# change nothing it trains, so a command leaves them out
BOOKKEEPING = ("run.out_dir=", "run.name=")
KERAS_FIT = ["python", "bench/keras_fit.py"]
TRAIN = ["sparkcnn", "train"]


def seed_file(dataset: str, variant: str) -> str:
    """The row file of ``variant`` (``sync_dense``, ``asgd``, ``gs_asgd``, ``gs_asgd_ms``,
    ``gs_asgd_samomentum``, ``keras``) in ``dataset``'s seed table (``fmnist``, ``cifar10``),
    relative to the repository."""
    return f"{SEED_DIR}/{dataset}_{variant}.yaml"


def _read(config_file: str) -> dict:
    path = config_file if os.path.isabs(config_file) else os.path.join(ROOT, config_file)
    with open(path, encoding="utf-8") as fh:
        data = yaml.safe_load(fh) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{config_file}: top level must be a mapping of sections")
    return data


def _value(v) -> str:
    """A YAML scalar as ``--set`` parses it back (``yaml.safe_load``) to the same value."""
    return yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()


def file_sets(config_file: str, keys) -> list[str]:
    """``section.key=value`` for each of ``keys`` (``section.key``) as the file gives it, in the
    order asked; a key the file does not give raises ValueError naming the file and the key."""
    data, out = _read(config_file), []
    for key in keys:
        section, name = key.split(".", 1)
        if not isinstance(data.get(section), dict) or name not in data[section]:
            raise ValueError(f"{config_file}: gives no {key}")
        out.append(f"{key}={_value(data[section][name])}")
    return out


def file_value(config_file: str, key: str):
    """``section.key`` as the file gives it, or None."""
    section, name = key.split(".", 1)
    sec = _read(config_file).get(section)
    return sec.get(name) if isinstance(sec, dict) else None


def is_keras(config_file: str) -> bool:
    return os.path.basename(config_file).endswith("_keras.yaml")


def command(config_file: str, sets=()) -> str:
    """The shell command that trains ``config_file`` with ``sets`` on top (bookkeeping ones left out)."""
    argv = [*(KERAS_FIT if is_keras(config_file) else TRAIN), "--config", config_file]
    for s in sets:
        if not s.startswith(BOOKKEEPING):
            argv += ["--set", s]
    return shlex.join(argv)


def reproduction(config_file: str, sets=(), *, data: str | None = None, epochs: int | None = None) -> dict:
    """``{"config_file", "command"}`` of a run of ``config_file`` with ``sets`` on top, on the
    prepared dataset ``data`` (as a result may name it: relative to the repository) for ``epochs``
    epochs; each is a ``--set`` of the command only where it differs from the file's."""
    extra = []
    if data is not None and data != file_value(config_file, "data.path"):
        extra.append(f"data.path={data}")
    if epochs is not None and epochs != file_value(config_file, "train.epochs"):
        extra.append(f"train.epochs={epochs}")
    return {"config_file": config_file, "command": command(config_file, [*extra, *sets])}
