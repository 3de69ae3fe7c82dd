"""Trackers: sinks beside ``metrics.jsonl`` that send a run to MLflow or TensorBoard.

The engine hands every round and epoch record to one sink (its ``Run``'s records);
:class:`FanOut` passes it to the JSONL file and to each tracker, so nothing in the
training loop knows which trackers exist. A tracker's life::

    start(cfg, run_dir)      the run directory exists; open the MLflow run / event file
    write(record)            one per round (step = round) and per epoch (step = epoch)
    close()                  the records have ended: flush
    finish(summary, run_dir) the outputs are written (model.keras, summary.json);
                             summary None: the run failed (error says how)

Metric names are ``round/<key>`` and ``epoch/<key>`` for every numeric field of a
record (``round/loss``, ``epoch/test_accuracy``, ...). A tracker that fails
while training runs logs a warning and training goes on; its ``start`` fails the run.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import numbers
import os
import secrets
import tempfile
import time

from sparkcnn import runfs
from sparkcnn.errors import BadInput

log = logging.getLogger(__name__)

# MLflow stores that need SQLAlchemy, which mlflow-skinny leaves out
_DATABASES = ("sqlite", "postgresql", "mysql", "mssql")
# fields that say which round or block a record is, not how it went
_ID_KEYS = frozenset({"kind", "round", "epoch", "round_in_epoch", "block", "block_epoch", "block_step",
                      "pid"})


def scalars(record: dict) -> tuple[str, int, dict[str, float]]:
    """``(prefix, step, {name: value})`` for a record: its numeric top-level fields."""
    kind = record.get("kind", "round")
    step = int(record.get(kind, 0))
    values = {f"{kind}/{k}": float(v) for k, v in record.items()
              if k not in _ID_KEYS and isinstance(v, numbers.Real) and not isinstance(v, bool)}
    return kind, step, values


def flat_params(cfg) -> dict[str, str]:
    """The resolved configuration as ``section.key`` → text (MLflow params are strings)."""
    return {f"{sec}.{k}": str(v) for sec, fields in cfg.to_dict().items() for k, v in fields.items()}


class Tracker:
    """Base of the trackers: every hook is optional; failures after ``start`` only warn."""

    name = "tracker"

    def start(self, cfg, run_dir: str) -> None:
        pass

    def write(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass

    def finish(self, summary: dict | None, run_dir: str, error: BaseException | None = None) -> None:
        pass

    def _warn(self, what: str, exc: BaseException) -> None:
        # once per tracker and kind of call: a server that is down must not flood the log
        seen = self.__dict__.setdefault("_warned", set())
        if what not in seen:
            seen.add(what)
            log.warning("%s: %s failed (%s); training goes on without it", self.name, what, exc,
                        exc_info=log.isEnabledFor(logging.DEBUG))


class FanOut:
    """One sink for the engine: each record goes to every sink in order (the JSONL file first)."""

    def __init__(self, *sinks):
        self.sinks = list(sinks)

    def start(self, cfg, run_dir: str) -> "FanOut":
        try:
            for s in self.sinks:
                if hasattr(s, "start"):
                    s.start(cfg, run_dir)
        except BaseException as e:  # nothing stays open when a tracker cannot start
            self.finish(None, run_dir, e)
            with contextlib.suppress(Exception):
                self.close()
            raise
        return self

    def write(self, record: dict) -> None:
        for s in self.sinks:
            s.write(record)

    def write_encoded(self, record: dict, line: str) -> None:
        """``record`` and its line as a server process encoded it: the JSONL file writes the line,
        a tracker takes the record (``ps.servers`` > 1)."""
        for s in self.sinks:
            if hasattr(s, "write_encoded"):
                s.write_encoded(record, line)
            else:
                s.write(record)

    def flush(self) -> None:
        """Make the records written so far durable, in the sinks that buffer (before a checkpoint)."""
        for s in self.sinks:
            if hasattr(s, "flush"):
                s.flush()

    def close(self) -> None:
        first = None
        for s in self.sinks:  # every sink is closed even when one fails
            try:
                s.close()
            except Exception as e:
                first = first or e
        if first is not None:
            raise first

    def finish(self, summary: dict | None, run_dir: str, error: BaseException | None = None) -> None:
        for s in self.sinks:
            if hasattr(s, "finish"):
                try:
                    s.finish(summary, run_dir, error)
                except Exception as e:  # a finished run is kept whatever its tracker says
                    log.warning("%s: finish failed: %s", getattr(s, "name", type(s).__name__), e)


class MlflowTracker(Tracker):
    """An MLflow run per training run: params, metrics, and the outputs as artifacts.

    The server is MLflow's own choice: ``MLFLOW_TRACKING_URI`` (``http://host:5000``, or a
    folder ``file:./mlruns``, which MLflow 3 opens only with ``MLFLOW_ALLOW_FILE_STORE=true``),
    else MLflow's default (a sqlite file, which needs the full mlflow package). A resumed run
    (same run id) continues its MLflow run. Inside an active MLflow run (a notebook's
    ``mlflow.start_run()``) the training run is logged as its child.
    """

    name = "tracking.mlflow"
    ARTIFACTS = ("model.keras", "summary.json", "config.yaml", "report.md", "report.png")
    FLUSH_METRICS = 900  # metrics per log_batch call (MLflow takes up to 1000)
    FLUSH_S = 10.0       # longest time a round metric waits before it is sent

    def __init__(self, experiment: str):
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise BadInput("tracking.mlflow=true needs MLflow: pip install 'sparkcnn[mlflow]'") from None
        _check_store()
        self.experiment = experiment
        self._client_cls = MlflowClient
        self.client = self.run_id = None
        self._pending: list = []
        self._flushed_at = time.monotonic()

    def start(self, cfg, run_dir: str) -> None:
        import mlflow
        from mlflow.entities import Param, RunStatus

        client = self.client = self._client_cls()
        exp = client.get_experiment_by_name(self.experiment)
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(self.experiment)
        run_id = runfs.name(run_dir)
        found = [] if "'" in run_id else client.search_runs(
            [exp_id], filter_string=f"tags.`sparkcnn.run_id` = '{run_id}'", max_results=1)
        params = flat_params(cfg)
        if found:  # a resumed run: continue its MLflow run, params already there stay
            run = found[0]
            self.run_id = run.info.run_id
            client.update_run(self.run_id, status=RunStatus.to_string(RunStatus.RUNNING))
            changed = sorted(k for k, v in params.items() if k in run.data.params and run.data.params[k] != v)
            if changed:
                log.warning("%s: resumed with changed params %s; MLflow keeps the first values",
                            self.name, ", ".join(changed))
            params = {k: v for k, v in params.items() if k not in run.data.params}
        else:
            tags = {"sparkcnn.run_id": run_id,
                    "sparkcnn.run_dir": run_dir if runfs.is_uri(run_dir) else os.path.abspath(run_dir)}
            parent = mlflow.active_run()
            if parent is not None:
                tags["mlflow.parentRunId"] = parent.info.run_id
            self.run_id = client.create_run(exp_id, run_name=run_id, tags=tags).info.run_id
        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes up to 100 params per call
            client.log_batch(self.run_id, params=items[i:i + 100])
        log.info("%s: run %s in experiment %r at %s", self.name, self.run_id, self.experiment,
                 mlflow.get_tracking_uri())

    def write(self, record: dict) -> None:
        from mlflow.entities import Metric

        kind, step, values = scalars(record)
        ms = int(time.time() * 1000)
        self._pending.extend(Metric(k, v, ms, step) for k, v in values.items())
        if (kind == "epoch" or len(self._pending) >= self.FLUSH_METRICS
                or time.monotonic() - self._flushed_at >= self.FLUSH_S):
            self._flush()

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        self._flushed_at = time.monotonic()
        try:
            for i in range(0, len(pending), self.FLUSH_METRICS):
                self.client.log_batch(self.run_id, metrics=pending[i:i + self.FLUSH_METRICS])
        except Exception as e:
            self._warn("log_batch", e)

    def close(self) -> None:
        if self.client is not None and self._pending:
            self._flush()

    def finish(self, summary: dict | None, run_dir: str, error: BaseException | None = None) -> None:
        from mlflow.entities import RunStatus

        if self.client is None:
            return
        self.close()
        status = ("FINISHED" if summary is not None
                  else "KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED")
        try:
            for name in self.ARTIFACTS if summary is not None else ():
                path = runfs.join(run_dir, name)
                if not runfs.isfile(path):
                    continue
                if not runfs.is_uri(path):
                    self.client.log_artifact(self.run_id, path)
                    continue
                with tempfile.TemporaryDirectory(prefix="sparkcnn-artifact-") as tmp:  # MLflow uploads files
                    local = os.path.join(tmp, name)
                    with open(local, "wb") as fh:
                        fh.write(runfs.read_bytes(path))
                    self.client.log_artifact(self.run_id, local)
        finally:  # the run ends even when an upload fails
            self.client.set_terminated(self.run_id, status=RunStatus.to_string(getattr(RunStatus, status)))
            self.client = None


def _check_store() -> None:
    """BadInput, before the run writes anything, for an MLflow store this client cannot open."""
    import mlflow

    uri = mlflow.get_tracking_uri()  # MLFLOW_TRACKING_URI, else MLflow's default (a sqlite file)
    scheme = uri.split(":", 1)[0].split("+", 1)[0] if "://" in uri or uri.startswith("file:") else "file"
    if scheme in _DATABASES and importlib.util.find_spec("sqlalchemy") is None:
        raise BadInput(f"tracking.mlflow=true: the MLflow store {uri!r} needs the full mlflow package; "
                       "set MLFLOW_TRACKING_URI to a server (http://host:5000) or install mlflow")
    try:
        from mlflow.environment_variables import MLFLOW_ALLOW_FILE_STORE
    except ImportError:  # an MLflow that still takes file stores as they are
        return
    if scheme == "file" and not MLFLOW_ALLOW_FILE_STORE.get():
        raise BadInput(f"tracking.mlflow=true: MLflow opens the file store {uri!r} only with "
                       "MLFLOW_ALLOW_FILE_STORE=true")


class TensorBoardTracker(Tracker):
    """Scalars in ``<run_dir>/tensorboard`` (``tensorboard --logdir runs``).

    Each record is one event of float32 scalar summaries (the form ``tf.summary.scalar``
    writes), appended to a TFRecord event file: ~0.7 ms a round on the driver, where a
    ``tf.summary`` op per value would cost ~1 ms each, and no tensorboard package is needed.
    """

    name = "tracking.tensorboard"

    def __init__(self):
        self.writer = None
        self._tagged: set[str] = set()  # tags whose first value carried the plugin metadata

    def start(self, cfg, run_dir: str) -> None:
        import socket

        import tensorflow as tf
        from tensorflow.core.framework.tensor_pb2 import TensorProto

        self._tf, self._tensor = tf, TensorProto
        self._float = tf.float32.as_datatype_enum
        self._metadata = tf.compat.v1.SummaryMetadata(
            plugin_data=tf.compat.v1.SummaryMetadata.PluginData(plugin_name="scalars"))
        logdir = os.path.join(run_dir, "tensorboard")
        os.makedirs(logdir, exist_ok=True)
        # a resumed run adds a file beside the first; TensorBoard reads them as one run
        self.path = os.path.join(logdir, f"events.out.tfevents.{time.time():.0f}.{socket.gethostname()}"
                                         f".{os.getpid()}.{secrets.token_hex(2)}")
        self.writer = tf.io.TFRecordWriter(self.path)
        header = tf.compat.v1.Event(wall_time=time.time(), file_version="brain.Event:2")
        self.writer.write(header.SerializeToString())
        self.writer.flush()

    def write(self, record: dict) -> None:
        kind, step, values = scalars(record)
        summary = self._tf.compat.v1.Summary
        try:
            items = []
            for k, v in values.items():
                item = summary.Value(tag=k, tensor=self._tensor(dtype=self._float, float_val=[v]))
                if k not in self._tagged:
                    item.metadata.CopyFrom(self._metadata)
                    self._tagged.add(k)
                items.append(item)
            event = self._tf.compat.v1.Event(wall_time=time.time(), step=step, summary=summary(value=items))
            self.writer.write(event.SerializeToString())
            if kind == "epoch":
                self.writer.flush()
        except Exception as e:
            self._warn("write", e)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def finish(self, summary: dict | None, run_dir: str, error: BaseException | None = None) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def trackers(cfg) -> list[Tracker]:
    """The trackers ``cfg.tracking`` asks for; BadInput if one's package is missing.

    Nothing is opened yet: call before the run creates anything, ``start`` them later.
    """
    out: list[Tracker] = []
    if cfg.tracking.mlflow:
        out.append(MlflowTracker(cfg.tracking.mlflow_experiment))
    if cfg.tracking.tensorboard:
        out.append(TensorBoardTracker())
    return out
