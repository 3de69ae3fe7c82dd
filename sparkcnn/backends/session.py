"""Spark sessions that respect the launcher.

:func:`get_or_create_spark` returns the active session as it is (a notebook's),
or opens one on what ``spark-submit``, ``PYSPARK_SUBMIT_ARGS`` and
``spark-defaults.conf`` chose, filling in only the settings left unset.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import sys

from sparkcnn.backends import gpus

log = logging.getLogger(__name__)

LOCAL_DRIVER_JAVA_OPTS = "-XX:TieredStopAtLevel=1"

# Settings this module passed to the driver JVM it launched: in the JVM's system
# properties they look like the launcher's, but they are ours.
_launched_with: dict[str, str] = {}

# spark-submit arguments that name a setting without --conf
_SUBMIT_FLAGS = {"--master": "spark.master", "--name": "spark.app.name",
                 "--driver-java-options": "spark.driver.extraJavaOptions"}
_SUBMIT_SWITCHES = {"--verbose", "-v", "--supervise", "--help", "-h", "--version"}  # flags without a value


def get_or_create_spark(master: str = "", app_name: str = "sparkcnn", conf: dict | None = None):
    """The active SparkSession as it is (notebooks), or a new one on what the launcher chose.

    Without an active session the settings that ``spark-submit``,
    ``PYSPARK_SUBMIT_ARGS`` and ``spark-defaults.conf`` gave the driver JVM are
    kept; only unset keys are filled in: ``spark.master`` (``SPARKCNN_MASTER``,
    else ``local[2]``), ``spark.app.name`` (``app_name``), FAIR scheduling, Python worker
    reuse (off where executors hold several GPU addresses, :mod:`sparkcnn.backends.gpus`),
    no console progress bar, and for local masters the workers' interpreter.
    ``master`` (``engine.master``) applies only when set, and then overrides the
    launcher; an active session keeps its master. ``conf``: our callers' explicit
    settings, applied as given. GPU settings that :func:`sparkcnn.backends.gpus.check`
    refuses fail here, before a new session starts.
    """
    from pyspark import SparkConf, SparkContext
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None and is_connect(active):  # a Connect client has no master of its own to check
        return active
    if active is not None:
        held = active.sparkContext.master
        if master and master != held:
            log.warning("engine.master=%s ignored: the active Spark session runs on %s", master, held)
        return active
    conf = dict(conf or {})
    if SparkContext._gateway is None and "PYSPARK_GATEWAY_PORT" not in os.environ:
        # this process starts the driver JVM: settings that act only at its launch go with it
        submit_args = shlex.split(os.environ.get("PYSPARK_SUBMIT_ARGS", ""))
        named = {**_defaults_file(), **_submit_settings(submit_args)}
        launch = {k: str(v) for k, v in conf.items()}
        opts = _driver_java_opts(master or named.get("spark.master") or _default_master(), {**named, **conf})
        if opts:
            launch["spark.driver.extraJavaOptions"] = opts
        SparkContext._ensure_initialized(conf=SparkConf(loadDefaults=False).setAll(list(launch.items())))
        _launched_with.update(launch)
    SparkContext._ensure_initialized()  # attaches to spark-submit's JVM; a no-op once up
    chosen = _launcher_settings()

    settings: dict = {}

    def fill(key, value):
        if key not in chosen:
            settings[key] = value

    if master:
        settings["spark.master"] = master
    else:
        fill("spark.master", _default_master())
    master = settings.get("spark.master") or chosen["spark.master"]
    fill("spark.app.name", app_name)
    # async mode submits jobs from several threads; FAIR shares executors between them
    fill("spark.scheduler.mode", "FAIR")
    # TF import and traced steps stay across rounds in a reused worker, unless its GPU may not
    fill(gpus.REUSE, gpus.reuse_setting({**chosen, **settings, **conf}, master))
    # a console progress bar of our own is printed by the CLI; Spark's would interleave
    fill("spark.ui.showConsoleProgress", "false")
    if master.startswith("local") or "127.0.0.1" in master or "localhost" in master:
        # workers on this machine must run this interpreter (same packages as the driver)
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        fill("spark.pyspark.python", sys.executable)
    opts = _driver_java_opts(master, {**chosen, **conf})
    if opts:
        fill("spark.driver.extraJavaOptions", opts)
    settings.update(conf)
    gpus.check(gpus.plan({**chosen, **settings}, master))  # refused GPU settings: before the session starts
    builder = SparkSession.builder
    for k, v in settings.items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def _default_master() -> str:
    return os.environ.get("SPARKCNN_MASTER") or "local[2]"


def _driver_java_opts(master: str, chosen) -> str:
    """Options for the driver JVM where nobody chose any ('' = leave them alone)."""
    if "PYSPARK_GATEWAY_PORT" in os.environ:
        return ""  # spark-submit started the driver JVM: its options were fixed there
    submitted = _submit_settings(shlex.split(os.environ.get("PYSPARK_SUBMIT_ARGS", "")))
    key = "spark.driver.extraJavaOptions"
    if not master.startswith("local") or key in chosen or key in submitted:
        return ""
    # The one JVM this process starts: C1-only JIT starts it ~25 % faster (Spark SQL's
    # start-up is mostly class loading). Over 40 pipelined H=10 rounds the JVM used
    # 110 ms of CPU per round against 240 ms with C2 compiling beside the workers; only
    # after ~500 jobs does C2 pull ahead on dense results (~5 % less JVM CPU per job).
    return os.environ.get("SPARKCNN_DRIVER_JAVA_OPTS", LOCAL_DRIVER_JAVA_OPTS)


def _launcher_settings() -> dict[str, str]:
    """Settings the launcher chose for the application (the JVM gateway must be up).

    ``SparkConf()`` reads the driver JVM's system properties, where spark-submit's
    arguments, ``PYSPARK_SUBMIT_ARGS`` and ``spark-defaults.conf`` land. Left out:
    what this module passed at the JVM's launch, and the values spark-submit fills
    in by itself when nobody chose (master ``local[*]``; app name ``pyspark-shell``
    or the script's file name; the shell's progress bar) unless the launcher's
    arguments (the JVM's command line) or defaults file name the key.
    """
    from pyspark import SparkConf, SparkContext

    settings = dict(SparkConf().getAll())
    for k, v in _launched_with.items():
        if settings.get(k) == v:
            del settings[k]
    try:
        command = str(SparkContext._jvm.System.getProperty("sun.java.command") or "")
    except Exception:  # noqa: BLE001 - py4j raises several types; without it nothing is named
        command = ""
    named = {**_defaults_file(), **_submit_settings(command.split()[1:])}  # [0]: the main class
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "pyspark-shell"
    fills = {"spark.master": {"local[*]"}, "spark.app.name": {"pyspark-shell", script},
             "spark.ui.showConsoleProgress": {"true"}}
    for k, values in fills.items():
        if settings.get(k) in values and k not in named:
            del settings[k]
    return settings


def _submit_settings(args: list[str]) -> dict[str, str]:
    """The settings named by spark-submit arguments, up to the application (script or shell)."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        flag, eq, value = args[i].partition("=")
        if not flag.startswith("-"):
            break  # the application; its own arguments follow
        if not eq and flag not in _SUBMIT_SWITCHES:
            i += 1
            value = args[i] if i < len(args) else ""
        if flag in _SUBMIT_FLAGS:
            out[_SUBMIT_FLAGS[flag]] = value
        elif flag in ("--conf", "-c"):
            k, _, v = value.partition("=")
            out[k] = v
        elif flag == "--properties-file":
            out.update(_properties(value))
        i += 1
    return out


def _defaults_file() -> dict[str, str]:
    """``spark-defaults.conf`` as spark-submit reads it (``SPARK_CONF_DIR``, else ``SPARK_HOME/conf``)."""
    conf_dir = os.environ.get("SPARK_CONF_DIR")
    if not conf_dir:
        from pyspark.find_spark_home import _find_spark_home

        conf_dir = os.path.join(os.environ.get("SPARK_HOME") or _find_spark_home(), "conf")
    return _properties(os.path.join(conf_dir, "spark-defaults.conf"))


def _properties(path: str) -> dict[str, str]:
    """A Java properties file's ``key value`` / ``key=value`` lines ({} when unreadable)."""
    out = {}
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line and not line.startswith(("#", "!")):
                    k, *v = re.split(r"\s*[=:\s]\s*", line, maxsplit=1)
                    out[k] = v[0] if v else ""
    except OSError:
        return {}
    return out


def is_connect(spark) -> bool:
    """Whether ``spark`` is a Spark Connect session (its client has no SparkContext or RDDs)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")
