"""Shared helpers for the benchmarks: dataset location, child processes, JSON output,
steady-state rates from timed records, process memory."""

from __future__ import annotations

import bisect
import json
import os
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A bench's exit status when it ran to the end and printed its JSON but a target it judges missed
# (``bench/targets.py``): distinct from a crash (1) and bad arguments (2), so that bench/run_all.py
# records a miss as a miss and still renders the document.
EXIT_MISSED = 3
DATA = os.environ.get("SPARKCNN_BENCH_DATA", os.path.join(ROOT, "data", "fashion-mnist"))
FMNIST_SRC = "/usr/share/datasets/fashion-mnist"


def ensure_data() -> str:
    """The prepared Fashion-MNIST dataset, prepared on first use."""
    if not os.path.isdir(os.path.join(DATA, "test")):
        from sparkcnn.data.prepare import prepare

        prepare("idx", FMNIST_SRC, DATA)
    return DATA


# A child that trains one block alone with single-thread TF and reports its
# steady-state images/s: the "no communication at all" compute limit.
SOLO = r"""
import json, os, sys, time
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(int(sys.argv[5]))
tf.config.threading.set_inter_op_parallelism_threads(1)
from sparkcnn.worker.blockstore import read_block
from sparkcnn.protocol import TaskSpec
from sparkcnn.worker.trainer import Trainer, batch_indices
data, blocks, block, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
x, y = read_block(os.path.join(data, "train"), blocks, block)
spec = TaskSpec(run_id="solo", num_blocks=blocks, test_blocks=1,
                model_name="fmnist_cnn", input_shape=x.shape[1:], num_classes=10, seed=0,
                batch_size=64, momentum=0.9, weight_decay=0.0, layout=())
tr = Trainer(spec)
b = [batch_indices(len(y), 64, 0, 0, block, i) for i in range(steps + 5)]
tr.train(x, y, b[:5], 0.05)
t = time.perf_counter(); tr.train(x, y, b[5:], 0.05); dt = time.perf_counter() - t
print(json.dumps({"images_per_s": steps * 64 / dt, "step_ms": 1000 * dt / steps}))
"""

def keras_fit_images_per_s(data: str, steps: int, before_timing=None) -> float:
    """``model.fit`` of ``fmnist_cnn`` in this process (TF default threads): images/s over
    ``steps`` batches of 64 after a short warm-up fit (tracing).

    ``before_timing()``, when given, is called between the warm-up and the
    timed fit: work started elsewhere (Spark's start-up) overlaps TF's import
    and tracing here, and is waited for before anything is timed."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    from sparkcnn.data.parquet_io import read_split_numpy
    from sparkcnn.models import build_model

    x, y = read_split_numpy(os.path.join(data, "train"))
    n = (steps + 5) * 64
    x, y = x[:n], y[:n]
    m = build_model("fmnist_cnn", x.shape[1:], 10, 0)
    m.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    m.fit(x[:320], y[:320], batch_size=64, epochs=1, verbose=0)
    if before_timing is not None:
        before_timing()
    t = time.perf_counter()
    m.fit(x[320:], y[320:], batch_size=64, epochs=1, verbose=0, shuffle=True)
    return steps * 64 / (time.perf_counter() - t)


def run_children(script: str, argvs: list[list[str]], timeout: float = 600) -> list[dict]:
    """Start the children together and return their JSON lines."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen([sys.executable, "-c", script, *argv], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for argv in argvs]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"benchmark child failed: {stderr.strip().splitlines()[-1:]}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def slice_data(src: str, train_rows: int, test_rows: int) -> str:
    """A prepared dataset holding the first rows of ``src``'s splits, made once beside it.

    A shorter epoch lets a bench run ``engine.run()`` end to end (its own
    evaluation included) over a fixed number of samples. ``src`` itself when
    the slice would hold every row.
    """
    from sparkcnn.data.parquet_io import read_meta, read_split_numpy, write_split

    train_meta, test_meta = read_meta(os.path.join(src, "train")), read_meta(os.path.join(src, "test"))
    train_rows, test_rows = min(train_rows, train_meta.num_rows), min(test_rows, test_meta.num_rows)
    if (train_rows, test_rows) == (train_meta.num_rows, test_meta.num_rows):
        return src
    out = f"{os.path.normpath(src)}-{train_rows}-{test_rows}"
    if os.path.isdir(os.path.join(out, "test")):
        return out
    tmp = f"{out}.tmp-{os.getpid()}"
    for split, rows, meta in (("train", train_rows, train_meta), ("test", test_rows, test_meta)):
        x, y = read_split_numpy(os.path.join(src, split))
        write_split(os.path.join(tmp, split), x[:rows], y[:rows], meta.classes)
    try:
        os.rename(tmp, out)
    except OSError:  # another bench made it meanwhile
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


