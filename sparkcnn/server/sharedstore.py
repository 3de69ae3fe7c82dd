"""One copy of the parameter server's state for K server processes: ``W``, ``U``, the version
counters, the checksum of ``U`` and the downlink log, in one shared-memory segment on the
driver's host (docs/transports.md, "Several server processes").

Layout of the segment (numpy views on it; nothing in it is pickled)::

    header   int64[16]   version, view version, checksum of U (its bits), the writer's pid,
                         downlinks appended in all, log bytes appended in all, the run's
                         applied exchanges and samples (a Run's Progress), the guard's lr and
                         density factors (float64 bits: a Schedule's Factors)
    W, U     float32[P]  each 64-byte aligned
    slots    int64[S, 6] the latest S downlinks: version, base version, checksum, assign,
                         start (in log bytes appended in all; -1: not kept), length
    ring     uint8[4 P]  their payloads, a byte ring
    cands    int64[P/2]  the candidate set of the sparse downlink (where W moved since the last
                         one, sorted runs; :class:`sparkcnn.ps_downlink.CandidateSet`): every
                         process's applies join it, so any process's downlink may use it

The critical section (:class:`StoreLock`) is a thread lock for a process's own threads and a
POSIX record lock (``fcntl.lockf``) on a file every process holds open, for the processes. Every
write of the segment is inside it, so the version is one counter all processes bump atomically,
in the same section that moves ``W``. A push takes it once (:meth:`StoreLock.section`), from its
apply to its reply's weights, every entry between them nested in that one. The kernel drops a
record lock when its holder dies, so a killed process never deadlocks the others; the header's
writer word (the holder's pid, cleared on the way out) tells the next holder that the segment was
left mid-write (:class:`StoreTorn`).

Why the ring holds 4 P bytes: a reply sends the downlinks since a replica's version only when
they weigh less than a dense copy of U, 4 P bytes (:meth:`sparkcnn.server.downlink.Downlink.since`),
so every chain a reply would send fits in it; an older chain is a dense copy anyway.

The process that creates the segment owns it (it unlinks it at :meth:`SharedStore.close`; the
multiprocessing resource tracker unlinks it if that process is killed). Processes that attach do
not: they leave the tracker out of it, or its exit would unlink a segment still in use.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import threading
import weakref
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import numpy as np

from sparkcnn.protocol import DownlinkMsg
from sparkcnn.replica import checksum

VERSION, VIEW_VERSION, CHECKSUM, WRITER, LOG_COUNT, LOG_END, EXCHANGES, SAMPLES, LR, DENSITY = range(10)
CANDS, CAND_RUNS = 10, 11  # entries in the candidate set (-1: unknown), and its runs
HEADER_WORDS = 16
SLOT_VERSION, SLOT_BASE, SLOT_CHECKSUM, SLOT_ASSIGN, SLOT_START, SLOT_LENGTH = range(6)
ALIGN = 64


class StoreTorn(RuntimeError):
    """A process died inside the store's critical section: ``W`` or ``U`` may be half-written."""


@dataclass(frozen=True)
class StoreAddress:
    """What a process needs to attach to a store: the segment's name, its sizes and the lock's
    file descriptor (inherited from the creator: ``subprocess.Popen(pass_fds=...)``)."""

    name: str
    size: int       # P, parameters
    slots: int      # S, downlinks the log keeps
    lock_fd: int


