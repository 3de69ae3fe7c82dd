"""GPUs placed by Spark: the session's GPU settings, checked before any data work.

Spark gives each executor GPU addresses (``spark.executor.resource.gpu.amount``, found by the
worker's discovery script) and each task a share of them (``spark.task.resource.gpu.amount``).
A task's TensorFlow runs on its addresses alone (:mod:`sparkcnn.worker.devices`), and
TensorFlow fixes its devices when it starts, once per Python worker; Spark, not sparkcnn, picks
which idle Python worker runs a task. So a reused Python worker is safe only where every task
of its executor gets the same addresses:

==================  ====================================  =====================================
per executor        tasks                                 Python worker reuse
==================  ====================================  =====================================
no GPU              train on the CPU (one log line)       as set
1 address           amount 1, or a fraction: up to        kept: every task of the executor has
                    1/amount tasks share it (logged)      the one address
2+ addresses        their own address (amount 1), or      ``spark.python.worker.reuse=false``
                    a shared one (fraction)               filled in where unset (a Python
                                                          worker and a TensorFlow start per
                                                          task); refused in one line where on
==================  ====================================  =====================================

Keeping one Python worker per address instead cannot be done from a task: an executor's idle
Python workers form one queue, and Spark hands the next task to the first of them whatever GPU
its TensorFlow holds. One GPU per executor (``spark.executor.resource.gpu.amount=1``,
``spark.executor.cores`` = the tasks that may share it) keeps workers, TensorFlow and its traced
steps across rounds, which the jobs transport needs (one Spark job per exchange).

Also refused in one line: a task amount above 1 (one model replica trains per task; no
multi-GPU strategy here), and any task amount on a local master (local mode assigns tasks no
resources, so they would wait forever). :mod:`sparkcnn.backends.session` fills in
:func:`reuse_setting` and runs :func:`check` before a session it opens starts;
:func:`check_session` runs on whatever session a run gets, before any data work.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from sparkcnn.errors import BadInput

log = logging.getLogger(__name__)

EXECUTOR_GPUS = "spark.executor.resource.gpu.amount"
TASK_GPUS = "spark.task.resource.gpu.amount"
REUSE = "spark.python.worker.reuse"


@dataclass(frozen=True)
class GpuPlan:
    """The GPU settings of a session, parsed."""

    executor: int    # GPU addresses per executor (0: none asked for)
    task: float      # GPUs per task (0: none); a fraction f lets 1/f tasks share an address
    reuse: bool      # spark.python.worker.reuse (Spark's default: true)
    master: str      # spark.master

    @property
    def local(self) -> bool:
        """A local master: the driver runs the tasks, and Spark assigns them no resources."""
        return self.master.startswith("local") and not self.master.startswith("local-cluster")

    @property
    def shared(self) -> bool:
        return 0 < self.task < 1

    @property
    def several(self) -> bool:
        """Tasks of one executor hold different addresses (then a reused worker may not fit)."""
        return self.executor >= 2 and self.task > 0


def _amount(settings: Mapping[str, str], key: str) -> float:
    text = str(settings.get(key, "0")).strip() or "0"
    try:
        value = float(text)
    except ValueError:
        raise BadInput(f"{key}={text!r} is not a number") from None
    if not value >= 0 or value == float("inf"):
        raise BadInput(f"{key}={text!r} must be a finite amount >= 0")
    return value


def plan(settings: Mapping[str, str], master: str) -> GpuPlan:
    """The :class:`GpuPlan` of Spark ``settings`` (key -> value) on ``master``."""
    executor = _amount(settings, EXECUTOR_GPUS)
    if executor != int(executor):
        raise BadInput(f"{EXECUTOR_GPUS}={settings[EXECUTOR_GPUS]!r} must be a whole number of GPUs")
    reuse = str(settings.get(REUSE, "true")).strip().lower() != "false"
    return GpuPlan(executor=int(executor), task=_amount(settings, TASK_GPUS), reuse=reuse, master=master)


def reuse_setting(settings: Mapping[str, str], master: str) -> str:
    """``spark.python.worker.reuse`` for a session opened with ``settings`` where nobody set it:
    ``false`` where an executor's tasks hold different GPU addresses, else ``true``."""
    return "false" if plan(settings, master).several else "true"


def check(p: GpuPlan) -> str:
    """The one log line for a valid plan; :class:`BadInput` (one line) for a refused one."""
    amount = f"{TASK_GPUS}={p.task:g}"
    if p.task > 1:
        raise BadInput(f"{amount}: sparkcnn trains one model replica per task on one GPU (no multi-GPU "
                       f"strategy); use 1, or a fraction to share a GPU between tasks")
    if p.task and p.local:
        raise BadInput(f"{amount} on master {p.master}: local mode assigns tasks no GPUs and they would "
                       f"wait forever; use a cluster master, or unset it to train on the CPU")
    if p.several and p.reuse:
        raise BadInput(f"{REUSE}=true (Spark's default) with {EXECUTOR_GPUS}={p.executor}: a reused Python "
                       f"worker keeps the GPU its TensorFlow started on, and its next task may be assigned "
                       f"another; set {REUSE}=false, or give each executor one GPU")
    if not p.task:
        if p.executor:
            return (f"GPUs: executors hold {p.executor} GPUs each but {TASK_GPUS} is unset, so Spark assigns "
                    f"tasks none: TensorFlow trains on the CPU")
        return f"GPUs: none assigned ({TASK_GPUS} unset): TensorFlow trains on the CPU"
    workers = ("Python workers not reused, each task starts its own TensorFlow" if p.several
               else "Python workers reused")
    if p.shared:
        return (f"GPUs shared: {amount} with {p.executor} per executor: up to {int(1 / p.task)} tasks train "
                f"on each GPU address at once; {workers}")
    return (f"GPUs: {amount} with {p.executor} per executor: each task trains on its own GPU address; "
            f"{workers}")


def check_session(spark) -> GpuPlan:
    """Check a classic session's GPU settings (:func:`check`) and log its one line."""
    sc = spark.sparkContext
    p = plan(dict(sc.getConf().getAll()), sc.master)
    line = check(p)
    (log.warning if p.executor and not p.task else log.info)("%s", line)
    return p