def log(msg: str, *args) -> None:
    """A progress line on stderr (stdout carries the one JSON object)."""
    print(f"[bench {time.strftime('%H:%M:%S')}] " + (msg % args if args else msg), file=sys.stderr, flush=True)


class TimedSink:
    """Engine sink keeping each record with the ``perf_counter`` time it arrived.

    The engines write a round record right after applying it, so these times
    are completion times on one clock: the basis of steady-state rates for
    pipelined and asynchronous runs, whose rounds overlap. With a
    :class:`CpuMeter`, :meth:`cpu_of` gives the CPU seconds spent by kind of
    process when a record arrived.

    The meter is read on a background thread every ``interval_s``, not on
    each record: the engines write records inside their apply path, and one
    reading (``/proc/<pid>/stat`` of the JVM sums its hundred threads) costs
    ~0.75 ms of CPU, which at one step per exchange was 15 % of the driver's
    CPU per exchange and held the apply lock ~3 ms. A record's reading is the
    linear interpolation of the two readings around its arrival time.

    ``clock`` stamps records and readings alike. The default, ``perf_counter``,
    is the wall clock the rates need. ``time.process_time`` puts both on this
    process's CPU clock, which the scheduler cannot stretch: the driver's CPU
    at a record is then exact however busy the machine is (a test's clock;
    rates need wall time).
    """

    def __init__(self, cpu: CpuMeter | None = None, interval_s: float = 0.1, clock=time.perf_counter):
        self.rows: list[tuple[float, dict]] = []
        self.meter = cpu
        self.interval_s = interval_s
        self.clock = clock
        self._times: dict[int, float] = {}
        self._readings: list[tuple[float, dict[str, float]]] = []  # (clock, reading), in time order
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def write(self, record: dict) -> None:
        t = self.clock()
        self.rows.append((t, record))
        if self.meter is None:
            return
        self._times[id(record)] = t
        if self._thread is None:
            self._read()  # the first record has a reading at its own time
            self._thread = threading.Thread(target=self._run, name="bench-cpu-meter", daemon=True)
            self._thread.start()

    def _read(self) -> None:
        with self._lock:
            reading = self.meter.sample()
            self._readings.append((self.clock(), reading))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._read()

    def close(self) -> None:
        """Stop the background readings (they also stop with the process)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def rounds(self) -> list[tuple[float, dict]]:
        return [(t, r) for t, r in self.rows if r.get("kind") == "round"]

    def cpu_of(self, record: dict) -> dict[str, float]:
        """CPU seconds by kind of process when ``record`` arrived (interpolated between readings)."""
        t = self._times[id(record)]
        with self._lock:
            covered = self._readings[-1][0] >= t
        if not covered:
            self._read()  # no reading after it yet: take one now
        with self._lock:
            return _interpolate(self._readings, t)


def _interpolate(readings: list[tuple[float, dict[str, float]]], t: float) -> dict[str, float]:
    """Each kind's CPU seconds at time ``t``, linear between the readings just before and after it."""
    i = bisect.bisect_left([r[0] for r in readings], t)
    if i == 0:
        return dict(readings[0][1])
    (t0, a), (t1, b) = readings[i - 1], readings[i]
    w = (t - t0) / (t1 - t0) if t1 > t0 else 1.0
    return {k: a[k] + w * (b[k] - a[k]) for k in a}


