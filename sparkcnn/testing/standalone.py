"""A real Spark standalone cluster on loopback, started from pyspark's pip package alone.

The pip package has no ``start-master.sh`` but ships ``sbin/spark-daemon.sh``, which is
enough: one master and ``workers`` workers, each its own JVM bound to 127.0.0.1 (or to the
addresses of a test bed's hosts, :mod:`sparkcnn.testing.testbed`), with PID files, logs and
executor work dirs in one temporary directory. For cluster tests and
benchmarks: fault injection with :meth:`StandaloneCluster.kill_worker`, a slowed executor
with ``per_worker_env={1: {"SPARKCNN_CHAOS_SLOW": "2.0"}}`` (a worker hands its
environment on to the executors it launches), fake GPUs with ``worker_gpus={0: ["0", "1"]}``
(the worker declares them through ``spark.worker.resource.gpu.*`` and a discovery script that
reports those addresses; an application asks for them with ``spark.executor.resource.gpu.amount``
and ``spark.task.resource.gpu.amount``, and Spark assigns them to tasks as it would real ones).

    with StandaloneCluster(workers=2) as cluster:
        spark = session(cluster, "bench")
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

log = logging.getLogger(__name__)

HOST = "127.0.0.1"  # the default address of every daemon, executor and driver (loopback)
MASTER = "org.apache.spark.deploy.master.Master"
WORKER = "org.apache.spark.deploy.worker.Worker"
EXECUTOR = "CoarseGrainedExecutorBackend"
# C1-only JIT and one GC thread: JVM start-up ~25-40% faster on a small busy machine. Used
# for the daemons (idle after start); pass it to executors (spark.executor.extraJavaOptions)
# only where start-up matters more than JVM-side throughput, as in tests.
FAST_START_JAVA_OPTS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def free_ports(n: int, host: str = HOST) -> list[int]:
    """``n`` distinct ports free on ``host`` now (all held open while choosing)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((HOST, port)) == 0


