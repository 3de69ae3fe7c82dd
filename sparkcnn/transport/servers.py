"""The driver's side of ``ps.servers`` > 1: K server processes
(:mod:`sparkcnn.transport.serverprocess`) that split the blocks, over the run's one
:class:`~sparkcnn.server.sharedstore.SharedStore` (docs/transports.md, "Several server processes").

    start           K processes, each attached to the store, listening on the driver's address
                    with the run's token; block b's task gets server b mod K's address
    start_stage(e)  every server plans stage e for its blocks from the driver's merged state;
                    the stage's tasks start once every one has
    (the stage)     each server's records come back as it applies exchanges, encoded and in
                    batches, and are written as they are, in the order of their ``round``
                    (:class:`InOrder`); a failed push, or a server that exits, stops
                    the run's jobs (the stage fails) and is raised when the stage ends
    a cut           a server whose apply makes a checkpoint due says so, and the driver tells the
                    others; each sends its part once its blocks are settled and holds them; with
                    every part in, the driver merges them, writes the checkpoint and lets them go
    end_stage()     every server's part merged into the driver's Run
    close           EOF to every server: each closes its service and exits

Chaos: ``chaos.kill_shard_round`` SIGKILLs the last server process once the record of that
exchange is written, as it does the last key-range shard.
"""

from __future__ import annotations

import json
import logging
import queue
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from sparkcnn.checkpoint import int_keys
from sparkcnn.transport.serverprocess import read_record, setup_line

log = logging.getLogger(__name__)


