"""The only vocabulary between the driver and the executors.

Every message is a frozen dataclass of plain values; nothing crosses as a dict
or a positional tuple, and each field has one meaning. The driver builds a
:class:`TaskSpec` once per run and a :class:`ExchangeOrder` per exchange; a task
answers each order with one :class:`ExchangeResult` per block. Spark hands a task
its context (attempt, cores, GPUs, local directory) and the engine's task
function passes it on as a :class:`TaskContextInfo`, so the worker never
imports pyspark.

Terms: an *exchange* is one order and its results (sync: one round of every
block; async: one job of one block); ``seq`` numbers the exchanges of a run,
and ``(seq, block)`` is the exactly-once key of a result.

Imports the standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields


# block placement's chunk rows as Spark sees them (``mapInArrow`` on the driver; the executors
# build them as ``worker.blocks.CHUNK_SCHEMA``)
SPARK_CHUNK_SCHEMA = "block int, part int, seq int, images binary, labels binary"


def steps_per_epoch(rows: int, batch_size: int) -> int:
    """Full minibatches in one pass over a block of ``rows`` (the last partial one is dropped)."""
    return rows // batch_size


@dataclass(frozen=True)
class TaskContextInfo:
    """What Spark tells a task about itself, copied out of ``TaskContext`` by the engine."""

    attempt: int = 0           # Spark's attempt number of this task (0: first try)
    cores: int = 1             # CPU cores Spark reserved for the task (spark.task.cpus)
    gpus: tuple | None = None  # GPU addresses Spark assigned (spark.task.resource.gpu.amount); () none;
                               # None: not a Spark task (in-process), the process's devices stay as they are
    local_dir: str = ""        # the executor's local directory for block data and state ("" = a temp dir)


@dataclass(frozen=True)
class TaskSpec:
    """Per-run constants shipped to executors (plain values only)."""

    run_id: str
    num_blocks: int          # training blocks (placed by Backend.place)
    test_blocks: int         # test blocks; 0 = no test data (no per-epoch evaluation)
    model_name: str
    input_shape: tuple
    num_classes: int
    seed: int
    batch_size: int
    momentum: float
    weight_decay: float
    layout: tuple            # tensor sizes of the flat parameter vector
    value_dtype: str = "float32"        # wire dtype of uplink values
    method: str = "none"                # compression.method: none | threshold | topk
    dense_below: int = 16384            # tensors smaller than this travel dense
    momentum_mode: str = "correction"   # compression.momentum: correction | sparsification_aware
    per_step: bool = False              # H = 1 with compression: the per-step (gradient) form
    clip_norm: float = 0.0              # per-step form: a block's gradient norm cap (0 = none)
    factor_masking: bool = True         # per-step DGC: zero momentum where sent
    sparse_downlink: bool = False       # compression.density_down > 0: replicas follow DownlinkMsgs
    augment: str = "none"               # data.augment: none | crop_flip, on training minibatches only
    normalize: tuple = ()               # data.normalize=dataset: (mean, std) per channel, [0, 1] units
    # fault injection (chaos.*): tests and drills only
    chaos_fail_p: float = 0.0
    chaos_kill_p: float = 0.0
    chaos_slow: float = 1.0
    chaos_nan_seq: int = -1
    chaos_hold_every: int = 0           # block 0 holds every n-th exchange's result (first try) ...
    chaos_hold_s: float = 0.0           # ... for this many seconds
    deterministic: bool = False
    local_root: str = ""     # overrides TaskContextInfo.local_dir when set (tests)


@dataclass(frozen=True)
class DownlinkMsg:
    """One downlink ``D`` of the parameter server, encoded: moves a replica of ``U``
    from ``base_version`` to ``version``."""

    version: int             # server version after D (the replica's version once applied)
    base_version: int        # version a replica must be at to apply D
    checksum_after: str      # checksum of U after D (hex): the replica verifies it
    assign: bool             # True: U[idx] = values (dense downlink); False: U[idx] += values
    payload: bytes           # codec bytes of D


class InlineWeights:
    """Weights carried in the order itself (tests and hand-built orders); the engines
    use a Spark broadcast, which has the same ``.value``."""

    __slots__ = ("value",)

    def __init__(self, value: bytes):
        self.value = value   # float32 bytes


@dataclass(frozen=True)
class ExchangeOrder:
    """What one exchange asks of its blocks."""

    seq: int                 # exchange number in the run: sync round t, async job j
    steps: dict              # block -> local steps H in this exchange
    step_offset: dict        # block -> cursor: minibatches the block has done since the run began
    lr: float                # learning rate of the local steps (after warm-up, schedule and guard)
    density: float           # uplink density (after warm-up and guard)
    base_version: int        # server version the weights below are at (staleness is measured from it)
    # float32 bytes behind ``.value`` (a broadcast, or InlineWeights): W when the downlink is
    # dense, else the view U, which a replica reads only when it is missing or behind
    weights: object = None
    weights_version: int = 0                # version of those bytes (sparse: the view's version)
    downlinks: tuple = ()                   # sparse downlink: the latest DownlinkMsgs, oldest first
    expect_state: dict = field(default_factory=dict)  # block -> seq of the state it continues from
    state_wait_s: float = 0.0               # pipelined: wait this long for the previous exchange's state
    steps_by_executor: dict = field(default_factory=dict)  # balanced sync: executor -> H (overrides steps)
    return_state: bool = False              # checkpoint exchange: return the block state with the result
    initial_state: dict = field(default_factory=dict)  # block -> state arrays restored from a checkpoint
    # the block's last result was dropped as too stale: reload the view
    resync: bool = False
    block_seq: int = -1                     # async: the block's own job number (-1: seq, as in a sync round)


@dataclass(frozen=True)
class ExchangeResult:
    """One block's answer to an order."""

    block: int
    seq: int                 # the order's seq
    attempt: int             # Spark's attempt number of the task that produced it
    base_version: int        # the order's base_version (the version the delta was computed from)
    payload: bytes           # codec bytes of the sent delta S
    samples: int             # images trained on
    steps: int               # local steps taken
    loss_sum: float          # training loss summed over samples
    correct: int             # correct training predictions
    nnz: int                 # entries in the payload
    prep_s: float            # seconds: block, state and weights ready
    compute_s: float         # seconds: TF steps
    encode_s: float          # seconds: sparsify and encode
    task_s: float            # seconds: the whole task
    state_reset: bool        # the block's state was gone: restarted from zero (counted)
    state_stale: bool        # pipelined: continued from the state one exchange older (counted)
    replica_resync: bool     # the replica of U was reloaded from the dense view (counted)
    view_bytes: int          # bytes of dense weights this task read (0 when it followed downlinks)
    pid: int                 # the Python worker's process id
    executor: str            # "host:local dir" of the executor that ran the task
    lr: float                # learning rate it was trained with (the server applies with it too)
    density: float           # uplink density it was sparsified at
    first_step: int          # the block's cursor at its first step: it trained steps first_step ..
                             # first_step + steps - 1
    gpus: tuple | None = None  # GPU addresses Spark assigned the task (TaskContextInfo.gpus)
    devices: str | None = None  # CUDA_VISIBLE_DEVICES the task's TensorFlow ran with (None: unset)
    state: dict | None = None  # the block's state arrays, when the order asked for them
    sumsq: tuple = ()          # stream with shards: ||S_k||^2 of each shard's piece (payload is b"")
    piece: tuple = ()          # stream with shards: (stream, ordinal), the pieces' key on the shards
    first_step_at: float = 0.0  # wall clock (s since the epoch) when its first step ended; 0: no step


