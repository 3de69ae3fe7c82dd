"""Driver-side orchestration of one training run: run dir, model, engine, outputs.

``runs/<run_id>/`` receives ``config.yaml`` (resolved), ``metrics.jsonl`` (a
record per round and per epoch), ``model.keras`` (the final ``W``) and
``summary.json``.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time

import numpy as np

from sparkcnn import config as config_mod
from sparkcnn import tracking
from sparkcnn.blockstore import block_range
from sparkcnn.data.parquet_io import read_meta
from sparkcnn.errors import BadInput
from sparkcnn.metrics import JsonlSink, atomic_write_text
from sparkcnn.protocol import TaskSpec

log = logging.getLogger(__name__)


def dataset_meta(path: str):
    """Metadata of the prepared train and test splits; BadInput naming the path if absent."""
    train_dir, test_dir = os.path.join(path, "train"), os.path.join(path, "test")
    for d in (train_dir, test_dir):
        if not os.path.isdir(d):
            raise BadInput(f"data.path {path!r}: no prepared split at {d} (run 'sparkcnn prepare' first)")
    train, test = read_meta(train_dir), read_meta(test_dir)
    if (train.height, train.width, train.channels) != (test.height, test.width, test.channels):
        raise BadInput(f"data.path {path!r}: train and test image shapes differ")
    if train.num_rows == 0:
        raise BadInput(f"data.path {path!r}: the train split is empty")
    return train_dir, test_dir, train, test


def new_run_id(name: str) -> str:
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def build_spec(cfg, run_id: str, train_dir: str, test_dir: str, train_meta, model) -> TaskSpec:
    sizes = tuple(int(np.prod(w.shape)) for w in model.weights)
    return TaskSpec(
        run_id=run_id, train_dir=os.path.abspath(train_dir), test_dir=os.path.abspath(test_dir),
        num_blocks=cfg.data.num_blocks, test_blocks=cfg.data.test_blocks, model_name=cfg.model.name,
        input_shape=(train_meta.height, train_meta.width, train_meta.channels),
        num_classes=len(train_meta.classes), seed=cfg.run.seed, batch_size=cfg.train.batch_size,
        momentum=cfg.train.momentum, weight_decay=cfg.train.weight_decay, layout=sizes,
        value_dtype="float32" if cfg.compression.method == "none" else cfg.compression.value_dtype,
        method=cfg.compression.method, dense_below=cfg.compression.dense_below,
        momentum_mode=cfg.compression.momentum,
        per_step=cfg.compression.method != "none" and cfg.train.steps_per_round == 1,
        sparse_downlink=cfg.compression.density_down > 0,
        chaos_fail_p=cfg.chaos.fail_task_probability, chaos_kill_p=cfg.chaos.kill_worker_probability,
        chaos_slow=cfg.chaos.slow_executor, chaos_nan_seq=cfg.chaos.nan_round,
        deterministic=cfg.run.deterministic)


def flat_weights(model) -> np.ndarray:
    return np.concatenate([np.asarray(w.numpy(), np.float32).ravel() for w in model.weights])


def set_flat_weights(model, flat: np.ndarray) -> None:
    pos = 0
    for w in model.weights:
        n = int(np.prod(w.shape))
        w.assign(flat[pos:pos + n].reshape(w.shape))
        pos += n


def make_backend(cfg, run_id: str):
    from sparkcnn.engine.backend import SparkBackend
    from sparkcnn.engine.session import get_or_create_spark

    if cfg.engine.master == "inprocess":  # no Spark: every block runs in this process (tests, debugging)
        from sparkcnn.engine.backend import LocalBackend

        return LocalBackend(run_id)
    spark = get_or_create_spark(cfg.engine.master, app_name=f"sparkcnn {run_id}")
    # async jobs of one run share a FAIR pool (effective when the session runs the FAIR scheduler)
    return SparkBackend(spark, run_id, pool=f"sparkcnn-{run_id}" if cfg.engine.mode == "async" else None)


def warm_up(backend, spec: TaskSpec) -> float:
    """Load every block into the workers and build their models (TF import, tracing) once."""
    from sparkcnn.engine.tasks import load_task

    t0 = time.perf_counter()
    # each block is loaded where it lives: its home executor (see SparkBackend._markers)
    backend.map_blocks(load_task(spec, "train"), list(range(spec.num_blocks)),
                       f"sparkcnn {spec.run_id} load blocks", universe=spec.num_blocks)
    backend.map_blocks(load_task(spec, "test"), list(range(spec.test_blocks)),
                       f"sparkcnn {spec.run_id} load test blocks", universe=spec.test_blocks)
    return time.perf_counter() - t0


def block_sizes(num_rows: int, num_blocks: int) -> dict[int, int]:
    """Rows per block: block k holds rows [k·n/N, (k+1)·n/N)."""
    out = {}
    for k in range(num_blocks):
        lo, hi = block_range(num_rows, num_blocks, k)
        out[k] = hi - lo
    return out


def build_engine(cfg, backend, run_id: str, sink=None, progress=None, run_dir: str | None = None):
    """Model, task spec and engine for ``cfg`` on ``backend`` (benchmarks and tests use it too)."""
    from sparkcnn.engine.asynchronous import AsyncEngine
    from sparkcnn.engine.sync import SyncEngine
    from sparkcnn.models import build_model

    train_dir, test_dir, meta, _ = dataset_meta(cfg.data.path)
    if cfg.data.num_blocks > meta.num_rows:
        raise BadInput(f"data.num_blocks={cfg.data.num_blocks} exceeds the {meta.num_rows} training rows")
    model = build_model(cfg.model.name, (meta.height, meta.width, meta.channels), len(meta.classes), cfg.run.seed)
    spec = build_spec(cfg, run_id, train_dir, test_dir, meta, model)
    cls = AsyncEngine if cfg.engine.mode == "async" else SyncEngine
    engine = cls(cfg, backend, spec, block_sizes(meta.num_rows, cfg.data.num_blocks),
                        flat_weights(model), sink=sink, progress=progress, run_dir=run_dir)
    return engine, model


def _truncate_metrics(path: str, records: int) -> tuple[list, list]:
    """Keep the first ``records`` records (those a checkpoint covers); a resumed run rewrites the rest."""
    from sparkcnn.metrics import read_jsonl

    keep = (read_jsonl(path) if os.path.isfile(path) else [])[:records]
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in keep))
    return [r for r in keep if r["kind"] == "round"], [r for r in keep if r["kind"] == "epoch"]


def _has_checkpoint(run_dir: str) -> bool:
    """Whether ``run_dir`` holds a checkpoint or the remains of one (then loading it names
    what is damaged); False for a run stopped before its first checkpoint was complete."""
    from sparkcnn.checkpoint import LATEST, MANIFEST

    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return False
    if os.path.exists(os.path.join(root, LATEST)):
        return True
    return any(os.path.exists(os.path.join(root, d, MANIFEST))
               for d in os.listdir(root) if not d.startswith((".tmp-", ".old-")))  # crashed-save leftovers


def resume_config(run_dir: str, overrides=()):
    """The configuration a run was started with (its config.yaml), plus overrides."""
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        raise BadInput(f"--resume {run_dir}: not a run directory (no config.yaml)")
    return config_mod.load(path, overrides)


def train(cfg, backend=None, progress=None, run_dir: str | None = None, resume: bool = False) -> dict:
    """Run a whole training; returns the summary (also written to summary.json).

    ``resume``: continue ``run_dir`` from its latest checkpoint (same run id).
    """
    _, _, meta, _ = dataset_meta(cfg.data.path)  # fail on bad data before creating anything
    if cfg.data.num_blocks > meta.num_rows:
        raise BadInput(f"data.num_blocks={cfg.data.num_blocks} exceeds the {meta.num_rows} training rows")
    if run_dir is None:
        run_id = new_run_id(cfg.run.name)
        run_dir = os.path.join(cfg.run.out_dir, run_id)
    else:
        run_id = os.path.basename(os.path.normpath(run_dir))
    # the model builder is validated before anything is created or Spark starts
    from sparkcnn.models import build_model

    build_model(cfg.model.name, (meta.height, meta.width, meta.channels), len(meta.classes), cfg.run.seed)
    trackers = tracking.trackers(cfg)  # a tracker's missing package fails here, before anything is written
    try:
        os.makedirs(run_dir, exist_ok=True)
    except OSError as e:
        raise BadInput(f"run.out_dir {cfg.run.out_dir!r}: cannot create run directory ({e.strerror})") from None
    if backend is None:
        backend = make_backend(cfg, run_id)
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    ckpt = None
    if resume and _has_checkpoint(run_dir):
        from sparkcnn.checkpoint import load_checkpoint

        ckpt = load_checkpoint(run_dir)  # verified: a damaged checkpoint is refused, naming the file
    elif resume:  # stopped before its first checkpoint: the same run id starts over
        log.warning("resume %s: no checkpoint yet; starting again from round 0", run_id)
        _truncate_metrics(metrics_path, 0)
    engine, model = build_engine(cfg, backend, run_id, progress=progress, run_dir=run_dir)
    start = 0
    if ckpt is not None:
        start = engine.restore(ckpt)
        engine.driver.history, engine.driver.epoch_history = _truncate_metrics(
            metrics_path, int(ckpt.state["records"]))
        log.info("resuming %s at round %s", run_id, start)
    else:
        atomic_write_text(os.path.join(run_dir, "config.yaml"), config_mod.dump(cfg))
    sink = engine.driver.sink = tracking.FanOut(JsonlSink(metrics_path), *trackers).start(cfg, run_dir)
    try:
        warm_s = warm_up(backend, engine.spec)
        summary = engine.run(start_round=start)
    except BaseException as e:
        sink.finish(None, run_dir, e)  # trackers mark the run failed
        raise
    finally:
        sink.close()
        backend.close()  # unpersist the block placement RDDs
    set_flat_weights(model, engine.W)
    model.save(os.path.join(run_dir, "model.keras"))
    summary.update(run_id=run_id, run_dir=run_dir, warmup_s=warm_s, params=int(engine.W.size),
                   model=cfg.model.name, num_blocks=cfg.data.num_blocks, mode=cfg.engine.mode,
                   steps_per_round=cfg.train.steps_per_round, **backend.session_info())
    atomic_write_text(os.path.join(run_dir, "summary.json"), json.dumps(summary, indent=2))
    try:
        from sparkcnn.report import write_report

        summary["report"] = write_report(run_dir)["report"]
    except Exception:  # a report failing must not lose a finished run
        log.warning("report for %s failed", run_dir, exc_info=True)
    sink.finish(summary, run_dir)  # trackers take the outputs (model.keras, summary.json)
    return summary
