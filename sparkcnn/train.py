"""Driver-side orchestration of one training run: run dir, model, engine, outputs.

``runs/<run_id>/`` receives ``config.yaml`` (resolved), ``metrics.jsonl`` (a
record per round and per epoch), ``model.keras`` (the final ``W``) and
``summary.json``. The run directory (``run.out_dir``, ``--run-dir``) may be a
local path or an object-store URI such as ``s3://bucket/runs`` (see
:mod:`sparkcnn.runfs`); only this driver writes it.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import tempfile
import time
from functools import partial

import numpy as np

from sparkcnn import config as config_mod
from sparkcnn import runfs, tracking
from sparkcnn.errors import BadInput
from sparkcnn.metrics import JsonlSink, atomic_write_text
from sparkcnn.protocol import TaskSpec

log = logging.getLogger(__name__)


def new_run_id(name: str) -> str:
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def normalization(cfg, train) -> tuple | None:
    """(mean, std) the model normalises by (``data.normalize``), from the training frame ``train``'s
    statistics; None for none; BadInput when the data has none (not a prepared dataset)."""
    from sparkcnn.data.normalize import normalization as choose

    return choose(cfg.data.normalize, train.stats, train.origin, train.shape[2])


def build_spec(cfg, run_id: str, train, test, model) -> TaskSpec:
    """The run's constants for the executors; ``train``/``test``: :class:`~sparkcnn.data.source.Frame`."""
    from sparkcnn.compression.plan import plan

    sizes = tuple(int(np.prod(w.shape)) for w in model.weights)
    c = plan(cfg.compression.method, cfg.compression.value_dtype, cfg.train.steps_per_round)
    return TaskSpec(
        run_id=run_id, num_blocks=cfg.data.num_blocks,
        test_blocks=min(cfg.data.test_blocks, test.num_rows) if test is not None else 0,
        model_name=cfg.model.name, input_shape=tuple(train.shape),
        num_classes=len(train.classes), seed=cfg.run.seed, batch_size=cfg.train.batch_size,
        momentum=cfg.train.momentum, weight_decay=cfg.train.weight_decay, layout=sizes,
        value_dtype=c.value_dtype, method=c.method, dense_below=cfg.compression.dense_below,
        momentum_mode=cfg.compression.momentum, per_step=c.per_step,
        # DGC's local clipping: N blocks' gradients summed keep the single-process norm bound
        clip_norm=cfg.compression.clip_norm / float(np.sqrt(cfg.data.num_blocks)),
        factor_masking=cfg.compression.factor_masking,
        sparse_downlink=cfg.compression.density_down > 0,
        augment=cfg.data.augment, normalize=normalization(cfg, train) or (),
        chaos_fail_p=cfg.chaos.fail_task_probability, chaos_kill_p=cfg.chaos.kill_worker_probability,
        chaos_slow=cfg.chaos.slow_executor, chaos_nan_seq=cfg.chaos.nan_round,
        chaos_hold_every=cfg.chaos.hold_every, chaos_hold_s=cfg.chaos.hold_s,
        deterministic=cfg.run.deterministic)


def flat_weights(model) -> np.ndarray:
    return np.concatenate([np.asarray(w.numpy(), np.float32).ravel() for w in model.weights])


def set_flat_weights(model, flat: np.ndarray) -> None:
    pos = 0
    for w in model.weights:
        n = int(np.prod(w.shape))
        w.assign(flat[pos:pos + n].reshape(w.shape))
        pos += n