class ServerProcess:
    """The driver's handle on one server process: its pipe, its answers and its address.
    ``on_record(index, round, line)``: each record it sends; ``on_line(index, msg)``: each other
    message (True: taken, else a control answer)."""

    def __init__(self, index: int, setup: str, lock_fd: int, timeout_s: float, on_line, on_record):
        self.index, self.timeout_s = index, timeout_s
        self.proc = subprocess.Popen([sys.executable, "-m", "sparkcnn.transport.serverprocess"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     pass_fds=(lock_fd,))
        self.answers: queue.Queue = queue.Queue()  # control answers (None: the process is gone)
        self._on_line, self._on_record = on_line, on_record
        self._lock = threading.Lock()  # the main thread and the reader threads tell it things
        self.tell_line(setup)
        self.reader = threading.Thread(target=self._read, name=f"sparkcnn-server-{index}", daemon=True)
        self.reader.start()
        self.port = int(self.answer("port"))

    def _read(self) -> None:
        for line in self.proc.stdout:
            if not line.startswith("{"):  # a record (serverprocess.record_line): not parsed here
                try:
                    rnd, encoded = read_record(line)
                except ValueError as e:
                    self._on_line(self.index, {"failed": str(e)})
                    continue
                self._on_record(self.index, rnd, encoded)
                continue
            msg = json.loads(line)
            if not self._on_line(self.index, msg):
                self.answers.put(msg)
        self.answers.put(None)
        self._on_line(self.index, {"failed": f"exited (code {self.proc.wait()})"})  # unless closing

    def tell(self, msg: dict) -> None:
        self.tell_line(json.dumps(msg) + "\n")

    def tell_line(self, line: str) -> None:
        with self._lock:
            try:
                self.proc.stdin.write(line)
                self.proc.stdin.flush()
            except (BrokenPipeError, ValueError):  # the process is gone: its reader says so
                pass

    def answer(self, key: str):
        """The next control answer's ``key``; RuntimeError when the process is gone or silent."""
        try:
            msg = self.answers.get(timeout=self.timeout_s)
        except queue.Empty:
            msg = None
        if msg is None or key not in msg:
            raise RuntimeError(f"parameter server process {self.index} did not answer ({key}); "
                               f"exit code {self.proc.poll()}")
        return msg[key]

    def close(self) -> None:
        with self._lock:
            try:
                self.proc.stdin.close()  # EOF: the server closes its service and exits
            except OSError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class InOrder:
    """The servers' records, written in the order of their ``round`` (the servers number them
    at once, so one may arrive before an earlier one), each its ``metrics.jsonl`` line as its
    server encoded it (:meth:`sparkcnn.server.run.Run.write_encoded`)."""

    def __init__(self, run, first: int):
        self.run, self.next = run, first
        self._held: dict[int, str] = {}
        t = run.cfg.train  # the progress bar's total: exchanges in the run
        self.total = max(1, t.epochs * run.cursors.epoch_samples // max(1, t.batch_size * t.steps_per_round))

    @property
    def pending(self) -> int:
        return len(self._held)

    def take(self, rnd: int, encoded: str) -> list[int]:
        """Keep exchange ``rnd``'s line; write what is now in order. Returns the rounds written."""
        self._held[rnd] = encoded
        written = []
        while self.next in self._held:
            self.run.write_encoded(self._held.pop(self.next), progress_at=(self.next, self.total))
            written.append(self.next)
            self.next += 1
        return written


class Merge:
    """The servers' parts merged into the driver's Run: their blocks' cursors, and the run's
    counters and staleness set to the stage's start plus every part (a cut and the stage's end
    both merge, so the parts are set, not added)."""

    def __init__(self, run, k: int):
        self.run, self.k = run, k
        self.parts: dict[int, dict] = {}          # each server's latest part
        self._base: tuple[dict, dict] = ({}, {})  # the run's counters and staleness at the stage's start
        self._executors: dict[int, dict] = {}     # each server's executors, as counted so far

    def begin(self) -> None:
        self._base = (self.run.counters.as_dict(), dict(self.run.exchange.staleness_hist))

    def take(self, index: int, part: dict) -> None:
        self.parts[index] = part
        run = self.run
        run.exchange.take_part(part["exchange"], [b for b in run.cursors.pass_steps if b % self.k == index])
        counters, hist = dict(self._base[0]), dict(self._base[1])
        for p in self.parts.values():
            for name, n in p["counters"].items():
                counters[name] = counters.get(name, 0) + n
            for tau, n in int_keys(p["exchange"]["staleness_hist"]).items():
                hist[tau] = hist.get(tau, 0) + n
        run.counters.load(counters)
        run.exchange.load_staleness(hist)

    def count_executors(self) -> None:
        """The stage's results per executor, from each server's counts (at the stage's end)."""
        for index, part in self.parts.items():
            before = self._executors.get(index, {})
            for executor, n in part["executors"].items():
                self.run.records.count_executor(executor, n - before.get(executor, 0))
            self._executors[index] = dict(part["executors"])


class Cuts:
    """The servers' parts of the checkpoint being cut inside a stage (None: none is), and the
    folder their blocks' states come through. ``write(states, t0)``: the driver's checkpoint."""

    def __init__(self, k: int, write, timeout_s: float):
        self.k, self.write, self.timeout_s = k, write, timeout_s
        self.dir = tempfile.mkdtemp(prefix="sparkcnn-cut-")
        self.parts: dict[int, dict] | None = None
        self.t0 = 0.0

    def begin(self) -> bool:
        """A server began one: True when it is new (the others are to be told)."""
        if self.parts is not None:
            return False
        self.parts, self.t0 = {}, time.perf_counter()
        return True

    def take(self, index: int, part: dict) -> dict[int, dict] | None:
        """A server's part; every part once all are in (the cut is then closed)."""
        if self.parts is None:
            self.begin()
        self.parts[index] = part
        if len(self.parts) < self.k:
            return None
        parts, self.parts = self.parts, None
        return parts

    @staticmethod
    def states(parts: dict[int, dict]) -> dict[int, dict]:
        """The blocks' states the parts sent (read back from their .npy files)."""
        return {int(b): {name: np.load(path, allow_pickle=False) for name, path in files.items()}
                for part in parts.values() for b, files in part["states"].items()}

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class ServerGroup:
    """K server processes over ``store`` for the driver's ``run`` (module docstring).
    ``write_cut(states, t0)``: write a checkpoint inside a stage from the blocks' states."""

    def __init__(self, k: int, run, store, backend, *, host: str, spec, pass_steps: dict, downlink_every: int,
                 max_message_bytes: int, timeout_s: float, run_dir: str | None = None, write_cut=None):
        self.run, self.backend, self.host = run, backend, host
        self.token = secrets.token_urlsafe(32)
        self.failure: BaseException | None = None
        self.order = InOrder(run, run.exchange.exchanges)  # a resumed run's records go on from its own
        self.merge = Merge(run, k)
        self.cuts = Cuts(k, write_cut, timeout_s)
        self._lock = threading.Lock()
        self._closing = False
        self.procs: list[ServerProcess] = []
        try:
            for j in range(k):  # each process reads its setup while the next one starts
                setup = setup_line(j, k, host=host, token=self.token, store=store, cfg=run.cfg, spec=spec,
                                   pass_steps=pass_steps, downlink_every=downlink_every,
                                   max_message_bytes=max_message_bytes, run_dir=run_dir,
                                   cut_dir=self.cuts.dir)
                self.procs.append(ServerProcess(j, setup, store.address.lock_fd, timeout_s, self._line,
                                                self._record))
        except BaseException:
            self.close()
            raise

    @property
    def locations(self) -> list[tuple[str, int]]:
        return [(self.host, p.port) for p in self.procs]

    def server_of(self, block: int) -> tuple[str, int]:
        """The address of ``block``'s server: server ``block mod K``."""
        return self.host, self.procs[block % len(self.procs)].port

    # -- the processes' lines (their reader threads) --------------------------------------------------
    def _record(self, index: int, rnd: int, encoded: str) -> None:
        """Server ``index``'s record of exchange ``rnd``: written once the ones before it are."""
        with self._lock:
            for r in self.order.take(rnd, encoded):
                self._chaos(r)

    def _line(self, index: int, msg: dict) -> bool:
        """A failure or a cut's (True: taken here); anything else is a control answer."""
        if "failed" in msg:
            self.fail(f"parameter server process {index}: {msg['failed']}")
        elif "cut_begin" in msg:
            with self._lock:
                if self.cuts.begin():
                    for p in self.procs:
                        if p.index != index:
                            p.tell({"begin_cut": True})
        elif "cut_part" in msg:
            with self._lock:
                parts = self.cuts.take(index, msg["cut_part"])
                if parts is not None:
                    self._write_cut(parts)
        else:
            return False
        return True

    def _chaos(self, rnd: int) -> None:
        self.run.chaos_after(rnd)  # chaos.kill_driver_round: the driver's
        if self.run.cfg.chaos.kill_shard_round == rnd:
            log.warning("chaos: SIGKILL of parameter server process %s after exchange %s",
                        len(self.procs) - 1, rnd)
            self.procs[-1].proc.kill()

    def _write_cut(self, parts: dict[int, dict]) -> None:
        """Every server's part is in and every block is held: merge, write, let them go (unless the
        gathering took so long that a server may have stopped holding its blocks: then skip)."""
        done, t0 = [-1, -1, 0.0], self.cuts.t0
        try:
            if time.perf_counter() - t0 > self.cuts.timeout_s / 2 or self.order.pending:
                log.warning("checkpoint at exchange %s skipped: its parts took too long or records are "
                            "missing", self.run.exchange.exchanges)
            else:
                for index, part in parts.items():
                    self.merge.take(index, part)
                self.cuts.write(self.cuts.states(parts), t0)
                done = [self.run.exchange.exchanges, self.run.exchange.exchanges, time.perf_counter() - t0]
        except Exception as e:  # noqa: BLE001 - a reader thread: the run fails, it does not hang
            log.error("checkpoint inside a stage failed: %s", e, exc_info=True)
            self.failure = self.failure or e
            self.backend.stop()
        for p in self.procs:
            p.tell({"cut_done": done})

    def fail(self, why: str) -> None:
        """The run fails: stop its jobs (the stage ends), raise ``why`` when it has."""
        with self._lock:
            if self.failure is not None or self._closing:
                return
            self.failure = RuntimeError(why)
        log.error("%s: the run stops", why)
        self.backend.stop()

    # -- stages ---------------------------------------------------------------------------------------
    def start_stage(self, epoch: int) -> None:
        self.merge.begin()
        state = self.run.exchange.state_dict()
        for p in self.procs:
            p.tell({"stage": epoch, "exchange": state})
        for p in self.procs:
            p.answer("planned")

    def end_stage(self, epoch: int) -> None:
        """Every server's part of the stage, merged into the driver's Run."""
        for p in self.procs:
            p.tell({"end": epoch})
        for p in self.procs:
            part = p.answer("part")
            with self._lock:
                self.merge.take(p.index, part)
        self.merge.count_executors()

    def front(self) -> dict:
        """The services' part of the summary: their counters summed, addresses and peers."""
        counters: dict = {}
        parts = self.merge.parts.values()
        for part in parts:
            for key, v in part.get("service", {}).items():
                counters[key] = counters.get(key, 0) + v
        return {"stream": counters, "ps_address": ",".join(f"{h}:{p}" for h, p in self.locations),
                "ps_peers": sorted({h for part in parts for h in part.get("peers", ())})}

    def close(self) -> None:
        with self._lock:
            self._closing = True
        for p in self.procs:
            p.close()
        self.cuts.close()