def _offsets(size: int, slots: int) -> tuple[int, int, int, int, int, int]:
    """Byte offsets of W, U, the slots, the ring and the candidates, and the segment's length."""
    def up(n: int) -> int:
        return -(-n // ALIGN) * ALIGN

    w = up(8 * HEADER_WORDS)
    u = up(w + 4 * size)
    sl = up(u + 4 * size)
    ring = up(sl + 8 * 6 * slots)
    cands = up(ring + 4 * size)
    return w, u, sl, ring, cands, cands + 8 * (size // 2 + 1)


class _Segment(shared_memory.SharedMemory):
    """A shared-memory segment that may outlive its object: numpy views of it (the driver's final
    W) keep it mapped, and a close while they live is left to them, not raised at exit."""

    def __del__(self):
        try:
            self.close()
        except BufferError:
            pass


class SharedCandidates:
    """The candidate set of :class:`sparkcnn.ps_downlink.CandidateSet`, in the segment (its
    methods; the parameter server calls them inside the store's critical section)."""

    def __init__(self, header: np.ndarray, buf: np.ndarray, limit: int, lock):
        self._header, self._buf, self.limit, self._lock = header, buf, limit, lock

    @property
    def known(self) -> bool:
        return int(self._header[CANDS]) >= 0

    @property
    def runs(self) -> int:
        return int(self._header[CAND_RUNS])

    def add(self, idx: np.ndarray) -> None:
        with self._lock:
            n = int(self._header[CANDS])
            if n < 0:
                return
            if n + idx.size > self.limit:  # no downlink for long: a scan is cheaper
                self.forget()
                return
            self._buf[n:n + idx.size] = idx
            self._header[CANDS], self._header[CAND_RUNS] = n + idx.size, self.runs + 1

    def forget(self) -> None:
        with self._lock:
            self._header[CANDS] = -1

    def restart(self, c: np.ndarray) -> None:
        with self._lock:
            if c.size > self._buf.size:  # more than it holds: the next downlink scans
                self.forget()
                return
            self._buf[:c.size] = c
            self._header[CANDS], self._header[CAND_RUNS] = c.size, 1

    def indices(self) -> np.ndarray:
        with self._lock:
            return self._buf[:int(self._header[CANDS])].copy()  # the caller may sort it in place


class StoreLock:
    """The store's critical section (module docstring): reentrant within a thread.

    :meth:`section`: a span of a thread's work (one push) in which the section, once the thread
    takes it, is kept until the span ends, so that its apply, counts, downlink and reply take the
    record lock once (each entry from outside costs two ``lockf`` calls and the writer word)."""

    def __init__(self, fd: int, header: np.ndarray):
        self._fd, self._header = fd, header
        self._threads = threading.RLock()
        self._depth = 0  # nesting of the thread that holds it
        self._spans: dict[int, bool] = {}  # thread -> its open span keeps the section (False: not taken yet)

    def __enter__(self) -> "StoreLock":
        self._threads.acquire()
        if self._depth == 0:
            try:
                fcntl.lockf(self._fd, fcntl.LOCK_EX)
            except BaseException:
                self._threads.release()
                raise
            writer = int(self._header[WRITER])
            if writer:
                fcntl.lockf(self._fd, fcntl.LOCK_UN)
                self._threads.release()
                raise StoreTorn(f"parameter-server process {writer} died while it held the shared weights: "
                                "they may be half-written")
            self._header[WRITER] = os.getpid()
            me = threading.get_ident()
            if self._spans.get(me) is False:  # kept until the span ends: one level more
                self._spans[me] = True
                self._threads.acquire()
                self._depth += 1
        self._depth += 1
        return self

    @contextlib.contextmanager
    def section(self):
        """Within it, this thread keeps the section from its first entry to the end (class
        docstring); nothing is taken before that entry (a push's decode runs outside)."""
        me = threading.get_ident()
        self._spans[me] = False
        try:
            yield self
        finally:
            if self._spans.pop(me):
                self.__exit__(None, None, None)

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._header[WRITER] = 0
            fcntl.lockf(self._fd, fcntl.LOCK_UN)
        self._threads.release()


class SharedStore:
    """The memory of a :class:`~sparkcnn.ps.ParameterServer` (its ``memory=``) shared by processes,
    its downlink log (a :class:`~sparkcnn.server.downlink.Downlink`'s ``log=``), the run's
    progress (the :class:`~sparkcnn.server.exchange.Progress` of a Run's cursors) and the guard's
    factors (the :class:`~sparkcnn.server.downlink.Factors` of a Run's schedule)."""

    def __init__(self, shm: _Segment, address: StoreAddress, owner: bool):
        self._shm, self.address, self._owner = shm, address, owner
        P, S = address.size, address.slots
        w, u, sl, ring, cands, _ = _offsets(P, S)
        buf = shm.buf
        self._header = np.frombuffer(buf, np.int64, HEADER_WORDS)
        self.W = np.frombuffer(buf, np.float32, P, w)
        self.U = np.frombuffer(buf, np.float32, P, u)
        self._slots = np.frombuffer(buf, np.int64, 6 * S, sl).reshape(S, 6)
        self._ring = np.frombuffer(buf, np.uint8, 4 * P, ring)
        self.lock = StoreLock(address.lock_fd, self._header)
        self.candidate_set = SharedCandidates(self._header, np.frombuffer(buf, np.int64, P // 2 + 1, cands),
                                              P // 4, self.lock)

    @classmethod
    def create(cls, weights: np.ndarray, slots: int) -> "SharedStore":
        """A new segment holding ``W = U = weights`` at version 0, keeping ``slots`` downlinks."""
        weights = np.asarray(weights, np.float32)
        if weights.ndim != 1 or not weights.size or slots < 1:
            raise ValueError(f"a shared store needs a 1-D float32 vector and slots >= 1, got "
                             f"{weights.shape} and {slots}")
        fd, path = tempfile.mkstemp(prefix="sparkcnn-ps-")
        os.unlink(path)  # the descriptor is the lock: nothing to clean up on disk, even after a kill
        shm = _Segment(create=True, size=_offsets(weights.size, slots)[-1])
        store = cls(shm, StoreAddress(shm.name, int(weights.size), int(slots), fd), owner=True)
        weakref.finalize(store, os.close, fd)  # the lock's descriptor goes with the store
        with store.lock:  # a new segment is all zeros: no writer, no downlink
            np.copyto(store.W, weights)
            np.copyto(store.U, weights)
            store.load(0, 0, checksum(store.U))
            store.load_factors(1.0, 1.0)
            store.candidate_set.restart(np.empty(0, np.int64))  # W == U: nowhere to send
        return store

    @classmethod
    def attach(cls, address: StoreAddress) -> "SharedStore":
        """The store another process created (``address.lock_fd`` inherited from it)."""
        shm = _Segment(address.name)
        # attaching registered the segment with this process's resource tracker, which would
        # unlink it when this process exits: it is the creator's to unlink
        resource_tracker.unregister("/" + address.name, "shared_memory")
        return cls(shm, address, owner=False)

    # -- the memory of a ParameterServer (sparkcnn.ps.LocalMemory's methods) ------------------------
    @property
    def version(self) -> int:
        return int(self._header[VERSION])

    @property
    def view_version(self) -> int:
        return int(self._header[VIEW_VERSION])

    @property
    def checksum(self) -> int:
        return int(self._header[CHECKSUM:CHECKSUM + 1].view(np.uint64)[0])

    def bump(self) -> int:
        with self.lock:
            self._header[VERSION] += 1
            return int(self._header[VERSION])

    def viewed(self, checksum_after: int) -> None:
        with self.lock:
            self._header[VIEW_VERSION] = self._header[VERSION]
            self._header[CHECKSUM:CHECKSUM + 1].view(np.uint64)[0] = checksum_after

    def load(self, version: int, view_version: int, checksum_u: int) -> None:
        with self.lock:
            self._header[VERSION], self._header[VIEW_VERSION] = version, view_version
            self._header[CHECKSUM:CHECKSUM + 1].view(np.uint64)[0] = checksum_u
            self._header[LOG_COUNT] = self._header[LOG_END] = 0  # the downlinks kept are forgotten

    # -- the run's progress (sparkcnn.server.exchange.Progress's methods) ------------------------------
    @property
    def exchanges(self) -> int:
        return int(self._header[EXCHANGES])

    @property
    def samples(self) -> int:
        return int(self._header[SAMPLES])

    def count(self) -> int:
        with self.lock:
            self._header[EXCHANGES] += 1
            return int(self._header[EXCHANGES]) - 1

    def add_samples(self, n: int) -> None:
        with self.lock:
            self._header[SAMPLES] += n

    def load_progress(self, exchanges: int, samples: int) -> None:
        with self.lock:
            self._header[EXCHANGES], self._header[SAMPLES] = exchanges, samples

    # -- the guard's factors (sparkcnn.server.downlink.Factors's methods) -------------------------------
    @property
    def lr(self) -> float:
        return float(self._header[LR:LR + 1].view(np.float64)[0])

    @property
    def density(self) -> float:
        return float(self._header[DENSITY:DENSITY + 1].view(np.float64)[0])

    def scale(self, lr: float = 1.0, density: float = 1.0, density_max: float = float("inf")) -> None:
        with self.lock:
            self.load_factors(self.lr * lr, min(density_max, self.density * density))

    def load_factors(self, lr: float, density: float) -> None:
        with self.lock:
            self._header[LR:DENSITY + 1].view(np.float64)[:] = (lr, density)

    # -- the downlink log (sparkcnn.server.downlink.InlineLog's methods) -----------------------------
    @property
    def keep(self) -> int:
        return self.address.slots

    def resize(self, keep: int) -> None:
        if keep > self.address.slots:
            raise ValueError(f"the shared downlink log keeps {self.address.slots} downlinks, not {keep}")

    def append(self, msg: DownlinkMsg) -> None:
        """The next downlink, in version order (the caller holds the lock across D and this)."""
        with self.lock:
            h, ring, data = self._header, self._ring, msg.payload
            n, end, length = int(h[LOG_COUNT]), int(h[LOG_END]), len(data)
            start = -1
            if length <= ring.size:
                pos = end % ring.size
                first = min(length, ring.size - pos)
                raw = np.frombuffer(data, np.uint8)
                ring[pos:pos + first] = raw[:first]
                ring[:length - first] = raw[first:]
                start, h[LOG_END] = end, end + length
            slot = self._slots[n % self.address.slots]
            slot[:] = (msg.version, msg.base_version, 0, int(msg.assign), start, length)
            slot[SLOT_CHECKSUM:SLOT_CHECKSUM + 1].view(np.uint64)[0] = int(msg.checksum_after, 16)
            h[LOG_COUNT] = n + 1

    def since(self, have: int) -> tuple[DownlinkMsg, ...]:
        """The downlinks kept that reach past version ``have``, oldest first (copies)."""
        with self.lock:
            n, end = int(self._header[LOG_COUNT]), int(self._header[LOG_END])
            out = []
            for i in range(n - 1, max(n - self.address.slots, 0) - 1, -1):
                slot = self._slots[i % self.address.slots]
                if slot[SLOT_VERSION] <= have:
                    break
                start, length = int(slot[SLOT_START]), int(slot[SLOT_LENGTH])
                if start < 0 or start < end - self._ring.size:  # its bytes are gone: so are the older
                    break
                out.append(self._message(slot, start, length))
            return tuple(reversed(out))

    def latest(self) -> tuple[DownlinkMsg, ...]:
        return self.since(-1)

    def _message(self, slot: np.ndarray, start: int, length: int) -> DownlinkMsg:
        pos = start % self._ring.size
        first = min(length, self._ring.size - pos)
        payload = self._ring[pos:pos + first].tobytes() + self._ring[:length - first].tobytes()
        check = int(slot[SLOT_CHECKSUM:SLOT_CHECKSUM + 1].view(np.uint64)[0])
        return DownlinkMsg(version=int(slot[SLOT_VERSION]), base_version=int(slot[SLOT_BASE]),
                           checksum_after=f"{check:016x}", assign=bool(slot[SLOT_ASSIGN]), payload=payload)

    # -- the end -------------------------------------------------------------------------------------
    def close(self) -> None:
        """The creator unlinks the segment: no process attaches to it any more, and the memory goes
        with the last mapping. This process's store stays readable until it is collected (the
        driver reads its final W, version and factors after the run); then the mapping and, for
        the creator, the lock's descriptor are released."""
        if self._owner:
            self._owner = False
            self._shm.unlink()