def make_backend(cfg, run_id: str, spark=None):
    """The backend a run uses: ``spark`` if given, else the active or launcher's session; a Spark
    Connect session gets :class:`~sparkcnn.backends.connect.ConnectBackend` (the stream only)."""
    from sparkcnn.backends.spark import SparkBackend
    from sparkcnn.backends.gpus import check_session
    from sparkcnn.backends.session import get_or_create_spark, is_connect

    if cfg.engine.master == "inprocess":  # no Spark: every block runs in this process (tests, debugging)
        from sparkcnn.backends.inprocess import LocalBackend

        return LocalBackend(run_id)
    spark = spark if spark is not None else get_or_create_spark(cfg.engine.master,
                                                                app_name=f"sparkcnn {run_id}")
    if is_connect(spark):
        from sparkcnn.backends.connect import ConnectBackend

        if cfg.engine.transport == "jobs":
            raise BadInput("engine.transport=jobs runs an RDD job per exchange, which Spark Connect does not "
                           "offer: use engine.transport=stream, or leave it unset")
        return ConnectBackend(spark, run_id)
    check_session(spark)  # GPU settings: a refused one fails here, before any data work
    # async jobs of one run share a FAIR pool (effective when the session runs the FAIR scheduler)
    return SparkBackend(spark, run_id, pool=f"sparkcnn-{run_id}" if cfg.engine.mode == "async" else None)


def resolve_transport(cfg, backend):
    """``cfg`` with ``engine.transport=auto`` made concrete: the stream on a Spark Connect
    session (the only transport there, said in one log line), else the jobs transport."""
    if cfg.engine.transport != "auto":
        return cfg
    from sparkcnn.backends.connect import ConnectBackend

    if isinstance(backend, ConnectBackend):
        log.info("engine.transport unset: training over Spark Connect on the stream transport")
        return cfg.replace(engine__transport="stream")
    return cfg.replace(engine__transport="jobs")


def resolve_frames(cfg, backend, data=None, test_data=None, local=None):
    """(train, test or None) :class:`~sparkcnn.data.source.Frame` s, checked
    (see :mod:`sparkcnn.data.source`);
    ``local``: frames of :func:`~sparkcnn.data.source.local_prepared`, read through ``backend``'s session
    unless it places a split from its directory (``Backend.places_paths``)."""
    from sparkcnn.data.source import attach, local_prepared, training_frames

    if local is None and data is None and test_data is None:
        local = local_prepared(cfg.data)
    if local is not None:  # read as DataFrames only for a backend that places nothing else
        train, test = local if backend.places_paths else (attach(backend.spark, f) for f in local)
    elif backend.spark is None:
        raise BadInput("engine.master=inprocess trains on a prepared dataset on a local data.path only")
    else:
        train, test = training_frames(backend.spark, cfg.data, data, test_data)
    _check_blocks(cfg, train)
    return train, test


def _check_blocks(cfg, train) -> None:
    if cfg.data.num_blocks > train.num_rows:
        raise BadInput(f"data.num_blocks={cfg.data.num_blocks} exceeds the {train.num_rows} training rows")


def build_engine(cfg, backend, run_id: str, sink=None, progress=None, run_dir: str | None = None,
                 frames=None):
    """Model, task spec, placed blocks and engine for ``cfg`` on ``backend`` (benchmarks and tests
    use it too); ``frames``: (train, test) from :func:`resolve_frames`, else ``cfg.data``'s.

    Placing the training blocks is the run's warm-up (data to the executors, TF import, model
    build, the step traced): its time is ``engine.warmup_s``. The test blocks are placed by the
    first evaluation (``Backend.place_later``), except on the stream transport.
    """
    from sparkcnn.transport.jobs_async import AsyncEngine
    from sparkcnn.transport.jobs_sync import SyncEngine
    from sparkcnn.models import build_model

    cfg = resolve_transport(cfg, backend)
    train_f, test_f = frames if frames is not None else resolve_frames(cfg, backend)
    model = build_model(cfg.model.name, tuple(train_f.shape), len(train_f.classes), cfg.run.seed,
                        normalization(cfg, train_f))
    spec = build_spec(cfg, run_id, train_f, test_f, model)
    t0 = time.perf_counter()
    if cfg.engine.transport == "stream":  # before its barrier placement, which would wait for slots
        from sparkcnn.transport.stream import check_limits

        check_limits(backend, spec.num_blocks, cfg.engine.mode == "sync")
    rows = backend.place("train", train_f, spec.num_blocks, spec, spread=cfg.engine.transport == "stream")
    from sparkcnn.data.source import release

    release(train_f)  # an image folder's decoded rows: the blocks hold them now
    if spec.test_blocks and cfg.engine.transport == "stream":  # its barrier stages hold every slot
        backend.place("test", test_f, spec.test_blocks, spec)
        release(test_f)
    elif spec.test_blocks:  # first read by the first evaluation: placed then, after the first step
        backend.place_later("test", test_f, spec.test_blocks, spec, after=partial(release, test_f))
    if cfg.engine.transport == "stream":
        from sparkcnn.transport.stream import StreamEngine as cls
    else:
        cls = AsyncEngine if cfg.engine.mode == "async" else SyncEngine
    engine = cls(cfg, backend, spec, rows, flat_weights(model), progress=progress, run_dir=run_dir,
                 warmup_started=t0)
    if sink is not None:  # records go to ``sink`` (benchmarks); train() opens the run's own
        engine.server.open_records(sink)
    return engine, model