@dataclass(frozen=True)
class Arrival:
    """A block's result as the server takes it, whichever transport carried it: the fields a
    ``ExchangeResult`` (jobs) and a ``Push`` (stream) share, under one name each."""

    block: int
    seq: int                 # with the block, the exactly-once key
    base_version: int        # the version its weights were at
    payload: bytes           # codec bytes of the sent delta S (b"" with shards: its pieces went to them)
    samples: int
    steps: int
    first_step: int          # the block's cursor at its first step
    lr: float                # what it was trained with (the server applies with it too)
    density: float
    loss_sum: float
    correct: int
    nnz: int
    state_reset: bool        # its state was gone: restarted from zero (counted)
    state_stale: bool        # pipelined jobs: continued from the state one exchange older (counted)
    replica_resync: bool     # its replica of U was reloaded from a dense copy (counted)
    view_bytes: int          # dense weight bytes it read
    executor: str
    sumsq: tuple = ()        # with shards: ||S_k||^2 of each shard's piece
    piece: tuple = ()        # with shards: (stream, ordinal), the pieces' key on the shards

    @classmethod
    def of_result(cls, r: "ExchangeResult") -> "Arrival":
        return cls(**{f: getattr(r, f) for f in _ARRIVAL_FIELDS})

    @classmethod
    def of_push(cls, block: int, p: "Push", piece: tuple = ()) -> "Arrival":
        """A stream task always continues from its own state: never a stale one."""
        return cls(block=block, state_stale=False, piece=piece,
                   **{f: getattr(p, f) for f in _ARRIVAL_FIELDS
                      if f not in ("block", "state_stale", "piece")})


