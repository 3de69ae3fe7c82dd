"""One of the K parameter-server processes of ``ps.servers`` > 1: the service in front of a
:class:`~sparkcnn.server.run.Run` of its own, over the run's one :class:`SharedStore` of the
weights (docs/transports.md, "Several server processes").

    python -m sparkcnn.transport.serverprocess
    stdin    one JSON line (the setup: the server's index, the driver's address and the run's token,
             the store's address, the config, the task spec, the blocks' passes); then the
             driver's control lines:
               {"stage": e, "exchange": <Exchange.state_dict()>}   plan stage e for its blocks
                                                                     -> {"planned": e}
               {"end": e}    the stage's tasks ended -> {"ended": e, "part": <what it did in it>}
               {"begin_cut": true}   another server's apply made a checkpoint due: gather a cut
               {"cut_done": [position, exchanges, cost_s]}   the driver wrote it: its blocks go on
             and EOF when the driver is done or gone: the service closes and the process exits,
             so a driver that dies, even by SIGKILL, leaves no server behind
    stdout   {"port": p}; then one line per applied exchange, its round, a space and its
             metrics.jsonl line as this process encodes it (:func:`record_line`), in batches
             (:class:`Channel`); {"failed": why} when a push fails the run, the answers above, and
             for a checkpoint inside a stage {"cut_begin": true} (its apply made one due) and
             {"cut_part": <its part>} once every block of its own has sent its state (or has none
             to send), the states written as .npy files in the run's cut folder

A cut inside a stage (:class:`ServerCut`) is the single server's (:class:`Cut`) over this
server's blocks, except that it does not write the checkpoint: it sends its part to the driver,
and its blocks' replies are held until the driver has every server's part, has written the
checkpoint, and says so. No block of any server can then be pushing: the checkpoint holds
exactly the pushes up to each block's state push.

Block b is this server's when b mod K is its index: its stage plans only those, so its
service opens streams for them alone, and only their cursors move in its Run. Everything the
Run shares with the other servers (W, U, the versions, the downlink log, the count of applied
exchanges and samples) is in the store; the rest of its state it reports to the driver at
each stage's end, starting every stage from the driver's merged state.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import threading

import numpy as np

from sparkcnn.config import from_dict
from sparkcnn.metrics import encode_line
from sparkcnn.protocol import TaskSpec
from sparkcnn.server.run import Run, RunShape
from sparkcnn.server.sharedstore import SharedStore, StoreAddress
from sparkcnn.transport.pushes import PushHandler
from sparkcnn.transport.service import PSService
from sparkcnn.transport.stage import Stage
from sparkcnn.transport.streamcut import Cut

log = logging.getLogger(__name__)
SETTLE_S = 5.0  # at a stage's end, how long the streams of its ended tasks may take to be counted
FLUSH_S = 0.05  # longest an applied exchange's record waits before it goes to the driver, in seconds


def record_line(record: dict) -> str:
    """An applied exchange's record as the driver reads it: its ``round``, a space, and its
    ``metrics.jsonl`` line (:func:`~sparkcnn.metrics.encode_line`, encoded once, here): the driver
    puts it in order by the round and writes the rest as it is."""
    return f"{record['round']} {encode_line(record)}"


def read_record(line: str) -> tuple[int, str]:
    """(round, metrics.jsonl line) of a :func:`record_line`; ValueError for any other line."""
    head, _, encoded = line.partition(" ")
    if not head.isdigit() or not encoded.startswith("{"):
        raise ValueError(f"not a record line: {line[:80]!r}")
    return int(head), encoded


class Channel:
    """The process's stdout to the driver: one line per message, whole, from any thread.

    Records are batched: each is kept until the next control line, or until ``FLUSH_S`` after
    the first one kept (a thread of its own flushes them), and goes with them in one write, in
    order. The driver's reader then wakes once per batch, not once per push (a wake-up of that
    thread costs the driver more CPU than writing the record it brings). A control line goes at
    once, after the records before it: a cut's part or a stage's end follows every record it
    covers."""

    def __init__(self, stream):
        self._stream = stream
        self._cond = threading.Condition()  # the stream's lock; the flusher waits on it for records
        self._batch: list[str] = []         # record lines not yet written
        threading.Thread(target=self._flush_late, name="sparkcnn-records", daemon=True).start()

    def send(self, msg: dict) -> None:
        line = json.dumps(msg) + "\n"
        with self._cond:
            self._batch.append(line)
            self._flush()

    # a Run's record sink (Records.write's): each applied exchange's line goes to the driver
    def write(self, line: dict) -> None:
        text = record_line(line)
        with self._cond:
            self._batch.append(text)
            if len(self._batch) == 1:
                self._cond.notify()

    def flush(self) -> None:
        with self._cond:
            self._flush()

    def _flush(self) -> None:
        if self._batch:
            self._stream.write("".join(self._batch))
            self._stream.flush()
            self._batch.clear()

    def _flush_late(self) -> None:
        with self._cond:
            while True:
                self._cond.wait_for(lambda: self._batch)
                self._cond.wait(FLUSH_S)  # the records of the next FLUSH_S join the first
                self._flush()

    # the push handler's backend: a failed push stops the run, which the driver's backend does
    def stop(self) -> None:
        self.send({"failed": "a push failed in a parameter-server process (its log says why)"})

    resident = True  # the driver's backend reads block states; this one never does


class ServerCut(Cut):
    """A cut of this server's blocks inside a stage, for a checkpoint the driver writes (module
    docstring). ``cut_dir``: where its blocks' states go as .npy files."""

    def __init__(self, server, stage, channel: Channel, spec, blocks, timeout_s: float, cut_dir: str):
        super().__init__(server, stage, channel, spec, blocks, timeout_s)
        self.channel, self.cut_dir = channel, cut_dir
        self.sent = False  # this server's part of the open cut went to the driver

    def begin(self, relayed: bool = False) -> None:
        """Gather a cut; unless the driver ``relayed`` it, tell the driver (which tells the others)."""
        if self.states is None:
            super().begin()
            self.sent = False
            if not relayed:
                self.channel.send({"cut_begin": True})
        if all(self._settled(k) for k in self.blocks):  # nothing of its own to wait for
            self.send_part()

    def gather(self, cond, failed) -> None:
        """Hold this block until the driver wrote the checkpoint (sending this server's part once
        every block of its own is settled)."""
        states = self.states
        if all(self._settled(k) for k in self.blocks):
            self.send_part()
        if not cond.wait_for(lambda: self.states is not states or failed(), timeout=self.timeout_s):
            log.warning("checkpoint at exchange %s: no word from the driver in time; this server's "
                        "blocks go on", self.server.exchange.exchanges)
            self.reset()

    def wait_written(self, cond, failed) -> None:
        """Once this server's part is sent, no push of it is taken until the driver wrote the
        checkpoint: a block that had not pushed in the stage would otherwise move W past its part."""
        states = self.states
        if self.sent and states is not None:
            cond.wait_for(lambda: self.states is not states or failed(), timeout=self.timeout_s)

    def send_part(self) -> None:
        """This server's part of the cut: its Run's part and its blocks' states (as .npy files)."""
        if self.sent:
            return
        self.sent, st, files = True, self.stage, {}
        for k in self.blocks:
            state = self.states.get(k, st.final.get(k, st.start.get(k)))
            for name, a in (state or {}).items():
                path = os.path.join(self.cut_dir, f"b{k}-{name}.npy")
                np.save(path, np.asarray(a, np.float32), allow_pickle=False)
                files.setdefault(str(k), {})[name] = path
        self.channel.send({"cut_part": {**part(self.server, None), "states": files}})

    def done(self, cond, position: int, exchanges: int, cost_s: float) -> None:
        """The driver wrote checkpoint ``position``: the held blocks go on, and the cadence
        starts from it."""
        if position >= 0:  # -1: the driver skipped it
            self.server.checkpoints.noted(position, exchanges, cost_s)
        self.reset()
        cond.notify_all()