def _truncate_metrics(path: str, records: int) -> tuple[list, list]:
    """Keep the first ``records`` records (those a checkpoint covers); a resumed run rewrites the rest."""
    from sparkcnn.metrics import read_jsonl

    keep = (read_jsonl(path) if runfs.isfile(path) else [])[:records]
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in keep))
    return [r for r in keep if r["kind"] == "round"], [r for r in keep if r["kind"] == "epoch"]


def _has_checkpoint(run_dir: str) -> bool:
    """Whether ``run_dir`` holds a checkpoint or the remains of one (then loading it names
    what is damaged); False for a run stopped before its first checkpoint was complete."""
    from sparkcnn.checkpoint_format import LATEST, MANIFEST

    root = runfs.join(run_dir, "checkpoints")
    if not runfs.isdir(root):
        return False
    if runfs.exists(runfs.join(root, LATEST)):
        return True
    return any(runfs.exists(runfs.join(root, d, MANIFEST))
               for d in runfs.listdir(root) if not d.startswith((".tmp-", ".old-")))  # crashed-save leftovers


def is_run_dir(run_dir: str) -> bool:
    """Whether ``run_dir`` (a path or URI) holds a run (its config.yaml); BadInput, naming it, when
    its store cannot be reached (bad credentials, missing bucket)."""
    runfs.check(run_dir)
    return runfs.isfile(runfs.join(run_dir, "config.yaml"))


def resume_config(run_dir: str, overrides=()):
    """The configuration a run was started with (its config.yaml), plus overrides."""
    if not is_run_dir(run_dir):
        raise BadInput(f"--resume {run_dir}: not a run directory (no config.yaml)")
    return config_mod.load(runfs.join(run_dir, "config.yaml"), overrides)


def _save_model(model, path: str) -> None:
    """``model.keras`` at ``path``; Keras writes local files only, so a URI gets a local copy
    uploaded whole."""
    if not runfs.is_uri(path):
        model.save(path)
        return
    with tempfile.TemporaryDirectory(prefix="sparkcnn-model-") as tmp:
        local = os.path.join(tmp, "model.keras")
        model.save(local)
        with open(local, "rb") as fh:
            runfs.write_bytes(path, fh.read())


