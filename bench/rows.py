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
from dataclasses import dataclass

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEED_DIR = "conf/seed"  # the seed tables' row files, relative to the repository
# a seed table's rows, each a file conf/seed/<dataset>_<row>.yaml
ROWS = ("keras", "sync_dense", "asgd", "gs_asgd", "gs_asgd_ms", "gs_asgd_samomentum")
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


@dataclass(frozen=True)
class Variant:
    """A bench variant: a row file and the ``--set`` overrides a bench puts on top of it."""

    config: str                 # its row file (conf/seed/), relative to the repository
    sets: tuple[str, ...] = ()  # section.key=value overrides on top of it


@dataclass(frozen=True)
class Parts:
    """The settings a dataset's jobs variants borrow from its stream row files, as overrides."""

    sparse: tuple[str, ...]    # the uplink's sparsification, its warm-up and what travels dense
    bidir: tuple[str, ...]     # the downlink's (model-parameter) sparsification and its warm-up
    per_step: tuple[str, ...]  # what the H = 1 rows add: DGC gradient clipping, no factor masking
    stream: tuple[str, ...]    # the stream rows' transport, mode and H


def parts(dataset: str) -> Parts:
    """``dataset``'s :class:`Parts`, read from its row files (ValueError when one lacks a key)."""
    f = {v: seed_file(dataset, v) for v in ("asgd", "gs_asgd", "gs_asgd_ms")}
    return Parts(
        sparse=tuple(file_sets(f["gs_asgd"], ("compression.method", "compression.density",
                                              "compression.initial_density", "compression.warmup_epochs",
                                              "compression.dense_below"))),
        bidir=tuple(file_sets(f["gs_asgd_ms"], ("compression.density_down",
                                                "compression.initial_density_down"))),
        per_step=tuple(file_sets(f["gs_asgd"], ("compression.clip_norm", "compression.factor_masking"))),
        stream=tuple(file_sets(f["asgd"], ("engine.transport", "engine.mode", "train.steps_per_round"))))


# async jobs: one block per job, jobs sized to ~0.5 s (about 10 steps of fmnist_cnn, as in sync)
ASYNC = ("engine.mode=async", "scheduler.target_job_seconds=0.5")
# N = 8 blocks on local[8]: a run in a process of its own (staleness grows with N)
N8 = ("data.num_blocks=8", "engine.master=local[8]")


def variants(dataset: str) -> tuple[dict[str, Variant], dict[str, Variant]]:
    """(jobs variants, stream variants) of ``dataset``'s seed table, by run name. The seed rows
    are files as they are; the others add overrides to one: the jobs transport with the stream
    rows' sparsification (sync and async), and the last two stream rows at 8 blocks."""
    f = {v: seed_file(dataset, v) for v in ROWS if v != "keras"}
    p, sync = parts(dataset), f["sync_dense"]
    jobs = {"sync-dense": Variant(sync), "sync-sparse": Variant(sync, p.sparse),
            "sync-sparse-bidir": Variant(sync, (*p.sparse, *p.bidir)), "async-dense": Variant(sync, ASYNC),
            "async-sparse": Variant(sync, (*ASYNC, *p.sparse)),
            "async-sparse-bidir": Variant(sync, (*ASYNC, *p.sparse, *p.bidir))}
    stream = {"stream-asgd": Variant(f["asgd"]),
              "stream-gs-asgd": Variant(f["gs_asgd"]),  # uplink sparsification + DGC momentum correction
              "stream-gs-asgd-ms": Variant(f["gs_asgd_ms"]),  # + model-parameter sparsification
              "stream-gs-asgd-samomentum": Variant(f["gs_asgd_samomentum"]),  # sparsification-aware momentum
              "stream-gs-asgd-ms-n8": Variant(f["gs_asgd_ms"], N8),
              "stream-gs-asgd-samomentum-n8": Variant(f["gs_asgd_samomentum"], N8)}
    return jobs, stream