def _processes() -> list[tuple[int, int, str, str]]:
    """(pid, ppid, state, command line) of every process, from ``ps`` (Linux and macOS)."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,ppid=,stat=,args="], capture_output=True,
                         text=True).stdout
    rows = [line.split(None, 3) for line in out.splitlines()]
    return [(int(r[0]), int(r[1]), r[2], r[3] if len(r) > 3 else "") for r in rows if len(r) >= 3]


def _alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie counts as gone (a container's PID 1 may never reap it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return any(p == pid and not st.startswith("Z") for p, _, st, _ in _processes())


def _wait_gone(pids, timeout: float) -> list[int]:
    deadline, left = time.monotonic() + timeout, [p for p in pids if _alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [p for p in left if _alive(p)]
    return left


def _sigkill(pid: int, what: str) -> None:
    # the pid came from a file or a listing: kill it only while it still runs ``what``
    if any(p == pid and what in args for p, _, _, args in _processes()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class StandaloneCluster:
    """Master + ``workers`` workers of ``cores_per_worker`` cores and ``memory`` each, on 127.0.0.1.

    Workers are numbered from 0 (daemon instance ``i + 1``). ``worker_env`` is added to every
    daemon's environment, ``per_worker_env[i]`` to worker ``i``'s only. ``workdir`` (default:
    a fresh temporary directory, removed by :meth:`stop`) holds PID files, logs, work dirs.
    ``host`` is the master's (and a driver's) address; ``worker_hosts[i]`` worker ``i``'s, and
    ``worker_prefix[i]`` a command its daemon runs under, e.g. ``ip netns exec <ns>`` to put
    it on another host (:mod:`sparkcnn.testing.testbed`). ``worker_gpus[i]``: the GPU addresses
    worker ``i`` declares (fake ones: nothing checks that a device exists).
    """

    _SHARED = ("workers", "cores_per_worker", "memory", "workdir", "port", "webui_port",
               "worker_ports", "worker_webui_ports", "host", "worker_hosts", "worker_gpus")

    def __init__(self, workers: int = 2, cores_per_worker: int = 1, memory: str = "2g",
                 worker_env: dict | None = None, per_worker_env: dict[int, dict] | None = None,
                 workdir: str | None = None, daemon_memory: str = "512m", host: str = HOST,
                 worker_hosts: list[str] | None = None, worker_prefix: dict[int, list[str]] | None = None,
                 worker_gpus: dict[int, list[str]] | None = None):
        if workers < 1 or cores_per_worker < 1:
            raise ValueError(f"workers and cores_per_worker must be >= 1, got {workers}, {cores_per_worker}")
        for name, per_worker in (("per_worker_env", per_worker_env), ("worker_gpus", worker_gpus)):
            bad = sorted(set(per_worker or {}) - set(range(workers)))
            if bad:
                raise ValueError(f"{name} names workers {bad}; workers are 0..{workers - 1}")
        self.worker_gpus = {int(i): [str(a) for a in addrs] for i, addrs in (worker_gpus or {}).items()}
        self.host = host
        self.worker_hosts = list(worker_hosts or [host] * workers)
        if len(self.worker_hosts) != workers:
            raise ValueError(f"worker_hosts has {len(self.worker_hosts)} addresses for {workers} workers")
        self.worker_prefix = {int(i): list(p) for i, p in (worker_prefix or {}).items()}
        self.workers, self.cores_per_worker, self.memory = workers, cores_per_worker, memory
        self.worker_env = {k: str(v) for k, v in (worker_env or {}).items()}
        self.per_worker_env = {i: {k: str(v) for k, v in e.items()}
                               for i, e in (per_worker_env or {}).items()}
        self.daemon_memory = daemon_memory  # heap of each master/worker JVM (SPARK_DAEMON_MEMORY)
        self.workdir, self._own_dir = workdir, workdir is None
        import pyspark

        self.spark_home = os.path.dirname(os.path.abspath(pyspark.__file__))
        self.port = self.webui_port = None
        self.worker_ports: list[int] = []
        self.worker_webui_ports: list[int] = []
        self._started = False
        self._launchers: list[subprocess.Popen] = []  # spark-daemon.sh start runs not yet reaped

    def to_json(self) -> str:
        """What another process needs to use this cluster (see :meth:`attach`)."""
        return json.dumps({k: getattr(self, k) for k in self._SHARED})

    @classmethod
    def attach(cls, text: str) -> StandaloneCluster:
        """A handle on a cluster started by another process, e.g. for a driver in a subprocess
        (one SparkContext per process): it opens sessions, lists and kills processes; its
        :meth:`stop` does nothing, the owner stops the cluster."""
        info = json.loads(text)
        handle = cls(info["workers"], info["cores_per_worker"], info["memory"], workdir=info["workdir"])
        for k in cls._SHARED:
            setattr(handle, k, info[k])
        # JSON keys are strings
        handle.worker_gpus = {int(i): addrs for i, addrs in info["worker_gpus"].items()}
        return handle

    @property
    def master_url(self) -> str:
        return f"spark://{self.host}:{self.port}"

    @property
    def ports(self) -> list[int]:
        """Every port the daemons listen on (master RPC and UI, worker RPC and UI)."""
        return [p for p in [self.port, self.webui_port, *self.worker_ports, *self.worker_webui_ports] if p]

    # -- lifecycle ---------------------------------------------------------------------------

    def _daemon(self, action: str, cls: str, instance: int, *args, extra_env: dict | None = None,
                host: str | None = None, prefix: list[str] | None = None):
        env = {k: v for k, v in os.environ.items() if k not in ("SPARK_ENV_LOADED", "PYSPARK_SUBMIT_ARGS")}
        env.update(SPARK_HOME=self.spark_home, SPARK_IDENT_STRING="sparkcnn",
                   SPARK_CONF_DIR=os.path.join(self.workdir, "conf"),  # empty: no site spark-env.sh
                   SPARK_PID_DIR=os.path.join(self.workdir, "pid"),
                   SPARK_LOG_DIR=os.path.join(self.workdir, "logs"),
                   SPARK_WORKER_DIR=os.path.join(self.workdir, "work"), SPARK_LOCAL_IP=host or self.host,
                   SPARK_MASTER_HOST=self.host, SPARK_DAEMON_MEMORY=self.daemon_memory,
                   PYSPARK_PYTHON=sys.executable,
                   SPARK_DAEMON_JAVA_OPTS=FAST_START_JAVA_OPTS,
                   SPARK_MASTER_OPTS="-Dspark.master.rest.enabled=false")  # REST would take fixed port 6066
        env.update(self.worker_env, **(extra_env or {}))
        cmd = [*(prefix or []), "bash", os.path.join(self.spark_home, "sbin", "spark-daemon.sh"), action, cls,
               str(instance), *args]
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def start(self, timeout: float = 60) -> StandaloneCluster:
        """Start master and workers; return once the master lists every worker ALIVE."""
        if self._started:
            return self
        t0 = time.monotonic()
        self.workdir = self.workdir or tempfile.mkdtemp(prefix="sparkcnn-cluster-")
        for sub in ("conf", "pid", "logs", "work"):
            os.makedirs(os.path.join(self.workdir, sub), exist_ok=True)
        ports = free_ports(2 + 2 * self.workers, self.host)  # a worker on its own host has them all free
        self.port, self.webui_port = ports[:2]
        self.worker_ports, self.worker_webui_ports = ports[2::2], ports[3::2]
        self._started = True  # from here on stop() has something to clean up
        try:
            self._launchers = [self._daemon("start", MASTER, 1, "--host", self.host, "--port", str(self.port),
                                            "--webui-port", str(self.webui_port))]
            # a worker that registers before the master is elected leader retries only 5-15 s later
            self._wait(lambda: self.master_state().get("status") == "ALIVE", t0 + timeout, "the master")
            for i in range(self.workers):
                self._launchers.append(self._daemon(
                    "start", WORKER, i + 1, "--host", self.worker_hosts[i],
                    "--port", str(self.worker_ports[i]),
                    "--cores", str(self.cores_per_worker), "--memory", self.memory,
                    "--webui-port", str(self.worker_webui_ports[i]), self.master_url,
                    extra_env={**self.per_worker_env.get(i, {}), **self._gpu_env(i)},
                    host=self.worker_hosts[i],
                    prefix=self.worker_prefix.get(i)))
            self._wait(lambda: self.alive_workers() >= self.workers, t0 + timeout, f"{self.workers} workers")
            self._reap_launchers(max(1.0, t0 + timeout - time.monotonic()))
        except BaseException:
            self.stop()
            raise
        log.info("standalone cluster %s up: %d workers in %.1f s", self.master_url, self.workers,
                 time.monotonic() - t0)
        return self

    def _gpu_env(self, i: int) -> dict:
        """Worker ``i``'s SPARK_WORKER_OPTS declaring its GPUs, with a discovery script in the
        work dir that reports their addresses ({} for a worker without GPUs)."""
        addrs = self.worker_gpus.get(i)
        if not addrs:
            return {}
        script = os.path.join(self.workdir, "conf", f"gpus-{i}.sh")
        with open(script, "w", encoding="utf-8") as f:
            f.write("#!/bin/sh\n# fake GPUs of a test cluster: Spark's resource discovery format\n"
                    f"echo '{json.dumps({'name': 'gpu', 'addresses': addrs})}'\n")
        os.chmod(script, 0o755)
        opts = {**self.worker_env, **self.per_worker_env.get(i, {})}.get("SPARK_WORKER_OPTS", "")
        return {"SPARK_WORKER_OPTS": f"{opts} -Dspark.worker.resource.gpu.amount={len(addrs)} "
                                     f"-Dspark.worker.resource.gpu.discoveryScript={script}".strip()}

    def _reap_launchers(self, timeout: float) -> None:
        # spark-daemon.sh writes the PID file at once, then sleeps ~2.5 s to see the JVM survive
        deadline = time.monotonic() + timeout
        for p in self._launchers:
            try:
                out = p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
                log.debug("spark-daemon.sh: %s", out)
            except subprocess.TimeoutExpired:
                p.kill()
        self._launchers = []

    def _wait(self, ready, deadline: float, what: str) -> None:
        while not ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"standalone cluster: timed out waiting for {what} to be ALIVE\n"
                                   f"{self.log_tail()}")
            time.sleep(0.2)

    def master_state(self) -> dict:
        """The master web UI's JSON (loopback, never through a proxy); {} while unreachable."""
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(f"http://{self.host}:{self.webui_port}/json/", timeout=2) as r:
                return json.load(r)
        except (OSError, ValueError):
            return {}

    def alive_workers(self) -> int:
        return sum(1 for w in self.master_state().get("workers", []) if w.get("state") == "ALIVE")

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of every daemon log, for error messages."""
        out = []
        for path in sorted(glob.glob(os.path.join(self.workdir or "", "logs", "*.out"))):
            with open(path, errors="replace") as f:
                out.append(f"--- {os.path.basename(path)}\n" + "".join(f.readlines()[-lines:]))
        return "\n".join(out) or "(no daemon logs)"

    def stop(self, timeout: float = 20) -> None:
        """Stop workers (with their executors), then the master; make sure every process is gone."""
        if not self._started:
            return
        self._started = False
        self._reap_launchers(30)  # after a failed start: every PID file is written
        executors = [p for ps in self.executor_pids().values() for p in ps]
        stuck = []
        for cls, pids in ((WORKER, self.worker_pids()), (MASTER, {0: self.master_pid()})):
            for i, pid in pids.items():
                if pid is not None:
                    self._daemon("stop", cls, i + 1).communicate(timeout=30)  # SIGTERM via the PID file
                    stuck += self._kill_if_alive([pid], cls, timeout)
        stuck += self._kill_if_alive(executors, EXECUTOR, timeout)
        if stuck:
            raise RuntimeError(f"standalone cluster: processes {stuck} survived SIGKILL")
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        log.info("standalone cluster %s stopped", self.master_url)

    @staticmethod
    def _kill_if_alive(pids, what: str, timeout: float) -> list[int]:
        for pid in _wait_gone(pids, timeout):
            log.warning("%s pid %d ignored SIGTERM; sending SIGKILL", what, pid)
            _sigkill(pid, what)
        return _wait_gone(pids, 5)

    def __enter__(self) -> StandaloneCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- processes ---------------------------------------------------------------------------

    def _pid(self, cls: str, instance: int) -> int | None:
        try:
            with open(os.path.join(self.workdir or "", "pid", f"spark-sparkcnn-{cls}-{instance}.pid")) as f:
                pid = int(f.read().strip())
        except (OSError, ValueError):
            return None
        return pid if _alive(pid) else None

    def master_pid(self) -> int | None:
        return self._pid(MASTER, 1)

    def worker_pids(self) -> dict[int, int | None]:
        """Worker index → JVM pid (None when not running)."""
        return {i: self._pid(WORKER, i + 1) for i in range(self.workers)}

    def executor_pids(self) -> dict[int, list[int]]:
        """Worker index → pids of the executor JVMs it launched (children of its JVM)."""
        children: dict[int, list[int]] = {}
        for pid, ppid, state, args in _processes():
            if EXECUTOR in args and not state.startswith("Z"):
                children.setdefault(ppid, []).append(pid)
        return {i: sorted(children.get(w, [])) if w else [] for i, w in self.worker_pids().items()}

    def kill_worker(self, i: int, executors_only: bool = False) -> list[int]:
        """SIGKILL worker ``i`` and its executors (a lost node), or with ``executors_only`` just
        the executors (the worker survives and the master launches replacements). Returns the
        killed pids once they are gone."""
        worker = None if executors_only else self.worker_pids()[i]
        killed = ([worker] if worker else []) + self.executor_pids()[i]
        for pid in killed:
            _sigkill(pid, WORKER if pid == worker else EXECUTOR)
        _wait_gone(killed, 10)
        log.info("killed %s of worker %d: pids %s", "executors" if executors_only else "node", i, killed)
        return killed


def session(cluster: StandaloneCluster, app_name: str, conf: dict | None = None, timeout: float = 60):
    """A SparkSession on ``cluster``, returned once all its executors have registered.

    One executor per worker (``spark.executor.cores`` = the worker's cores unless ``conf``
    says otherwise). A process holds one SparkContext at most, so this refuses to run beside
    an active one rather than hand back a session on the wrong master.
    """
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    if SparkContext._active_spark_context is not None:
        raise RuntimeError("a SparkContext is already active in this process; drive the cluster from "
                           "another process (one SparkContext per process)")
    os.environ["SPARK_LOCAL_IP"] = cluster.host  # read by the driver JVM launched below
    # a context made from plain Python (not spark-submit) reads only the environment variable
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    settings = {"spark.executor.cores": cluster.cores_per_worker,
                "spark.cores.max": cluster.workers * cluster.cores_per_worker,
                "spark.pyspark.python": sys.executable, "spark.driver.host": cluster.host,
                "spark.driver.bindAddress": cluster.host, "spark.ui.enabled": "false",
                "spark.ui.showConsoleProgress": "false", **(conf or {})}
    builder = SparkSession.builder.master(cluster.master_url).appName(app_name)
    for k, v in settings.items():
        builder = builder.config(k, str(v))
    t0 = time.monotonic()
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    want = cluster.workers * (cluster.cores_per_worker // int(settings["spark.executor.cores"]))
    wait_for_executors(spark, cluster, want, timeout - (time.monotonic() - t0))
    log.info("session %r on %s: executors up in %.1f s", app_name, cluster.master_url, time.monotonic() - t0)
    return spark


def wait_for_executors(spark, cluster: StandaloneCluster, want: int, timeout: float = 60) -> None:
    """Return once ``want`` executors have registered with ``spark``; else stop it and raise."""
    t0 = time.monotonic()
    registered = spark.sparkContext._jsc.sc().getExecutorMemoryStatus  # its map includes the driver
    while registered().size() - 1 < want:
        if time.monotonic() - t0 > timeout:
            got = registered().size() - 1
            spark.stop()
            raise RuntimeError(f"only {got} of {want} executors registered with {cluster.master_url} "
                               f"within {timeout:.0f} s\n{cluster.log_tail()}")
        time.sleep(0.1)
