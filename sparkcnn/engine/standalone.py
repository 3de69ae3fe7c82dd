"""A real Spark standalone cluster on loopback, started from pyspark's pip package alone.

The pip package has no ``start-master.sh``, but it ships ``sbin/spark-daemon.sh``, which
is all that is needed: one master and ``workers`` workers, every one a separate JVM bound
to 127.0.0.1, with PID files, logs and work dirs in one temporary directory. Used by the
cluster tests and the benchmarks (fault injection: :meth:`StandaloneCluster.kill_worker`;
a slowed executor: ``per_worker_env={1: {"SPARKCNN_CHAOS_SLOW": "2.0"}}``, which a
worker hands on to the executors it launches).

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

HOST = "127.0.0.1"  # the only address any daemon, executor or driver may use
MASTER = "org.apache.spark.deploy.master.Master"
WORKER = "org.apache.spark.deploy.worker.Worker"
EXECUTOR = "CoarseGrainedExecutorBackend"
# JVM flags that halve start-up on a small, busy machine (C1-only JIT, one GC thread); used
# for the daemons, which idle after start. Pass them to executors (spark.executor.
# extraJavaOptions) only where start-up matters more than JVM-side throughput, as in tests.
FAST_START_JAVA_OPTS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def spark_home() -> str:
    import pyspark

    return os.path.dirname(os.path.abspath(pyspark.__file__))


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on loopback right now (all held open while choosing)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind((HOST, 0))
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
    out = subprocess.run(["ps", "-eo", "pid=,ppid=,stat=,args="], capture_output=True, text=True,
                         check=True).stdout
    rows = []
    for line in out.splitlines():
        parts = line.split(None, 3)
        if len(parts) >= 3:
            rows.append((int(parts[0]), int(parts[1]), parts[2], parts[3] if len(parts) > 3 else ""))
    return rows


def _alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie counts as gone (PID 1 in a container may never reap it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return any(p == pid and not st.startswith("Z") for p, _, st, _ in _processes())


def _wait_gone(pids, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    left = [p for p in pids if _alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [p for p in left if _alive(p)]
    return left


class StandaloneCluster:
    """Master + ``workers`` workers of ``cores_per_worker`` cores and ``memory`` each, on 127.0.0.1.

    Worker indices are 0-based (daemon instance ``i + 1``). ``worker_env`` is added to every
    daemon's environment, ``per_worker_env[i]`` to worker ``i``'s only; executors inherit
    their worker's environment. ``workdir`` (default: a fresh temporary directory, removed
    by :meth:`stop`) holds PID files, daemon logs and executor work dirs.
    """

    def __init__(self, workers: int = 2, cores_per_worker: int = 1, memory: str = "2g",
                 worker_env: dict | None = None, per_worker_env: dict[int, dict] | None = None,
                 workdir: str | None = None, daemon_memory: str = "512m"):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if cores_per_worker < 1:
            raise ValueError(f"cores_per_worker must be >= 1, got {cores_per_worker}")
        bad = sorted(set(per_worker_env or {}) - set(range(workers)))
        if bad:
            raise ValueError(f"per_worker_env names workers {bad}, but there are {workers} (0-based)")
        self.workers = workers
        self.cores_per_worker = cores_per_worker
        self.memory = memory
        self.worker_env = {k: str(v) for k, v in (worker_env or {}).items()}
        self.per_worker_env = {i: {k: str(v) for k, v in e.items()} for i, e in (per_worker_env or {}).items()}
        self.daemon_memory = daemon_memory  # heap of master/worker JVMs (SPARK_DAEMON_MEMORY)
        self._own_dir = workdir is None
        self.workdir = workdir
        self.spark_home = spark_home()
        self.port = self.webui_port = None
        self.worker_ports: list[int] = []
        self.worker_webui_ports: list[int] = []
        self._started = False

    def to_json(self) -> str:
        """What another process needs to use this cluster (see :meth:`attach`)."""
        return json.dumps({"workers": self.workers, "cores_per_worker": self.cores_per_worker,
                           "memory": self.memory, "workdir": self.workdir, "port": self.port,
                           "webui_port": self.webui_port, "worker_ports": self.worker_ports,
                           "worker_webui_ports": self.worker_webui_ports})

    @classmethod
    def attach(cls, text: str) -> StandaloneCluster:
        """A handle on a cluster another process started, e.g. for a driver in a subprocess
        (one SparkContext per process). It can open sessions, list and kill processes; its
        :meth:`stop` does nothing, the owner stops the cluster."""
        info = json.loads(text)
        self = cls(workers=info["workers"], cores_per_worker=info["cores_per_worker"], memory=info["memory"],
                   workdir=info["workdir"])
        self.port, self.webui_port = info["port"], info["webui_port"]
        self.worker_ports, self.worker_webui_ports = info["worker_ports"], info["worker_webui_ports"]
        return self

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def master_url(self) -> str:
        return f"spark://{HOST}:{self.port}"

    @property
    def ports(self) -> list[int]:
        """Every port the daemons listen on (master RPC and UI, worker RPC and UI)."""
        return [p for p in [self.port, self.webui_port, *self.worker_ports, *self.worker_webui_ports] if p]

    def _env(self, extra: dict | None = None) -> dict:
        env = {k: v for k, v in os.environ.items() if k not in ("SPARK_ENV_LOADED", "PYSPARK_SUBMIT_ARGS")}
        conf_dir = os.path.join(self.workdir, "conf")  # empty: no spark-env.sh / defaults leak in
        env.update(SPARK_HOME=self.spark_home, SPARK_CONF_DIR=conf_dir, SPARK_IDENT_STRING="sparkcnn",
                   SPARK_PID_DIR=os.path.join(self.workdir, "pid"), SPARK_LOG_DIR=os.path.join(self.workdir, "logs"),
                   SPARK_WORKER_DIR=os.path.join(self.workdir, "work"), SPARK_LOCAL_IP=HOST,
                   SPARK_MASTER_HOST=HOST, SPARK_DAEMON_MEMORY=self.daemon_memory, PYSPARK_PYTHON=sys.executable,
                   SPARK_DAEMON_JAVA_OPTS=FAST_START_JAVA_OPTS,
                   # the REST submission server would take the fixed port 6066
                   SPARK_MASTER_OPTS="-Dspark.master.rest.enabled=false")
        env.update(self.worker_env)
        env.update(extra or {})
        return env

    def _daemon(self, action: str, cls: str, instance: int, *args, env: dict | None = None) -> subprocess.Popen:
        cmd = ["bash", os.path.join(self.spark_home, "sbin", "spark-daemon.sh"), action, cls, str(instance), *args]
        return subprocess.Popen(cmd, env=env or self._env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)

    def start(self, timeout: float = 60) -> StandaloneCluster:
        """Start master and workers; return once the master lists every worker ALIVE."""
        if self._started:
            return self
        t0 = time.monotonic()
        if self._own_dir:
            self.workdir = tempfile.mkdtemp(prefix="sparkcnn-cluster-")
        for sub in ("conf", "pid", "logs", "work"):
            os.makedirs(os.path.join(self.workdir, sub), exist_ok=True)
        ports = free_ports(2 + 2 * self.workers)
        self.port, self.webui_port = ports[:2]
        self.worker_ports, self.worker_webui_ports = ports[2::2], ports[3::2]
        self._started = True  # from here on stop() has something to clean up
        try:
            launchers = [self._daemon("start", MASTER, 1, "--host", HOST, "--port", str(self.port),
                                      "--webui-port", str(self.webui_port))]
            # a worker that reaches the master before it is elected leader retries only after
            # 5-15 s, so wait until the master itself reports ALIVE
            self._wait(lambda: self.master_state().get("status") == "ALIVE", t0 + timeout, "master ALIVE")
            for i in range(self.workers):
                launchers.append(self._daemon(
                    "start", WORKER, i + 1, "--host", HOST, "--port", str(self.worker_ports[i]),
                    "--cores", str(self.cores_per_worker),
                    "--memory", self.memory, "--webui-port", str(self.worker_webui_ports[i]), self.master_url,
                    env=self._env(self.per_worker_env.get(i))))
            for p in launchers:  # spark-daemon.sh itself sleeps ~2.5 s to see the JVM survive
                out, _ = p.communicate(timeout=max(1.0, t0 + timeout - time.monotonic()))
                log.debug("spark-daemon.sh: %s", out.strip())
            self._wait(lambda: self.alive_workers() >= self.workers, t0 + timeout, f"{self.workers} ALIVE workers")
        except BaseException:
            self.stop()
            raise
        log.info("standalone cluster %s up: %d workers in %.1f s", self.master_url, self.workers,
                 time.monotonic() - t0)
        return self

    def _wait(self, ready, deadline: float, what: str) -> None:
        while not ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"standalone cluster: timed out waiting for {what}\n{self.log_tail()}")
            time.sleep(0.2)

    def master_state(self) -> dict:
        """The master web UI's JSON (loopback, never via a proxy); {} while unreachable."""
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(f"http://{HOST}:{self.webui_port}/json/", timeout=2) as r:
                return json.load(r)
        except (OSError, ValueError):
            return {}

    def alive_workers(self) -> int:
        """Workers the master reports ALIVE."""
        return sum(1 for w in self.master_state().get("workers", []) if w.get("state") == "ALIVE")

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of every daemon log, for error messages."""
        out = []
        for path in sorted(glob.glob(os.path.join(self.workdir or "", "logs", "*.out"))):
            with open(path, errors="replace") as f:
                tail = f.readlines()[-lines:]
            out.append(f"--- {os.path.basename(path)}\n" + "".join(tail))
        return "\n".join(out) or "(no daemon logs)"

    def stop(self, timeout: float = 20) -> None:
        """Stop workers (and their executors), then the master; verify every process is gone."""
        if not self._started:
            return
        self._started = False
        executors = [p for ps in self.executor_pids().values() for p in ps]
        stuck = []
        for cls, pids in ((WORKER, self.worker_pids()), (MASTER, {0: self.master_pid()})):
            for i, pid in pids.items():
                if pid is None:
                    continue
                p = self._daemon("stop", cls, i + 1)
                p.communicate(timeout=30)
                stuck += self._kill_if_alive([pid], cls, timeout)
        stuck += self._kill_if_alive(executors, EXECUTOR, timeout)
        if stuck:
            raise RuntimeError(f"standalone cluster: processes {stuck} survived SIGKILL")
        if self._own_dir and self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        log.info("standalone cluster %s stopped", self.master_url)

    def _kill_if_alive(self, pids, what: str, timeout: float) -> list[int]:
        left = _wait_gone(pids, timeout)
        for pid in left:
            log.warning("%s pid %d ignored SIGTERM; sending SIGKILL", what, pid)
            self._sigkill(pid, what)
        return _wait_gone(left, 5)

    def __enter__(self) -> StandaloneCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- processes ---------------------------------------------------------------------------

    def _pid(self, cls: str, instance: int) -> int | None:
        path = os.path.join(self.workdir or "", "pid", f"spark-sparkcnn-{cls}-{instance}.pid")
        try:
            with open(path) as f:
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
        """Worker index → pids of the executor JVMs that worker launched (children of its JVM)."""
        workers = self.worker_pids()
        by_parent = {}
        for pid, ppid, state, args in _processes():
            if EXECUTOR in args and not state.startswith("Z"):
                by_parent.setdefault(ppid, []).append(pid)
        return {i: sorted(by_parent.get(w, [])) if w else [] for i, w in workers.items()}

    def _sigkill(self, pid: int, what: str) -> None:
        # the PID came from a file or a ps listing: check it is still that process before killing
        if any(p == pid and (what in args) for p, _, _, args in _processes()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def kill_executors(self, i: int) -> list[int]:
        """SIGKILL worker ``i``'s executors (the worker survives and the master relaunches them)."""
        pids = self.executor_pids()[i]
        for pid in pids:
            self._sigkill(pid, EXECUTOR)
        log.info("killed executors %s of worker %d", pids, i)
        return pids

    def kill_worker(self, i: int) -> list[int]:
        """SIGKILL worker ``i`` and its executors: a lost node. Returns the killed pids."""
        pid = self.worker_pids()[i]
        executors = self.executor_pids()[i]
        if pid is not None:
            self._sigkill(pid, WORKER)
        for e in executors:
            self._sigkill(e, EXECUTOR)
        killed = ([pid] if pid else []) + executors
        _wait_gone(killed, 10)
        log.info("killed worker %d (pids %s)", i, killed)
        return killed


