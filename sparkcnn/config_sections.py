"""The run configuration's sections: one frozen dataclass each, every field with its meaning and unit.

:class:`Config` holds one of each section (``run``, ``data``, ``model``, ...).
``validate()`` checks every field and the rules across sections, raising
:class:`BadInput` that names the field, e.g. "compression.density must be in
(0, 1], got 1.5". Loading from YAML and ``--set`` overrides live in :mod:`sparkcnn.config`.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from sparkcnn.errors import BadInput

log = logging.getLogger(__name__)

# Pillow refuses to open an image over twice its Image.MAX_IMAGE_PIXELS (~179 M pixels), whatever
# data.max_image_pixels allows
MAX_IMAGE_PIXELS_LIMIT = 2 * (1024 * 1024 * 1024 // 4 // 3)


def check_field(cond: bool, key: str, rule: str, value) -> None:
    """BadInput "<key> must be <rule>, got <value>" unless ``cond``."""
    if not cond:
        raise BadInput(f"{key} must be {rule}, got {value!r}")


@dataclass(frozen=True)
class RunConfig:
    name: str = "sparkcnn"        # run id prefix; the id adds a timestamp
    seed: int = 42                # seeds model init, block shuffles, sparsifier samples
    out_dir: str = "runs"         # runs/<run_id>/ holds config, metrics, model, report
    deterministic: bool = False   # TF op determinism + fixed seeds (sync mode only)

    def validate(self, p: str) -> None:
        check_field(bool(self.name) and "/" not in self.name, f"{p}.name", "a non-empty name without '/'",
                    self.name)
        check_field(self.seed >= 0, f"{p}.seed", ">= 0", self.seed)


@dataclass(frozen=True)
class DataConfig:
    path: str = "data/fashion-mnist"  # path, URI or table Spark reads: a prepared dataset (<path>/train and
                                      # <path>/test), Parquet, a table, or a folder of images per class
    format: str = "auto"              # auto | prepared | parquet | table | images (auto: from the path)
    test_path: str = ""               # held-out data for per-epoch test accuracy ("": a prepared
                                      # dataset's test split, else none)
    image_col: str = "image"          # binary uint8 HWC, array<float> in [0, 1], or Spark's image struct
    label_col: str = "label"          # integer class index
    image_shape: list = field(default_factory=list)  # [H, W, C] of binary / array<float> images
                                      # when the column's metadata does not say
    classes: list = field(default_factory=list)      # class names; []: metadata, else 0..max(label)
    num_blocks: int = 2               # data blocks = Spark partitions of the training set
    test_blocks: int = 2              # partitions of the test set for distributed evaluation
    max_image_pixels: int = 25_000_000  # image folders: an image over this many pixels (H*W, read from
                                      # its header) is refused before decoding (a PNG of 1 MB can hold
                                      # 900 M pixels); at most Pillow's own limit, MAX_IMAGE_PIXELS_LIMIT
    augment: str = "none"             # training batches only, on the executors: none | crop_flip (4 zero
                                      # pixels of padding, a random crop back to H x W, a random left-right
                                      # flip; the CIFAR recipe), drawn per (run.seed, block, epoch, step)
    normalize: str = "none"           # none | dataset: the model's first layer centres and scales each
                                      # channel by the training split's mean and std, which only a
                                      # prepared dataset stores (its metadata); evaluation sees it too

    def validate(self, p: str) -> None:
        check_field(self.format in ("auto", "prepared", "parquet", "table", "images"), f"{p}.format",
                    "one of auto, prepared, parquet, table, images", self.format)
        check_field(bool(self.image_col), f"{p}.image_col", "a column name", self.image_col)
        check_field(bool(self.label_col), f"{p}.label_col", "a column name", self.label_col)
        check_field(self.image_shape == [] or (len(self.image_shape) == 3 and all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in self.image_shape)),
            f"{p}.image_shape", "[H, W, C] of positive integers", self.image_shape)
        check_field(all(isinstance(c, (str, int)) for c in self.classes), f"{p}.classes", "a list of names",
                    self.classes)
        check_field(1 <= self.num_blocks <= 4096, f"{p}.num_blocks", "in [1, 4096]", self.num_blocks)
        check_field(1 <= self.test_blocks <= 4096, f"{p}.test_blocks", "in [1, 4096]", self.test_blocks)
        check_field(1 <= self.max_image_pixels <= MAX_IMAGE_PIXELS_LIMIT, f"{p}.max_image_pixels",
                    f"in [1, {MAX_IMAGE_PIXELS_LIMIT}]", self.max_image_pixels)
        check_field(self.augment in ("none", "crop_flip"), f"{p}.augment", "one of none, crop_flip",
                    self.augment)
        check_field(self.normalize in ("none", "dataset"), f"{p}.normalize", "one of none, dataset",
                    self.normalize)


@dataclass(frozen=True)
class ModelConfig:
    name: str = "fmnist_cnn"  # builder name (fmnist_cnn, resnet20) or "package.module:function"

    def validate(self, p: str) -> None:
        check_field(bool(self.name), f"{p}.name", "a builder name", self.name)


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 3                 # passes over the training set
    batch_size: int = 64            # images per local SGD step, per block
    steps_per_round: int = 50       # H: local steps between communications (amortises ~0.1-0.3 s/job)
    lr: float = 0.05                # peak learning rate per block (SGD)
    momentum: float = 0.9           # SGD momentum; state is per block and persists across rounds
    weight_decay: float = 0.0       # L2 coefficient added to the gradient
    lr_warmup_epochs: float = 0.3   # linear warm-up from lr/10, in epochs
    lr_schedule: str = "cosine"     # constant | cosine | step (decay after warm-up)

    def validate(self, p: str) -> None:
        check_field(1 <= self.epochs <= 10000, f"{p}.epochs", "in [1, 10000]", self.epochs)
        check_field(1 <= self.batch_size <= 65536, f"{p}.batch_size", "in [1, 65536]", self.batch_size)
        check_field(1 <= self.steps_per_round <= 100000, f"{p}.steps_per_round", "in [1, 100000]",
                    self.steps_per_round)
        check_field(0 < self.lr <= 10, f"{p}.lr", "in (0, 10]", self.lr)
        check_field(0 <= self.momentum < 1, f"{p}.momentum", "in [0, 1)", self.momentum)
        check_field(0 <= self.weight_decay < 1, f"{p}.weight_decay", "in [0, 1)", self.weight_decay)
        check_field(0 <= self.lr_warmup_epochs <= self.epochs, f"{p}.lr_warmup_epochs",
                    f"in [0, epochs={self.epochs}]", self.lr_warmup_epochs)
        check_field(self.lr_schedule in ("constant", "cosine", "step"), f"{p}.lr_schedule",
                    "one of constant, cosine, step", self.lr_schedule)


@dataclass(frozen=True)
class CompressionConfig:
    method: str = "none"            # none (dense deltas) | threshold (sampled estimate) | topk (exact)
    density: float = 0.001          # target fraction of entries sent per tensor per round (uplink)
    initial_density: float = 0.25   # density at the start of the warm-up
    warmup_epochs: float = 0.0      # exponential density decay initial -> target over this many epochs
    value_dtype: str = "float16"    # wire dtype of values: float16 (2 B) | float32 (4 B)
    dense_below: int = 16384        # tensors with fewer elements (biases, BatchNorm) travel dense
    density_down: float = 0.0       # downlink density; 0 = dense model broadcast
    initial_density_down: float = 0.0  # downlink density at the start of the warm-up; 0 = initial_density
    momentum: str = "correction"    # correction (DGC masking) | sparsification_aware
    clip_norm: float = 2.0          # per-step form: DGC local gradient clipping, each block's gradient
                                    # L2 norm capped at clip_norm / sqrt(num_blocks); 0 = off. Without it
                                    # per-step async collapsed to chance in 6 of 20 tiny-set runs
    factor_masking: bool = True     # per-step correction: DGC's momentum factor masking (false: momentum
                                    # correction alone, the momentum of sent entries kept)

    def validate(self, p: str) -> None:
        check_field(self.method in ("none", "threshold", "topk"), f"{p}.method",
                    "one of none, threshold, topk", self.method)
        check_field(0 < self.density <= 1, f"{p}.density", "in (0, 1]", self.density)
        check_field(0 < self.initial_density <= 1, f"{p}.initial_density", "in (0, 1]", self.initial_density)
        check_field(self.warmup_epochs >= 0, f"{p}.warmup_epochs", ">= 0", self.warmup_epochs)
        check_field(self.value_dtype in ("float16", "float32"), f"{p}.value_dtype",
                    "one of float16, float32", self.value_dtype)
        check_field(self.dense_below >= 0, f"{p}.dense_below", ">= 0", self.dense_below)
        check_field(0 <= self.density_down <= 1, f"{p}.density_down", "in [0, 1]", self.density_down)
        check_field(0 <= self.initial_density_down <= 1, f"{p}.initial_density_down", "in [0, 1]",
                    self.initial_density_down)
        check_field(self.momentum in ("correction", "sparsification_aware"), f"{p}.momentum",
                    "one of correction, sparsification_aware", self.momentum)
        check_field(self.clip_norm >= 0, f"{p}.clip_norm", ">= 0", self.clip_norm)


@dataclass(frozen=True)
class PSConfig:
    staleness: str = "auto"     # async: none (lambda = 1) | inverse (lambda = 1/tau) | auto: none where the
                                # stream's lookahead compensates the delay (H = 1), else inverse
    max_staleness: int = 8      # async: blocks are held back beyond it; a result arriving staler is dropped
                                # and its steps trained again. On the async stream at least 4 x
                                # data.num_blocks: raised to that, with a log line (stream_staleness_floor)
    shards: int = 1             # stream: processes keeping the weights, each a contiguous range of whole
                                # tensors (1: the driver alone); the driver still decides every push
    servers: int = 1            # async stream: server processes, each serving the blocks b with
                                # b mod servers = its index, over one copy of the weights in shared
                                # memory on the driver's host (1: the driver alone; docs/transports.md)
    downlink_every: int = 0     # async: applied results per downlink; 0 = ceil(num_blocks / 2), the
                                # cadence that keeps a replica's bytes down at about twice its own up
                                # (server/exchange.py); 1 = after every result (bench/cadence.py)
    downlink_candidates: bool = True  # sparse float16 downlink: choose D among the entries updates
                                # touched since the last one (false: scan all P entries of W - U each
                                # time; the same downlinks bitwise, slower; bench/drivercpu.py). The
                                # driver's server only: shard processes always use the candidates

    def validate(self, p: str) -> None:
        check_field(self.staleness in ("auto", "none", "inverse"), f"{p}.staleness",
                    "one of auto, none, inverse", self.staleness)
        check_field(self.max_staleness >= 1, f"{p}.max_staleness", ">= 1", self.max_staleness)
        check_field(self.shards >= 1, f"{p}.shards", ">= 1", self.shards)
        check_field(self.servers >= 1, f"{p}.servers", ">= 1", self.servers)
        check_field(self.downlink_every >= 0, f"{p}.downlink_every", ">= 0", self.downlink_every)


TRANSPORTS = ("auto", "jobs", "stream")


@dataclass(frozen=True)
class EngineConfig:
    mode: str = "sync"          # sync (one treeAggregate job per round) | async (ASGD)
    master: str = ""            # used only when set and no session is active; "": the launcher's, else
                                # local[2]
    pipeline: bool = False      # sync: compute round t+1 while the driver applies round t
    tree_depth: int = 2         # treeAggregate depth
    threads: int = 0            # async: jobs in flight, fixed; 0 = live executor slots (load monitor)
    transport: str = "auto"     # jobs (a Spark job per exchange) | stream (a barrier task per block and
                                # epoch exchanging with the driver's parameter-server service) | auto
                                # (jobs on a classic session, stream on Spark Connect)
    stream_timeout_s: float = 60.0  # stream: a task gives up when the server does not answer this long
    max_message_bytes: int = 0  # stream: larger messages are refused unread; 0 = 8 x parameters + 1 MiB

    def validate(self, p: str) -> None:
        check_field(self.mode in ("sync", "async"), f"{p}.mode", "one of sync, async", self.mode)
        check_field(self.tree_depth >= 1, f"{p}.tree_depth", ">= 1", self.tree_depth)
        check_field(self.threads >= 0, f"{p}.threads", ">= 0", self.threads)
        check_field(self.transport in TRANSPORTS, f"{p}.transport", "one of " + ", ".join(TRANSPORTS),
                    self.transport)
        check_field(self.stream_timeout_s > 0, f"{p}.stream_timeout_s", "> 0", self.stream_timeout_s)
        check_field(self.max_message_bytes >= 0, f"{p}.max_message_bytes", ">= 0", self.max_message_bytes)


@dataclass(frozen=True)
class SchedulerConfig:
    target_job_seconds: float = 1.0  # async: size H so one job lasts about this long
    queue_depth: int = 1             # async: jobs queued in Spark beyond the free task slots (when
                                     # there are more blocks than slots), so a freed slot starts one at once
    balance: bool = False            # sync: size H per executor by measured speed so a round's
                                     # tasks finish together (blocks then see different sample counts)

    def validate(self, p: str) -> None:
        check_field(self.target_job_seconds > 0, f"{p}.target_job_seconds", "> 0", self.target_job_seconds)
        check_field(self.queue_depth >= 0, f"{p}.queue_depth", ">= 0", self.queue_depth)


@dataclass(frozen=True)
class CheckpointConfig:
    every_rounds: int = 0  # 0 = only at epoch ends

    def validate(self, p: str) -> None:
        check_field(self.every_rounds >= 0, f"{p}.every_rounds", ">= 0", self.every_rounds)


@dataclass(frozen=True)
class GuardConfig:
    max_norm_factor: float = 10.0   # reject a block's delta whose L2 norm exceeds this x running median
    loss_spike_factor: float = 3.0  # a pooled loss above this x running median is a spike
    loss_samples: int = 1024        # exchanges pooled until they hold this many samples, then judged
    warmup_steps: int = 100         # local steps (all blocks) before the norm rule judges: momentum builds
                                    # up over ~1/(1 - m) = 10 steps per block, so the first per-step deltas
                                    # are up to 10x smaller than later ones (H = 1: 20-40 rejected without)
    action: str = "halve_lr"        # on a spike: halve_lr | raise_density | stop (exit 3)
    max_spikes_in_a_row: int = 3    # judged losses spiking in a row despite the action: stop (exit 3);
                                    # 0 = never (a collapsed run then goes on at chance level)
    max_chance_in_a_row: int = 10   # judged losses back at chance level in a row: stop (exit 3); 0 = never.
                                    # More than the spikes': a sound overshoot can pass slowly through ln C

    def validate(self, p: str) -> None:
        check_field(self.max_norm_factor > 1, f"{p}.max_norm_factor", "> 1", self.max_norm_factor)
        check_field(self.loss_spike_factor > 1, f"{p}.loss_spike_factor", "> 1", self.loss_spike_factor)
        check_field(self.loss_samples >= 0, f"{p}.loss_samples", ">= 0", self.loss_samples)
        check_field(self.warmup_steps >= 0, f"{p}.warmup_steps", ">= 0", self.warmup_steps)
        check_field(self.action in ("halve_lr", "raise_density", "stop"), f"{p}.action",
                    "one of halve_lr, raise_density, stop", self.action)
        check_field(self.max_spikes_in_a_row >= 0, f"{p}.max_spikes_in_a_row", ">= 0",
                    self.max_spikes_in_a_row)
        check_field(self.max_chance_in_a_row >= 0, f"{p}.max_chance_in_a_row", ">= 0",
                    self.max_chance_in_a_row)


@dataclass(frozen=True)
class TrackingConfig:
    """Where records go besides metrics.jsonl; each tracker is a sink beside the JSONL one."""

    mlflow: bool = False                 # MLflow run: params, round/epoch metrics, model.keras and
                                         # summary.json (server from MLFLOW_TRACKING_URI; needs the
                                         # mlflow extra)
    mlflow_experiment: str = "sparkcnn"  # experiment name, created when missing
    tensorboard: bool = False            # scalars per round and per epoch in <run_dir>/tensorboard

    def validate(self, p: str) -> None:
        check_field(bool(self.mlflow_experiment), f"{p}.mlflow_experiment", "a non-empty name",
                    self.mlflow_experiment)


@dataclass(frozen=True)
class ChaosConfig:
    """Fault injection, for tests and drills only. Leave at defaults in production."""

    fail_task_probability: float = 0.0  # fail a task's first attempt with this probability
    kill_worker_probability: float = 0.0  # os._exit the Python worker mid-task (first attempts only)
    slow_executor: float = 1.0          # local mode: slow block 0's tasks by this factor (clusters:
                                        # set SPARKCNN_CHAOS_SLOW=<factor> in one worker's environment)
    nan_round: int = -1                 # inject NaN into block 0's delta in this round (-1 = never)
    kill_driver_round: int = -1         # SIGKILL the driver right after this round (-1 = never)
    kill_shard_round: int = -1          # ps.shards or ps.servers > 1: SIGKILL the last shard or server
                                        # process right after this round
    hold_every: int = 0                 # block 0 holds the result of every n-th exchange (its first
                                        # try) for hold_s seconds, so that it arrives stale (0 = never)
    hold_s: float = 1.0

    def validate(self, p: str) -> None:
        check_field(0 <= self.fail_task_probability < 1, f"{p}.fail_task_probability", "in [0, 1)",
                    self.fail_task_probability)
        check_field(0 <= self.kill_worker_probability < 1, f"{p}.kill_worker_probability", "in [0, 1)",
                    self.kill_worker_probability)
        check_field(self.slow_executor >= 1, f"{p}.slow_executor", ">= 1", self.slow_executor)
        check_field(self.hold_every >= 0, f"{p}.hold_every", ">= 0", self.hold_every)
        check_field(self.hold_s >= 0, f"{p}.hold_s", ">= 0", self.hold_s)


@dataclass(frozen=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    ps: PSConfig = field(default_factory=PSConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    chaos: ChaosConfig = field(default_factory=ChaosConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        # here, not in validate(), so that every Config has it: from_dict's, replace()'s (a transport
        # resolved from auto to stream) and one built by hand
        floor = stream_staleness_floor(self)
        if floor is not None:
            log.info("ps.max_staleness %s raised to %s on the stream: "
                     "its own overlap makes pushes that stale", self.ps.max_staleness, floor)
            object.__setattr__(self, "ps", dataclasses.replace(self.ps, max_staleness=floor))

    def validate(self) -> "Config":
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate(f.name)
        if self.compression.momentum == "sparsification_aware" and self.train.steps_per_round != 1:
            raise BadInput("compression.momentum=sparsification_aware needs train.steps_per_round=1 "
                           f"(the per-step form), got {self.train.steps_per_round}")
        if (self.engine.transport == "stream" and self.engine.mode == "async" and self.ps.staleness == "none"
                and self.train.steps_per_round > 1):
            # measured, 2 epochs at H = 10: 0.758 with lambda = 1 (deltas rejected by the guard), 0.835
            # with lambda = 1/tau; with the lookahead on as well it collapsed to 0.1
            raise BadInput("ps.staleness=none diverges on the async stream at train.steps_per_round > 1 "
                           f"(got {self.train.steps_per_round}): use auto or inverse")
        if self.ps.shards > 1 and self.engine.transport != "stream":
            raise BadInput(f"ps.shards={self.ps.shards} needs engine.transport=stream: the jobs transport "
                           "applies results in the driver")
        if self.ps.servers > 1:
            check_servers(self)
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **sections) -> "Config":
        """Copy with whole sections or ``section__key=value`` fields replaced."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for k, v in sections.items():
            if "__" in k:
                sec, key = k.split("__", 1)
                out[sec] = dataclasses.replace(out[sec], **{key: v})
            else:
                out[k] = v
        return Config(**out).validate()


