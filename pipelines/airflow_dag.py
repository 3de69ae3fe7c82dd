"""Airflow DAG ``sparkcnn``: prepare -> train -> evaluate, each one spark-submit.

Every task is a ``SparkSubmitOperator`` (``apache-airflow-providers-apache-spark``)
whose application is ``sparkcnn_task.py`` (beside this file): it runs one
``sparkcnn`` command in the spark-submit driver and records its exit code.

Settings. Each is a DAG param (trigger form, or ``--conf`` of a run) that falls
back to an Airflow Variable; paths must be absolute (or URIs), never relative to
a working directory:

=============  ==========================  =============================================
param          Variable                    meaning
=============  ==========================  =============================================
raw            sparkcnn_raw                raw Fashion-MNIST IDX files (default: the
                                           Debian package's directory)
data           sparkcnn_data               prepared dataset, written by ``prepare``
runs_root      sparkcnn_runs_root          runs go to ``<runs_root>/<dag_id>/<run>``
config         sparkcnn_config             YAML config for ``train`` ('' = defaults)
overrides      (none)                      list of ``section.key=value`` for ``train``
application    sparkcnn_application        the spark-submit application (default: the
                                           ``sparkcnn_task.py`` beside this DAG)
=============  ==========================  =============================================

The Spark master and deploy mode come from the Airflow connection
``spark_default`` (e.g. ``AIRFLOW_CONN_SPARK_DEFAULT='{"conn_type": "spark",
"host": "spark://host:7077"}'``); ``spark-submit`` must be on the worker's PATH.

Retries and resume: ``train`` runs ``sparkcnn train --run-dir <runs_root>/<dag_id>/<run>``,
a directory derived from the DAG run, the same for every try. The first try starts
the run there; a retry finds its ``config.yaml`` and resumes from the latest
checkpoint. Exit codes: 2 (bad input or config) fails the task at once, without
retry (``AirflowFailException``); 1 and 3 (diverged) follow the retry policy. The
code comes from ``<run>.exit/<task>.json``, written by the application, since in
cluster deploy mode spark-submit reports only that the driver failed.

XCom: ``train`` returns the run's ``summary.json``, ``evaluate`` the ``metrics.json``
(accuracy, confusion matrix) it writes to ``<run>/evaluation/`` beside predictions.

``runs_root`` may be an object-store URI (``s3://bucket/runs``): the train driver
writes the run there and a retry on another machine resumes it; the evaluate driver
writes ``<run>/evaluation/`` there too (predictions encoded on the executors, written
by the driver); this worker reads the exit files, the summary and metrics.json from
there through ``sparkcnn.runfs`` (so it needs sparkcnn installed, and the store's
credentials in its environment, e.g. the AWS variables, as the drivers do).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from datetime import timedelta

import pendulum
from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from airflow.sdk import DAG, Param
from airflow.sdk.exceptions import AirflowFailException

DAG_ID = "sparkcnn"
BAD_INPUT = 2  # the CLI's exit code for bad input or config: a retry cannot fix it
HERE = os.path.dirname(os.path.abspath(__file__))
DEBIAN_FASHION_MNIST = "/usr/share/datasets/fashion-mnist"  # Debian package dataset-fashion-mnist


def setting(name: str, default: str = "") -> str:
    """Template: the DAG param ``name``, else the Variable ``sparkcnn_<name>``, else ``default``."""
    return "{{ params.%s or var.value.get('sparkcnn_%s', %r) }}" % (name, name, default)


def path_safe(run_id: str) -> str:
    """A DAG run id as one path component (``manual__2026-01-01T00:00:00+00:00`` has ':' and '+')."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", run_id)


RUN = "{{ run_id | path_safe }}"
RUN_DIR = f"{setting('runs_root')}/{{{{ dag.dag_id }}}}/{RUN}"
EXIT_FILE = f"{setting('runs_root')}/{{{{ dag.dag_id }}}}/{RUN}.exit/{{{{ task.task_id }}}}.json"