def train(cfg, backend=None, progress=None, run_dir: str | None = None, resume: bool = False,
          data=None, test_data=None, spark=None) -> dict:
    """Run a whole training; returns the summary (also written to summary.json).

    ``data``/``test_data``: what to train and evaluate on (see :mod:`sparkcnn.data.source`;
    default ``cfg.data``); ``spark``: the session to use (default: the active or launcher's).
    ``resume``: continue ``run_dir`` from its latest checkpoint (same run id).
    Bad input raises :class:`BadInput` before anything is written.
    """
    if run_dir is None:
        run_id = new_run_id(cfg.run.name)
        run_dir = runfs.join(cfg.run.out_dir, run_id)
    else:
        run_id = runfs.name(run_dir)
    # bad data, model builder or run dir fail before anything is written; a prepared dataset on a
    # local path is checked before Spark starts, other inputs through the session
    from sparkcnn.data.source import local_prepared
    from sparkcnn.models import build_model

    local = local_prepared(cfg.data) if data is None and test_data is None else None
    if local is not None:
        _check_blocks(cfg, local[0])
        frames = local
    else:
        backend = backend if backend is not None else make_backend(cfg, run_id, spark)
        frames = resolve_frames(cfg, backend, data, test_data)
    build_model(cfg.model.name, tuple(frames[0].shape), len(frames[0].classes), cfg.run.seed,
                normalization(cfg, frames[0]))
    trackers = tracking.trackers(cfg)  # a tracker's missing package fails here, before anything is written
    if runfs.is_uri(run_dir):
        if cfg.tracking.tensorboard:
            raise BadInput(f"tracking.tensorboard=true writes event files to a local run directory, "
                           f"not {run_dir}")
        runfs.check(run_dir)  # bad credentials or a missing bucket: nothing is written
    created = not runfs.isdir(run_dir)
    try:
        runfs.makedirs(run_dir)
    except OSError as e:
        raise BadInput(f"run.out_dir {cfg.run.out_dir!r}: cannot create run directory "
                       f"({e.strerror})") from None
    if backend is None:
        try:
            backend = make_backend(cfg, run_id, spark)
        except BadInput:  # e.g. refused GPU settings: leave no empty run directory behind
            if created and not runfs.is_uri(run_dir):
                os.rmdir(run_dir)
            raise
    cfg = resolve_transport(cfg, backend)
    if local is not None:
        frames = resolve_frames(cfg, backend, local=local)
    metrics_path = runfs.join(run_dir, "metrics.jsonl")
    ckpt = None
    if resume and _has_checkpoint(run_dir):
        from sparkcnn.checkpoint import load_checkpoint

        ckpt = load_checkpoint(run_dir)  # verified: a damaged checkpoint is refused, naming the file
    elif resume:  # stopped before its first checkpoint: the same run id starts over
        log.warning("resume %s: no checkpoint yet; starting again from round 0", run_id)
        _truncate_metrics(metrics_path, 0)
    try:
        engine, model = build_engine(cfg, backend, run_id, progress=progress, run_dir=run_dir, frames=frames)
        start, kept = 0, ((), ())
        if ckpt is not None:
            start = engine.restore(ckpt)
            kept = _truncate_metrics(metrics_path, int(ckpt.state["records"]))
            log.info("resuming %s at round %s", run_id, start)
        else:
            atomic_write_text(runfs.join(run_dir, "config.yaml"), config_mod.dump(cfg))
        sink = tracking.FanOut(JsonlSink(metrics_path), *trackers).start(cfg, run_dir)
        engine.server.open_records(sink, *kept)
        try:
            summary = engine.run(start_round=start)
        except BaseException as e:
            sink.finish(None, run_dir, e)  # trackers mark the run failed
            raise
        finally:
            sink.close()
    except KeyboardInterrupt:
        backend.stop()  # cancel the run's Spark jobs; the last checkpoint stays for --resume
        raise
    finally:
        backend.close()  # unpersist the block placement RDDs
    set_flat_weights(model, engine.W)
    _save_model(model, runfs.join(run_dir, "model.keras"))
    train_f, test_f = frames
    summary.update(run_id=run_id, run_dir=run_dir, warmup_s=engine.warmup_s, params=int(engine.W.size),
                   model=cfg.model.name, num_blocks=cfg.data.num_blocks, mode=cfg.engine.mode,
                   steps_per_round=cfg.train.steps_per_round, data=train_f.origin,
                   train_rows=train_f.num_rows,
                   test_rows=test_f.num_rows if test_f is not None else 0, classes=list(train_f.classes),
                   image_shape=list(train_f.shape), **backend.cluster.session_info())
    atomic_write_text(runfs.join(run_dir, "summary.json"), json.dumps(summary, indent=2))
    try:
        from sparkcnn.report import write_report

        summary["report"] = write_report(run_dir)["report"]
    except Exception:  # a report failing must not lose a finished run
        log.warning("report for %s failed", run_dir, exc_info=True)
    sink.finish(summary, run_dir)  # trackers take the outputs (model.keras, summary.json)
    return summary