def check_servers(cfg: Config) -> None:
    """``ps.servers`` > 1: what the server processes support (one-line errors naming the key)."""
    k, why = cfg.ps.servers, None
    if cfg.engine.transport != "stream" or cfg.engine.mode != "async":
        why = ("needs engine.transport=stream and engine.mode=async: a sync round would be held by "
               "several processes")
    elif cfg.ps.shards > 1:
        why = f"and ps.shards={cfg.ps.shards} are two layouts of the server: choose one"
    elif k > cfg.data.num_blocks:
        why = f"exceeds data.num_blocks={cfg.data.num_blocks}: a server would serve no block"
    if why:
        raise BadInput(f"ps.servers={k} {why}")


def stream_staleness_floor(cfg: Config) -> int | None:
    """``4 · data.num_blocks`` when ``cfg`` runs the async stream with a lower ``ps.max_staleness``;
    else None (also when either value is malformed: validate() then names it).

    The stream's own overlap alone (a step computing while the last push travels) makes tau
    about 2-3 at 2 blocks: a lower bound would drop pushes for the stream's own lag and train
    their steps again.
    """
    if cfg.engine.transport != "stream" or cfg.engine.mode != "async":
        return None
    bound, blocks = cfg.ps.max_staleness, cfg.data.num_blocks
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (bound, blocks)):
        return None
    floor = 4 * blocks
    return floor if bound < floor else None