def proc_stat(pid: int | str) -> tuple[int, float, str] | None:
    """(parent pid, user + system CPU seconds, command name) from /proc/<pid>/stat; None when gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            text = fh.read()
    except OSError:
        return None
    head, _, rest = text.rpartition(")")
    fields = rest.split()
    try:
        return int(fields[1]), (int(fields[11]) + int(fields[12])) / _CLK_TCK, head.partition("(")[2]
    except (IndexError, ValueError):
        return None


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class CpuMeter:
    """CPU seconds used so far by this process and its descendants, by kind, from /proc.

    Kinds: ``driver`` (this Python process: the engine, py4j calls, decoding
    and applying results), ``jvm`` (descendant Java processes: in local mode
    Spark's driver and executor in one JVM) and ``workers`` (every other
    descendant: Spark's Python daemon and workers, TF included). On local[2]
    all three share the machine's cores, so their sum per round against the
    training's own CPU is where ``efficiency_vs_limit`` goes.

    The descendants are found by a scan of /proc at the start and again at
    most every ``rescan_s`` (a scan costs a few ms; a sample of known
    processes a fraction of one). A process that ended keeps its last reading.

    The meter's own CPU (its reads of /proc, on whichever thread samples) is
    this process's but not the driver's work: ``driver`` leaves it out and the
    kind ``meter`` holds it (``own_s``), so the kinds still sum to all the CPU
    used. Read ten times a second, the JVM's hundred threads cost ~3 ms of CPU
    per second, which at ten steps per exchange was 0.3 ms of every push counted
    against the parameter server.
    """

    def __init__(self, rescan_s: float = 5.0):
        self.rescan_s = rescan_s
        self._pids: dict[int, str] = {}  # pid -> kind
        self._last: dict[int, float] = {}
        self._scanned = float("-inf")
        self.own_s = 0.0  # CPU seconds this meter's samples took, on the threads that took them

    def _scan(self) -> None:
        me = os.getpid()
        parent: dict[int, int] = {}
        names: dict[int, str] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                st = proc_stat(int(entry))
                if st is not None:
                    parent[int(entry)], _, names[int(entry)] = st
        for pid in parent:
            p, hops = pid, 0
            while p not in (me, 0, 1) and p in parent and hops < 32:
                p, hops = parent[p], hops + 1
            if p == me:
                self._pids[pid] = "driver" if pid == me else ("jvm" if names[pid] == "java" else "workers")
        self._scanned = time.monotonic()

    def sample(self) -> dict[str, float]:
        t = time.thread_time()
        if time.monotonic() - self._scanned >= self.rescan_s:
            self._scan()
        out = {"driver": 0.0, "jvm": 0.0, "workers": 0.0, "meter": 0.0}
        me = os.getpid()
        for pid, kind in self._pids.items():
            st = proc_stat(pid) if pid != me else None
            if st is not None:
                self._last[pid] = st[1]
            out[kind] += self._last.get(pid, 0.0)
        # this process last, from the clock and not a file: each /proc read hands the GIL to a busy
        # thread for up to 5 ms, so a reading spans tens of ms, and the time it is stamped with
        # (right after) must be this process's own, which moves the fastest when it trains
        now = time.process_time()
        self.own_s += time.thread_time() - t
        out["driver"] += now - self.own_s
        out["meter"] = self.own_s
        return out


def cpu_ms_per(records: int, before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU ms per record by kind between two :meth:`CpuMeter.sample` readings, and their ``total``."""
    out = {k: 1000 * (after[k] - before[k]) / records for k in before}
    out["total"] = sum(out.values())
    return out


def cpu_per_record(sink: TimedSink, first: dict, last: dict, records: int) -> dict[str, float]:
    """CPU ms per record by kind between the arrivals of ``first`` and ``last``, and their ``total``."""
    return cpu_ms_per(records, sink.cpu_of(first), sink.cpu_of(last))


def cpu_account(cpu_ms: dict[str, float], images_per_record: float, wall_ms_per_record: float,
                limit_images_per_s: float, cores: int) -> dict:
    """Where the cores went, per record (round or job), against a compute limit of ``cores`` processes.

    ``training_cpu_ms``: the CPU the limit's single-thread processes spend on
    the same images (``images / (limit / cores)``). Since ``efficiency_vs_limit``
    = images/s / limit, it factors exactly as ``compute_share`` (training CPU /
    all CPU used) times ``cores_busy`` (all CPU used / (wall x cores)): the
    first says what Spark, the driver and the tasks' framing cost, the second
    what idles. With as many cores as limit processes (local[2] on 2 cores),
    ``cores_busy`` <= 1 and so ``efficiency_vs_limit`` <= ``compute_share``.
    """
    training = 1000 * images_per_record / (limit_images_per_s / cores)
    total = cpu_ms["total"]
    return {"cpu_ms": cpu_ms, "training_cpu_ms": training,
            "non_training_cpu_ms": total - training,
            "compute_share": training / total if total else None,
            "cores_busy": total / (wall_ms_per_record * cores) if wall_ms_per_record else None}


def steady_rate(rows: list[tuple[float, dict]], skip_first: int, skip_last: int) -> dict:
    """Images/s between two completions, leaving out warm-up and drain records.

    With ``sel = rows[skip_first : len - skip_last]``: the samples of the
    records completed after ``sel[0]`` up to ``sel[-1]``, over the time between
    those two completions.
    """
    sel = rows[skip_first:len(rows) - skip_last]
    if len(sel) < 2:
        raise RuntimeError(f"steady_rate: {len(rows)} records leave {len(sel)} after skipping "
                           f"{skip_first} + {skip_last}; run longer")
    window = sel[-1][0] - sel[0][0]
    samples = sum(r["samples"] for _, r in sel[1:])
    return {"images_per_s": samples / window if window > 0 else 0.0, "window_s": window,
            "samples": samples, "records": len(sel) - 1, "first": skip_first, "last": len(rows) - skip_last - 1}


def add_model_args(ap, psload_help: str) -> None:
    """The arguments of a speed-up model fitted on psload's costs (bench/shardmodel.py,
    bench/servermodel.py): the psload result, and the step from a throughput result or given."""
    ap.add_argument("--psload", required=True, help=psload_help)
    ap.add_argument("--throughput", help="a bench/throughput.py result: the step and the worker's CPU")
    ap.add_argument("--step-ms", type=float, default=0.0, help="one worker's training step (ms)")
    ap.add_argument("--worker-ms", type=float, default=0.0, help="a worker's CPU per step outside training")
    ap.add_argument("--gbit", type=float, default=10.0, help="the driver's link (Gbit/s)")


def model_step(throughput: str) -> tuple[float, float] | str:
    """(one worker's step alone in ms, a worker's CPU per step outside training in ms) from a
    bench/throughput.py result (its ``solo_step_ms`` and its ``async_h1_sparse`` stream case), or
    why not."""
    try:
        with open(throughput, encoding="utf-8") as fh:
            tp = json.load(fh)
        cpu = tp["stream"]["async_h1_sparse"]["cpu"]
        return (sum(tp["solo_step_ms"]) / len(tp["solo_step_ms"]),
                max(0.0, cpu["cpu_ms"]["workers"] - cpu["training_cpu_ms"]))
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as e:
        return f"{throughput}: no solo_step_ms or async_h1_sparse CPU ({e})"


def take_model_step(a, bench: str) -> bool:
    """With ``--throughput``, ``a.step_ms`` and ``a.worker_ms`` from it (:func:`model_step`);
    False, the reason printed on one line, when it holds none."""
    if a.throughput:
        got = model_step(a.throughput)
        if isinstance(got, str):
            print(f"{bench}: {got}", file=sys.stderr)
            return False
        a.step_ms, a.worker_ms = got
    return True


def median(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def rss_mb(pid: int | str = "self") -> float | None:
    """Resident set size of a process from /proc (MB); None when it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        return None
    return None


def parent_pid(pid: int) -> int | None:
    """Parent of ``pid`` from /proc/<pid>/stat; None when it is gone."""
    st = proc_stat(pid)
    return st[0] if st else None


def slot_count(engine) -> int:
    """The task slots an async jobs engine runs on: ``engine.slots`` is a count in older engines
    and a ``Slots`` (``live``: the slots it runs jobs on now) since the engine rebuild."""
    slots = engine.slots
    return slots if isinstance(slots, int) else slots.live


def spark_backend(spark, run_id: str, pool: str | None = None):
    """A SparkBackend for one engine on the bench's shared session."""
    from sparkcnn.backends.spark import SparkBackend

    return SparkBackend(spark, run_id, pool=pool)


def portable_path(p: str) -> str:
    """A path as a result may carry it: relative to the repository inside it, else ``<tmp>/``
    and its last part (no path of the machine that ran it)."""
    p = os.path.abspath(p)
    return os.path.relpath(p, ROOT) if p.startswith(ROOT + os.sep) else f"<tmp>/{os.path.basename(p)}"


def _git(*args: str, root: str = ROOT) -> str:
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def tree_dirty(root: str = ROOT) -> bool:
    """Whether the tree differs from the commit, results aside: a tracked file changed or an
    untracked one (not ignored) exists, since a new module or config file changes what runs.
    ``bench/run_all.py`` moves the older ``bench/results/`` files into its archive before the
    benchmarks start, and what a run measures is the code, not the results folder it writes into."""
    return bool(_git("status", "--porcelain", "--untracked-files=normal", "--", ".", ":(exclude)bench/results",
                     root=root))


# read when the benchmark starts (this module is imported first): what the run measures
_STARTED = {"git_commit": _git("rev-parse", "HEAD") or None,
            "git_dirty": tree_dirty(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": [os.path.basename(sys.executable),
                        *(portable_path(a) if os.path.isabs(a) else a for a in sys.argv)]}


def provenance() -> dict:
    """Where a result came from: commit (and whether the tree was dirty at the start), command,
    date, library versions and the machine."""
    import platform
    from importlib import metadata

    def version(pkg):
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    return {**_STARTED, "python": platform.python_version(),
            "tensorflow": version("tensorflow") or version("tensorflow-cpu"),
            **{pkg: version(pkg) for pkg in ("keras", "pyspark", "numpy", "pyarrow")},
            "machine": {"cores": os.cpu_count(), "memory_gib": round(mem / 2**30, 1), "cpu": cpu,
                        "platform": platform.platform()}}


_EMITTED: list[dict] = []  # what this process printed, for exit_status()


def emit(obj: dict, out: str | None = None) -> None:
    """Print ``obj`` with its provenance as JSON; with ``out``, also write the same text there,
    whole or not at all (its folder made if missing: a long run must not end without its file)."""
    _EMITTED.append(obj)
    text = json.dumps({**obj, "provenance": provenance()}, indent=2, sort_keys=False)
    print(text)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        tmp = f"{out}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
        os.replace(tmp, out)


def exit_status(bench: str, code: int | None = 0) -> int:
    """A bench's exit status: ``code`` (its own: 2 on bad arguments) when not 0, else
    ``EXIT_MISSED`` when a target of what it printed misses under the project's rule
    (``bench/targets.py``), else 0. ``bench``: its name, as bench/run_all.py saves its JSON."""
    if isinstance(code, int) and not isinstance(code, bool) and code:
        return code
    from bench import targets

    return EXIT_MISSED if any(targets.missed(targets.of_result(bench, o)) for o in _EMITTED) else 0


class Timer:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.s = time.perf_counter() - self.t0


def config_of(cfg) -> dict:
    """One run's resolved config (paths inside the repository made relative to it, others named
    by their last part) and the sha256 of its YAML: runs with the same digest ran the same config."""
    import hashlib

    import yaml

    d = cfg.to_dict()
    for section, key in (("data", "path"), ("run", "out_dir")):
        d[section][key] = portable_path(d[section][key])
    return {"config_sha256": hashlib.sha256(yaml.safe_dump(d, sort_keys=True).encode()).hexdigest(), "config": d}
