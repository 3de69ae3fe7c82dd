"""The driver's side of ``ps.servers`` > 1: K server processes
(:mod:`sparkcnn.transport.serverprocess`) that split the blocks, over the run's one
:class:`~sparkcnn.server.sharedstore.SharedStore` (docs/transports.md, "Several server processes").

    start           K processes at once, each attached to the store, listening on the driver's
                    address with the run's token; block b's task gets server b mod K's address
    start_stage(e)  every server plans stage e for its blocks from the driver's merged state;
                    the stage's tasks start once every one has
    (the stage)     each server's records come back as it applies exchanges and are written in
                    the order of their ``round``; a failed push, or a server that exits, stops
                    the run's jobs (the stage fails) and is raised when the stage ends
    end_stage()     every server's part (its blocks' cursors, its counters, staleness, the
                    executors, its service's counters) merged into the driver's Run
    close           EOF to every server: each closes its service and exits

Chaos: ``chaos.kill_shard_round`` SIGKILLs the last server process once the record of that
exchange is written, as it does the last key-range shard.
"""

from __future__ import annotations

import json
import logging
import queue
import secrets
import subprocess
import sys
import threading

from sparkcnn.transport.serverprocess import setup_line

log = logging.getLogger(__name__)


class ServerProcess:
    """The driver's handle on one server process: its pipe, its answers and its address."""

    def __init__(self, index: int, setup: str, lock_fd: int, timeout_s: float, on_line):
        self.index, self.timeout_s = index, timeout_s
        self.proc = subprocess.Popen([sys.executable, "-m", "sparkcnn.transport.serverprocess"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     pass_fds=(lock_fd,))
        self.answers: queue.Queue = queue.Queue()  # control answers (None: the process is gone)
        self._on_line = on_line
        self.proc.stdin.write(setup)
        self.proc.stdin.flush()
        self.reader = threading.Thread(target=self._read, name=f"sparkcnn-server-{index}", daemon=True)
        self.reader.start()
        self.port = int(self.answer("port"))

    def _read(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            if not self._on_line(self.index, msg):
                self.answers.put(msg)
        self.answers.put(None)
        self._on_line(self.index, {"failed": f"exited (code {self.proc.wait()})"})  # unless closing

    def tell(self, msg: dict) -> None:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

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
        try:
            self.proc.stdin.close()  # EOF: the server closes its service and exits
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class ServerGroup:
    """K server processes over ``store`` for the driver's ``run`` (module docstring)."""

    def __init__(self, k: int, run, store, backend, *, host: str, spec, pass_steps: dict, downlink_every: int,
                 max_message_bytes: int, timeout_s: float):
        self.run, self.backend, self.host = run, backend, host
        self.token = secrets.token_urlsafe(32)
        self.failure: BaseException | None = None
        self.next_round = run.exchange.exchanges  # the next record to write (a resumed run's go on)
        self._held: dict[int, dict] = {}           # records that came before an earlier round's
        self._lock = threading.Lock()
        self._closing = False
        self.parts: dict[int, dict] = {}           # each server's last stage part (the summary's)
        self.procs: list[ServerProcess] = []
        try:
            for j in range(k):  # each process reads its setup while the next one starts
                setup = setup_line(j, k, host=host, token=self.token, store=store, cfg=run.cfg, spec=spec,
                                   pass_steps=pass_steps, downlink_every=downlink_every,
                                   max_message_bytes=max_message_bytes)
                self.procs.append(ServerProcess(j, setup, store.address.lock_fd, timeout_s, self._line))
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
    def _line(self, index: int, msg: dict) -> bool:
        """A record or a failure (True: taken here); anything else is a control answer."""
        if "record" in msg:
            self._record(msg["record"])
            return True
        if "failed" in msg:
            self.fail(f"parameter server process {index}: {msg['failed']}")
            return True
        return False

    def _record(self, line: dict) -> None:
        """Write the records in the order of their ``round`` (the servers number them at once)."""
        t = self.run.cfg.train
        total = max(1, t.epochs * self.run.cursors.epoch_samples // max(1, t.batch_size * t.steps_per_round))
        with self._lock:
            self._held[int(line["round"])] = line
            while self.next_round in self._held:
                rnd = self.next_round
                self.run.write_line(self._held.pop(rnd), progress_at=(rnd, total))
                self.next_round += 1
                self.run.chaos_after(rnd)  # chaos.kill_driver_round: the driver's
                if self.run.cfg.chaos.kill_shard_round == rnd:
                    log.warning("chaos: SIGKILL of parameter server process %s after exchange %s",
                                len(self.procs) - 1, rnd)
                    self.procs[-1].proc.kill()

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
        state = self.run.exchange.state_dict()
        for p in self.procs:
            p.tell({"stage": epoch, "exchange": state})
        for p in self.procs:
            p.answer("planned")

    def end_stage(self, epoch: int) -> None:
        """Every server's part of the stage, merged into the driver's Run."""
        for p in self.procs:
            p.tell({"end": epoch})
        k, run = len(self.procs), self.run
        for p in self.procs:
            part = p.answer("part")
            blocks = [b for b in run.cursors.pass_steps if b % k == p.index]
            run.exchange.take_part(part["exchange"], blocks)
            for name, n in part["counters"].items():
                run.counters.add(name, n)
            before = self.parts.get(p.index, {}).get("executors", {})
            for executor, n in part["executors"].items():
                run.records.count_executor(executor, n - before.get(executor, 0))
            self.parts[p.index] = part

    def front(self) -> dict:
        """The services' part of the summary: their counters summed, addresses and peers."""
        counters: dict = {}
        for part in self.parts.values():
            for key, v in part["service"].items():
                counters[key] = counters.get(key, 0) + v
        return {"stream": counters, "ps_address": ",".join(f"{h}:{p}" for h, p in self.locations),
                "ps_peers": sorted({h for part in self.parts.values() for h in part["peers"]})}

    def close(self) -> None:
        with self._lock:
            self._closing = True
        for p in self.procs:
            p.close()
