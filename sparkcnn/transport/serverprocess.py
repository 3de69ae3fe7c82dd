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
             and EOF when the driver is done or gone: the service closes and the process exits,
             so a driver that dies, even by SIGKILL, leaves no server behind
    stdout   {"port": p}; then one JSON line per applied exchange ({"record": <its metrics.jsonl
             line>}), {"failed": why} when a push fails the run, and the answers above

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

from sparkcnn.config import from_dict
from sparkcnn.protocol import TaskSpec
from sparkcnn.server.run import Run, RunShape
from sparkcnn.server.sharedstore import SharedStore, StoreAddress
from sparkcnn.transport.pushes import PushHandler
from sparkcnn.transport.service import PSService
from sparkcnn.transport.stage import Stage
from sparkcnn.transport.streamcut import Cut

log = logging.getLogger(__name__)


class Channel:
    """The process's stdout to the driver: one JSON line per message, whole, from any thread."""

    def __init__(self, stream):
        self._stream, self._lock = stream, threading.Lock()

    def send(self, msg: dict) -> None:
        line = json.dumps(msg) + "\n"
        with self._lock:
            self._stream.write(line)
            self._stream.flush()

    # a Run's record sink (Records.write's): each applied exchange's line goes to the driver
    def write(self, line: dict) -> None:
        self.send({"record": line})

    # the push handler's backend: a failed push stops the run, which the driver's backend does
    def stop(self) -> None:
        self.send({"failed": "a push failed in a parameter-server process (its log says why)"})

    resident = True  # the driver's backend reads block states; this one never does


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
        self.run = Run(cfg, spec, self.store.W, shape,
                       backend=None, evaluate=None, shared=self.store)
        self.run.open_records(channel)
        stage = Stage(cfg.train.steps_per_round, lookahead=overlap, overlap=overlap)
        cut = Cut(self.run, stage, channel, spec, self.blocks, cfg.engine.stream_timeout_s)
        mine = {b: passes[b] for b in self.blocks}
        self.handler = PushHandler(cfg, spec, self.run, stage, cut, channel, mine)
        self.service = PSService(setup["host"], self.handler, int(setup["max_message_bytes"]),
                                 token=setup["token"])

    def control(self, msg: dict) -> dict:
        """The driver's control line (module docstring) -> the answer."""
        h, run = self.handler, self.run
        if "stage" in msg:
            with h.lock:  # no push is in flight: the driver starts the tasks once every server answered
                run.exchange.load_state_dict({**msg["exchange"], "staleness_hist": {}})
                run.counters.load(dict.fromkeys(run.counters.as_dict(), 0))
                h.stage.restore(int(msg["stage"]), {})
            h.plan_stage()
            return {"planned": msg["stage"]}
        with h.lock:
            part = {"exchange": run.exchange.state_dict(), "counters": run.counters.as_dict(),
                    "executors": dict(run.records.executors), "service": dict(self.service.counters),
                    "peers": sorted(self.service.peer_hosts)}
        return {"ended": msg["end"], "part": part}

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
            channel.send(server.control(json.loads(line)))
    finally:
        server.close()
    return 0


def setup_line(index: int, servers: int, *, host: str, token: str, store: SharedStore, cfg, spec,
               pass_steps: dict, downlink_every: int, max_message_bytes: int) -> str:
    """The setup line of server ``index`` of ``servers`` (module docstring). The driver keeps the
    chaos drills that strike the driver or a server process: the servers' config leaves them out."""
    quiet = dataclasses.replace(cfg.chaos, kill_driver_round=-1, kill_shard_round=-1)
    return json.dumps({"index": index, "servers": servers, "host": host, "token": token,
                       "store": dataclasses.asdict(store.address),
                       "config": dataclasses.replace(cfg, chaos=quiet).to_dict(),
                       "spec": dataclasses.asdict(spec),
                       "pass_steps": {str(b): n for b, n in pass_steps.items()},
                       "downlink_every": downlink_every, "max_message_bytes": max_message_bytes}) + "\n"


if __name__ == "__main__":
    sys.exit(main())