@dataclass(frozen=True)
class StreamTicket:
    """Where a stream task finds the driver's parameter server, and its per-run secret."""

    host: str                # the driver's address (spark.driver.host)
    port: int
    token: str = field(repr=False)   # never logged nor sent: the key of every frame's MAC (streamsocket)
    timeout_s: float = 60.0  # a reply slower than this means the server is gone
    shards: tuple = ()       # ps.shards > 1: (host, port) of each key-range shard, in range order


@dataclass(frozen=True)
class EvalResult:
    """One test block evaluated at the given weights."""

    block: int
    samples: int
    loss_sum: float
    correct: int


# -- the streaming transport's messages (sparkcnn.streamwire encodes them field by field) ------------

@dataclass(frozen=True)
class StreamPlan:
    """A block's share of one stream stage, sent when its task opens the stream."""

    seq0: int                # the seq of its first exchange (its last applied one + 1)
    first_step: int          # its cursor: the index of its first step since the run began
    steps: int               # steps to train in this stage
    h: int                   # steps per exchange (train.steps_per_round)
    expect_state: int        # seq of the block state it continues from (-1: none yet)
    lookahead: bool          # compute at the view extrapolated by the measured staleness
    overlap: bool            # compute exchange t + 1 while push t travels (else wait for its reply)
    attempt: int             # how often this stage's stream was opened for the block before (reruns)
    stream: int = 0          # the server's number of this stream (its pieces' key on the shards)


@dataclass(frozen=True)
class StateArray:
    """One array of a block's state (momentum, residual), carried on a push for a checkpoint."""

    name: str
    dtype: str               # numpy dtype name: float32 | float64 | int64
    data: bytes


@dataclass(frozen=True)
class Push:
    """A stream task's exchange: the encoded delta of steps ``first_step .. first_step + steps - 1``."""

    seq: int                 # exchange number of the block (exactly-once key with the block)
    first_step: int          # the block's cursor at its first step
    steps: int               # local steps taken (<= the plan's h)
    samples: int             # images trained on
    base_version: int        # server version its weights were at
    have: int                # version of the task's replica now (the reply sends downlinks since)
    attempt: int             # the stage's rerun count
    lr: float                # learning rate it trained with
    density: float           # uplink density it sparsified at
    loss_sum: float          # training loss summed over samples
    correct: int             # correct training predictions
    nnz: int                 # entries in the payload
    compute_s: float         # seconds of training and encoding
    wait_s: float            # seconds the task waited for the previous reply (exposed communication)
    view_bytes: int          # bytes of the previous reply's weights part
    state_reset: bool        # the block's state was gone: restarted from zero (counted)
    replica_resync: bool     # the replica was reloaded from a dense copy since the last push (counted)
    pid: int                 # the Python worker's process id
    executor: str            # "host:local dir" of the executor
    payload: bytes           # codec bytes of the sent delta S (b"" with shards: its pieces go to them)
    state: tuple[StateArray, ...] = ()  # the block's state after this exchange, when a reply asked
    sumsq: tuple[float, ...] = ()       # with shards: ||S_k||^2 of each shard's piece (the guard's norm)
    overhead_cpu_s: float = 0.0         # the task's CPU outside TensorFlow since its previous push: its
                                        # thread outside the TF calls and its push thread