def part(run: Run, service: PSService | None) -> dict:
    """A server's part of its stage so far: its Run's state (the stage's staleness and counters),
    the executors it served, its service's counters and peers."""
    out = {"exchange": run.exchange.state_dict(), "counters": run.counters.as_dict(),
           "executors": dict(run.records.executors)}
    if service is not None:
        out.update(service=dict(service.counters), peers=sorted(service.peer_hosts))
    return out


def task_spec(d: dict) -> TaskSpec:
    """A TaskSpec from its JSON form (lists back to the tuples its fields hold)."""
    def tuples(v):
        return tuple(tuples(x) for x in v) if isinstance(v, list) else v

    return TaskSpec(**{k: tuples(v) for k, v in d.items()})


class BlockServer:
    """The server of the blocks b with b mod K = ``index``: a Run, its push handler and service."""

    def __init__(self, setup: dict, channel: Channel):
        cfg, spec = from_dict(setup["config"]), task_spec(setup["spec"])
        k, index = int(setup["servers"]), int(setup["index"])
        self.store = SharedStore.attach(StoreAddress(**setup["store"]))
        passes = {int(b): int(n) for b, n in setup["pass_steps"].items()}
        self.blocks = sorted(b for b in passes if b % k == index)
        overlap = cfg.train.steps_per_round == 1  # as the driver's StreamEngine lays the run out
        shape = RunShape(passes, bsp=False, compensated=overlap, downlink_every=int(setup["downlink_every"]),
                         keep_broadcasts=0, inline_downlinks=self.store.keep)
        # a run_dir only for the cadence of checkpoints inside a stage: the driver writes them
        self.run = Run(cfg, spec, self.store.W, shape, backend=None, evaluate=None, shared=self.store,
                       run_dir=setup["run_dir"] if cfg.checkpoint.every_rounds > 0 else None)
        self.run.open_records(channel, keep=False)  # the driver keeps the run's history
        stage = Stage(cfg.train.steps_per_round, lookahead=overlap, overlap=overlap)
        cut = ServerCut(self.run, stage, channel, spec, self.blocks, cfg.engine.stream_timeout_s,
                        setup["cut_dir"])
        mine = {b: passes[b] for b in self.blocks}
        self.handler = PushHandler(cfg, spec, self.run, stage, cut, channel, mine)
        self.service = PSService(setup["host"], self.handler, int(setup["max_message_bytes"]),
                                 token=setup["token"])

    def control(self, msg: dict) -> dict | None:
        """The driver's control line (module docstring) -> the answer (None: none)."""
        h, run = self.handler, self.run
        if "begin_cut" in msg:
            with h.lock:
                h.cut.begin(relayed=True)
            return None
        if "cut_done" in msg:
            with h.lock:
                h.cut.done(h.cond, *msg["cut_done"])
            return None
        if "stage" in msg:
            with h.lock:  # no push is in flight: the driver starts the tasks once every server answered
                run.exchange.load_state_dict({**msg["exchange"], "staleness_hist": {}})
                run.counters.load(dict.fromkeys(run.counters.as_dict(), 0))
                h.stage.restore(int(msg["stage"]), {})
            h.plan_stage()
            return {"planned": msg["stage"]}
        self.service.settle(SETTLE_S)  # the stage's streams counted: their tasks sent Done already
        with h.lock:
            return {"ended": msg["end"], "part": part(run, self.service)}

    def close(self) -> None:
        # a dead driver's streams may still look open: give the listener a moment, then go
        closing = threading.Thread(target=self.service.close, daemon=True)
        closing.start()
        closing.join(5)
        if closing.is_alive():
            sys.stdout.flush()
            os._exit(0)
        self.store.close()