def read_json(path: str):
    """A JSON file the application wrote: a local path, or a URI read through ``sparkcnn.runfs``."""
    if "://" in path:
        from sparkcnn import runfs

        return json.loads(runfs.read_text(path))
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def remove(path: str) -> None:
    """Delete a file or object; a missing one is no error."""
    if "://" in path:
        from sparkcnn import runfs

        runfs.remove(path)
        return
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def _exit_code(exit_file: str, error: BaseException) -> int | None:
    """The command's exit code: from the application's exit file, else from spark-submit's message."""
    try:
        return int(read_json(exit_file)["exit_code"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    m = re.search(r"Error code is: (-?\d+)", str(error))  # client mode: spark-submit's own exit code
    return int(m.group(1)) if m else None


class SparkCNNSubmitOperator(SparkSubmitOperator):
    """spark-submit of one ``sparkcnn`` command through ``sparkcnn_task.py``.

    ``command`` is the CLI's argv (templated; an option whose value renders empty is
    dropped); with ``with_overrides`` the run's ``overrides`` param is appended as
    ``--set`` options; ``paths`` (templated) are checked before anything is submitted;
    ``summary_file``, when given, is read after success and returned (XCom).
    """

    template_fields = (*SparkSubmitOperator.template_fields, "command", "paths", "exit_file", "summary_file")
    OPTIONAL = ("config",)  # paths that may be empty

    def __init__(self, *, command: list[str], exit_file: str, paths: dict[str, str], with_overrides: bool = False,
                 summary_file: str | None = None, **kwargs):
        super().__init__(application=setting("application", os.path.join(HERE, "sparkcnn_task.py")), **kwargs)
        self.command = command
        self.paths = paths
        self.exit_file = exit_file
        self.with_overrides = with_overrides
        self.summary_file = summary_file

    def render_template_fields(self, context, jinja_env=None) -> None:
        super().render_template_fields(context, jinja_env)
        argv, rest = [], list(self.command)
        while rest:
            arg = rest.pop(0)
            if arg.startswith("--") and rest and rest[0] == "":
                rest.pop(0)  # e.g. --config '' (no config file: the built-in defaults)
            else:
                argv.append(arg)
        if self.with_overrides:
            overrides = context["params"].get("overrides") or []
            if isinstance(overrides, str):  # one section.key=value per line
                overrides = overrides.split()
            argv += [a for kv in overrides for a in ("--set", str(kv))]
        self.application_args = ["--exit-file", self.exit_file, "--", *argv]

    def _check_paths(self) -> None:
        for name, path in {**self.paths, "application": self.application}.items():
            if not path and name in self.OPTIONAL:
                continue
            if not path or not (os.path.isabs(path) or "://" in path):
                raise AirflowFailException(f"sparkcnn: {name} must be an absolute path or a URI (DAG param "
                                           f"{name!r} or Variable 'sparkcnn_{name}'), got {path!r}")
        if "://" not in self.application and not os.path.isfile(self.application):
            raise AirflowFailException(f"sparkcnn: application {self.application} does not exist")

    def execute(self, context):
        self._check_paths()
        remove(self.exit_file)  # an earlier try's code must not be read as this one's
        try:
            super().execute(context)
        except Exception as e:
            code = _exit_code(self.exit_file, e)
            if code == BAD_INPUT:
                raise AirflowFailException(f"sparkcnn {self.command[0]}: bad input or config (exit 2), "
                                           f"not retried: {e}") from e
            raise
        if self.summary_file:
            return read_json(self.summary_file)
        return None


with DAG(
    dag_id=DAG_ID,
    description="sparkcnn: prepare Fashion-MNIST, train on Spark, evaluate",
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    schedule=None,
    catchup=False,
    max_active_runs=1,
    user_defined_filters={"path_safe": path_safe},
    default_args={"retries": 2, "retry_delay": timedelta(minutes=1)},
    params={
        "raw": Param("", type="string", description="raw IDX files (else Variable sparkcnn_raw)"),
        "data": Param("", type="string", description="prepared dataset (else Variable sparkcnn_data)"),
        "runs_root": Param("", type="string", description="runs root (else Variable sparkcnn_runs_root)"),
        "config": Param("", type="string", description="YAML config (else Variable sparkcnn_config)"),
        "overrides": Param([], type="array", items={"type": "string"},
                           description="section.key=value overrides for train"),
        "application": Param("", type="string",
                             description="spark-submit application (else Variable sparkcnn_application)"),
    },
    tags=["sparkcnn"],
) as dag:
    raw, data = setting("raw", DEBIAN_FASHION_MNIST), setting("data")
    prepare = SparkCNNSubmitOperator(
        task_id="prepare", name="sparkcnn-prepare",
        command=["prepare", "--format", "idx", "--source", raw, "--out", data],
        paths={"raw": raw, "data": data, "runs_root": setting("runs_root")}, exit_file=EXIT_FILE,
    )
    train = SparkCNNSubmitOperator(
        task_id="train", name="sparkcnn-train",
        command=["train", "--no-progress", "--run-dir", RUN_DIR, "--config", setting("config"),
                 "--set", f"data.path={data}"],
        with_overrides=True,
        paths={"data": data, "runs_root": setting("runs_root"), "config": setting("config")}, exit_file=EXIT_FILE,
        summary_file=f"{RUN_DIR}/summary.json",
    )
    evaluate = SparkCNNSubmitOperator(
        task_id="evaluate", name="sparkcnn-evaluate",
        command=["evaluate", "--model", RUN_DIR, "--data", f"{data}/test", "--out", f"{RUN_DIR}/evaluation"],
        paths={"data": data, "runs_root": setting("runs_root")}, exit_file=EXIT_FILE,
        summary_file=f"{RUN_DIR}/evaluation/metrics.json",
    )
    prepare >> train >> evaluate