def session(cluster: StandaloneCluster, app_name: str, conf: dict | None = None, timeout: float = 60):
    """A SparkSession on ``cluster`` that returns once all its executors have registered.

    One executor per worker (``spark.executor.cores`` = the worker's cores, unless ``conf``
    says otherwise). Only one SparkContext may live in a process, so this refuses to run
    beside an active one rather than silently returning it with the wrong master.
    """
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    if SparkContext._active_spark_context is not None:
        raise RuntimeError("a SparkContext is already active in this process; run the cluster client "
                           "in its own process (one SparkContext per process)")
    os.environ["SPARK_LOCAL_IP"] = HOST  # read by the driver JVM launched below
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    settings = {
        "spark.executor.cores": str(cluster.cores_per_worker),
        "spark.cores.max": str(cluster.workers * cluster.cores_per_worker),
        "spark.pyspark.python": sys.executable,
        "spark.driver.host": HOST,
        "spark.driver.bindAddress": HOST,
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
    }
    settings.update({k: str(v) for k, v in (conf or {}).items()})
    builder = SparkSession.builder.master(cluster.master_url).appName(app_name)
    for k, v in settings.items():
        builder = builder.config(k, v)
    t0 = time.monotonic()
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    want = cluster.workers * (cluster.cores_per_worker // int(settings["spark.executor.cores"]))
    jsc = spark.sparkContext._jsc.sc()
    while jsc.getExecutorMemoryStatus().size() - 1 < want:  # the map includes the driver
        if time.monotonic() - t0 > timeout:
            got = jsc.getExecutorMemoryStatus().size() - 1
            spark.stop()
            raise RuntimeError(f"only {got} of {want} executors registered within {timeout} s\n"
                               f"{cluster.log_tail()}")
        time.sleep(0.1)
    log.info("session %r on %s: %d executors after %.1f s", app_name, cluster.master_url, want,
             time.monotonic() - t0)
    return spark