def main() -> int:
    setup = json.loads(sys.stdin.readline())
    channel = Channel(sys.stdout)
    server = BlockServer(setup, channel)
    channel.send({"port": server.service.port})
    try:
        for line in sys.stdin:  # until the driver closes the pipe or dies
            answer = server.control(json.loads(line))
            if answer is not None:
                channel.send(answer)
    finally:
        channel.flush()
        server.close()
    return 0


def setup_line(index: int, servers: int, *, host: str, token: str, store: SharedStore, cfg, spec,
               pass_steps: dict, downlink_every: int, max_message_bytes: int, run_dir: str | None,
               cut_dir: str) -> str:
    """The setup line of server ``index`` of ``servers`` (module docstring). The driver keeps the
    chaos drills that strike the driver or a server process: the servers' config leaves them out."""
    quiet = dataclasses.replace(cfg.chaos, kill_driver_round=-1, kill_shard_round=-1)
    return json.dumps({"index": index, "servers": servers, "host": host, "token": token,
                       "store": dataclasses.asdict(store.address),
                       "config": dataclasses.replace(cfg, chaos=quiet).to_dict(),
                       "spec": dataclasses.asdict(spec),
                       "pass_steps": {str(b): n for b, n in pass_steps.items()},
                       "downlink_every": downlink_every, "max_message_bytes": max_message_bytes,
                       "run_dir": run_dir, "cut_dir": cut_dir}) + "\n"


if __name__ == "__main__":
    sys.exit(main())