@dataclass(frozen=True)
class Reply:
    """The server's answer to an open (``plan`` set) or a push."""

    lr: float                # learning rate of the next exchange
    density: float           # uplink density of the next exchange
    tau: int                 # staleness of the block's last applied push (its lookahead)
    retrain: bool            # the push was too stale and dropped: train its steps again from the
                             # state before it (the dense weights below are the fresh view)
    send_state: bool         # attach the block's state to the next push (a checkpoint is due)
    refused: str             # "" or why the message was refused (nothing of it was used)
    dense: bytes             # b"" or float32 weights: W (dense downlink) or a copy of the view U
    dense_version: int       # the version of ``dense``
    downlinks: tuple[DownlinkMsg, ...] = ()  # the downlinks since the push's ``have``, oldest first
    plan: StreamPlan | None = None           # on open: the block's share of the stage


@dataclass(frozen=True)
class StageState:
    """A stream task's block state at the end of its stage, after its last push was answered:
    the state the next stage starts from (and the epoch's checkpoint holds). It travels apart
    from that push so that the push's delta is not made stale by the state's megabytes on a
    slow link; the server keeps it only when ``seq`` is the block's last applied exchange."""

    seq: int
    state: tuple[StateArray, ...]


@dataclass(frozen=True)
class Done:
    """A stream task closes its stream."""


@dataclass(frozen=True)
class StreamTotals:
    """What a stream task returns to the stage when its block's share is done."""

    block: int
    exchanges: int           # pushes applied or dropped (retrained pushes count again)
    samples: int             # images trained on, retrained steps included
    last_seq: int            # its last applied exchange
    exposed_comm_s: float    # seconds it waited for replies
    task_s: float            # seconds the whole task took


# -- key-range shards of the parameter server (sparkcnn.shards) -----------------------------------

@dataclass(frozen=True)
class Piece:
    """A stream task's push, the part of its delta on one shard's range."""

    stream: int              # the coordinator's number of the task's stream
    ordinal: int             # the push's place on that stream (0, 1, ...), as the coordinator counts
    have: int                # version of the task's replica (the answer sends the downlinks since)
    payload: bytes           # codec bytes of S on the shard's range (global indices)


@dataclass(frozen=True)
class PieceRef:
    """A piece the coordinator accepted, with what its whole push was judged and applied with."""

    stream: int
    ordinal: int
    factor: float            # the push's factor: staleness, server scale and 1/N (async)
    samples: int             # its samples (a BSP round weighs its pieces by them)
    sumsq: tuple[float, ...]  # the squared norms the task declared for its pieces (shard j checks
                              # the j-th): one log entry serves every shard


@dataclass(frozen=True)
class Answer:
    """A piece to answer once the log entry carrying it is applied."""

    stream: int
    ordinal: int
    retrain: bool            # its push was dropped or refused: answer with the dense view


@dataclass(frozen=True)
class ShardStep:
    """One entry of the coordinator's log, applied by every shard in the same order."""

    version: int             # the server version after this entry
    apply: tuple[PieceRef, ...] = ()   # pieces applied together as one version (none: version unchanged)
    downlink: float = 0.0    # density of the downlink made after it (0: none)
    answer: tuple[Answer, ...] = ()


@dataclass(frozen=True)
class ShardReply:
    """A shard's part of the reply to a push: its range of the weights part (see :class:`Reply`)."""

    dense: bytes             # b"" or float32 values of the range: W (dense downlink) or the view U
    dense_version: int
    downlinks: tuple[DownlinkMsg, ...] = ()  # the range's parts; checksum_after: its part of the sum


@dataclass(frozen=True)
class ShardInit:
    """The coordinator's first message to a shard: the full-length W and U it starts from."""

    W: bytes                 # float32
    U: bytes                 # float32
    version: int
    view_version: int


@dataclass(frozen=True)
class ShardCut:
    """The coordinator asks for the shard's part of a consistent cut (after every step sent before)."""


@dataclass(frozen=True)
class ShardState:
    """A shard's part of a consistent cut: its range of W and U, at the versions it reached."""

    W: bytes                 # float32, the range only
    U: bytes
    version: int
    view_version: int


_ARRIVAL_FIELDS = tuple(f.name for f in fields(Arrival))
