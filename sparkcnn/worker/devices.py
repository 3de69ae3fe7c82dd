"""Executor side: the GPUs a Python worker's TensorFlow runs on are the ones Spark assigned its task.

Spark hands each task its GPU addresses (``TaskContext.resources()["gpu"]``, copied into
:class:`~sparkcnn.protocol.TaskContextInfo` by the engine). TensorFlow reads
``CUDA_VISIBLE_DEVICES`` once, when it first lists its devices, and never again, so the
devices of a Python worker are fixed by the first task that starts its TensorFlow. Every task
calls :func:`bind` before it touches TensorFlow:

- TensorFlow not started yet: ``CUDA_VISIBLE_DEVICES`` becomes the task's addresses (``"0"``,
  ``"0,1"``); a task with no GPU gets ``""`` (the CPU), unless the executor's environment sets
  ``CUDA_VISIBLE_DEVICES`` itself (``spark.executorEnv.CUDA_VISIBLE_DEVICES``), which is kept.
- TensorFlow started: the task must want exactly what it started with. Otherwise the task
  fails with one line naming both (and Spark retries it, in a fresh Python worker, since
  PySpark ends a worker after a task error): a task never trains on a GPU that Spark gave
  another task. A task without a GPU in a process whose TensorFlow lists none runs on the CPU
  either way and passes.

The driver arranges that this never fails (:mod:`sparkcnn.backends.gpus`: Python workers are not
reused where an executor holds several GPU addresses), so the error means a setting the driver
could not see. ``gpus=None`` (no Spark task: the in-process backend) leaves the process as it is.

Imports the standard library only; TensorFlow is looked at, never imported, here.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)

VISIBLE = "CUDA_VISIBLE_DEVICES"
_NOT_YET = object()  # TensorFlow has not started in this process


class DeviceMismatch(RuntimeError):
    """Spark assigned a task other GPUs than its Python worker's TensorFlow already runs on."""


def tf_started() -> bool:
    """Whether this process's TensorFlow has listed its devices (after which it keeps them).

    ``import tensorflow`` alone does not list them (a daemon may import it before forking
    workers); the eager context does, on its first op or device query. Where the context
    cannot be read (another TensorFlow), an imported TensorFlow counts as started."""
    if "tensorflow" not in sys.modules:
        return False
    try:
        from tensorflow.python.eager import context

        ctx = context.context()
        return ctx._context_handle is not None or ctx._physical_devices is not None
    except Exception:  # noqa: BLE001 - cannot tell: never guess that the devices may still change
        return True


def tf_gpu_count() -> int:
    """GPUs this process's TensorFlow lists (call only once it has started)."""
    import tensorflow as tf

    return len(tf.config.list_physical_devices("GPU"))


class Devices:
    """One process's binding of TensorFlow to devices. ``environ``, ``started`` and
    ``gpu_count`` are the process's by default; tests pass their own."""

    def __init__(self, environ=None, started=tf_started, gpu_count=tf_gpu_count):
        self.environ = os.environ if environ is None else environ
        self._started, self._gpu_count = started, gpu_count
        self.own = _NOT_YET             # CUDA_VISIBLE_DEVICES before any task set it (None: unset)
        self.started_with = _NOT_YET    # what TensorFlow read when it started (None: unset = every GPU)

    def bind(self, gpus: tuple | None, task: str = "this task") -> str | None:
        """Point this process's TensorFlow at ``gpus`` (Spark's addresses; ``()`` none: the CPU),
        or check that it already is; returns ``CUDA_VISIBLE_DEVICES``. Raises
        :class:`DeviceMismatch` naming ``task`` when TensorFlow already runs on other devices."""
        if gpus is None:  # not a Spark task: nothing was assigned, nothing changes
            return self.environ.get(VISIBLE)
        if self.own is _NOT_YET:
            self.own = self.environ.get(VISIBLE)
        # no GPU from Spark: the executor's own setting where it has one, else no GPU at all
        want = ",".join(gpus) if gpus else (self.own if self.own is not None else "")
        if self.started_with is _NOT_YET and self._started():
            self.started_with = self.environ.get(VISIBLE)  # nobody changes it after TF started but us, below
        if self.started_with is _NOT_YET:
            if self.environ.get(VISIBLE) != want:
                log.info("pid %d: TensorFlow will run on %s (%s=%r)", os.getpid(),
                         f"GPU {want}" if gpus else "the CPU" if not want else f"the executor's GPUs {want}",
                         VISIBLE, want)
            self.environ[VISIBLE] = want
            return want
        if self.started_with == want or (not gpus and self._gpu_count() == 0):
            return self.started_with
        raise DeviceMismatch(
            f"{task}: Spark assigned GPU {','.join(gpus) or 'none'} but this Python worker "
            f"(pid {os.getpid()}) already runs TensorFlow with {VISIBLE}={self.started_with!r}, "
            f"which cannot change; set spark.python.worker.reuse=false or give each executor one GPU")


_PROCESS = Devices()


def bind(gpus: tuple | None, task: str = "this task") -> str | None:
    """:meth:`Devices.bind` for this process."""
    return _PROCESS.bind(gpus, task)
