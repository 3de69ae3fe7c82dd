"""A key-range shard (:mod:`sparkcnn.transport.shard`) as its own process, a stream listener on the
driver's address with the run's secret, and the coordinator's handle on it.

    python -m sparkcnn.transport.shardservice
    stdin    one JSON line (host, token, index, lo, hi, layout, density_down, selector, dense_below,
             value_dtype, keep_downlinks, timeout_s, max_message_bytes); then nothing until the
             coordinator is gone: at EOF the shard closes and exits, so a driver that dies,
             even by SIGKILL, leaves no shard behind
    stdout   one JSON line: {"port": p}
    streams  {"control": true}  the coordinator: ShardInit, then ShardSteps in log order (no
                                replies) and ShardCut (answered by a ShardState after every
                                step sent before it)
             {"stream": s}      a task's pieces, each answered by a ShardReply once the log
                                entry that answers it is applied

Every stream passes the same listener rules as the driver's service
(:mod:`sparkcnn.transport.service`): the secret, the size cap, typed messages.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading

import numpy as np

from sparkcnn import streamsocket
from sparkcnn.transport.service import PSService
from sparkcnn.transport.shard import RangeShard
from sparkcnn.protocol import Piece, ShardCut, ShardInit, ShardReply, ShardState, ShardStep
from sparkcnn.streamwire import decode, encode

log = logging.getLogger(__name__)


class _Control:
    accept = (ShardInit, ShardStep, ShardCut)
    start = None

    def __init__(self, shard: RangeShard):
        self.shard = shard

    def push(self, m):
        s = self.shard
        if isinstance(m, ShardStep):
            s.step(m)
            return None
        if isinstance(m, ShardInit):
            s.load(np.frombuffer(m.W, np.float32), np.frombuffer(m.U, np.float32), m.version, m.view_version)
            return None
        st = s.state()
        return ShardState(W=st["W"].tobytes(), U=st["U"].tobytes(), version=st["version"],
                          view_version=st["view_version"])

    def refused(self, why: str):
        raise RuntimeError(f"shard control stream: {why}")  # the coordinator speaks only well-formed messages


class _Pieces:
    accept = (Piece,)
    start = None

    def __init__(self, shard: RangeShard, stream: int):
        self.shard, self.stream = shard, stream

    def push(self, p: Piece) -> ShardReply:
        if p.stream != self.stream:
            raise ValueError(f"Piece.stream {p.stream} on stream {self.stream}")
        return self.shard.piece(p)

    def refused(self, why: str) -> ShardReply:
        return ShardReply(dense=b"", dense_version=-1)  # the task stops: a refused piece has no answer


class _Handler:
    def __init__(self, shard: RangeShard):
        self.shard = shard

    def open(self, hello: dict):
        if hello.get("control") is True:
            return _Control(self.shard)
        stream = hello["stream"]
        if type(stream) is not int:
            raise TypeError(stream)
        return _Pieces(self.shard, stream)


def main() -> int:
    cfg = json.loads(sys.stdin.readline())
    n = sum(cfg["layout"])
    shard = RangeShard(cfg["lo"], cfg["hi"], np.zeros(n, np.float32), cfg["layout"], index=cfg["index"],
                       density_down=cfg["density_down"], selector=cfg["selector"],
                       dense_below=cfg["dense_below"],
                       value_dtype=cfg["value_dtype"], keep_downlinks=cfg["keep_downlinks"],
                       timeout_s=cfg["timeout_s"])
    service = PSService(cfg["host"], _Handler(shard), cfg["max_message_bytes"], token=cfg["token"])
    print(json.dumps({"port": service.port}), flush=True)
    try:
        sys.stdin.read()  # until the coordinator closes the pipe or dies
    finally:
        # a dead coordinator's streams may still look open: give the listener a moment, then go
        closing = threading.Thread(target=service.close, daemon=True)
        closing.start()
        closing.join(5)
        if closing.is_alive():
            sys.stdout.flush()
            os._exit(0)
    return 0


class ShardProcess:
    """The coordinator's handle on one shard process: start, the log, cuts, close."""

    def __init__(self, host: str, token: str, index: int, lo: int, hi: int, layout, *,
                 density_down: float | None,
                 selector: str, dense_below: int, value_dtype: str, keep_downlinks: int, timeout_s: float,
                 max_message_bytes: int):
        self.host, self.lo, self.hi, self.timeout_s = host, lo, hi, timeout_s
        self.proc = subprocess.Popen([sys.executable, "-m", "sparkcnn.transport.shardservice"],
                                     stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        cfg = dict(host=host, token=token, index=index, lo=lo, hi=hi, layout=list(layout),
                   density_down=density_down,
                   selector=selector, dense_below=dense_below, value_dtype=value_dtype,
                   keep_downlinks=keep_downlinks, timeout_s=timeout_s, max_message_bytes=max_message_bytes)
        self.proc.stdin.write(json.dumps(cfg) + "\n")
        self.proc.stdin.flush()
        line = _read_line(self.proc.stdout, timeout_s)
        if not line:
            self.proc.kill()
            raise RuntimeError(f"shard [{lo}, {hi}) did not start (exit {self.proc.wait()})")
        self.port = int(json.loads(line)["port"])
        self.conn = streamsocket.connect(host, self.port, token, json.dumps({"control": True}).encode(),
                                         timeout_s)
        self.lock = threading.Lock()

    @property
    def location(self) -> tuple[str, int]:
        return self.host, self.port

    def send(self, msg) -> None:
        """ShardInit or ShardStep, in log order."""
        self.send_bytes(encode(msg))

    def send_bytes(self, buf: bytes) -> None:
        """An encoded ShardStep (the same bytes for every shard)."""
        with self.lock:
            self.conn.write(buf)

    def cut(self) -> ShardState:
        """The shard's part of a cut, after every step sent before."""
        with self.lock:
            self.conn.write(encode(ShardCut()))
            return decode(self.conn.read(), (ShardState,))

    def close(self) -> None:
        self.conn.close()
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()  # EOF: the shard closes its listener and exits
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _read_line(stream, timeout_s: float) -> str:
    out: list[str] = []
    t = threading.Thread(target=lambda: out.append(stream.readline()), daemon=True)
    t.start()
    t.join(timeout_s)
    return out[0] if out else ""


if __name__ == "__main__":
    sys.exit(main())
