"""Run configuration: frozen dataclasses loaded from YAML with overrides.

A config file is a mapping of sections (``run``, ``data``, ``model``, ...);
``--set section.key=value`` overrides one field (the value is parsed as YAML,
so ``--set train.epochs=5`` gives an int). Unknown keys, wrong types and
out-of-range values raise :class:`BadInput` naming the field, e.g.
"compression.density must be in (0, 1], got 1.5".
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field

import yaml

from sparkcnn.errors import BadInput


def _check(cond: bool, key: str, rule: str, value) -> None:
    if not cond:
        raise BadInput(f"{key} must be {rule}, got {value!r}")


@dataclass(frozen=True)
class RunConfig:
    name: str = "sparkcnn"        # run id prefix; the id adds a timestamp
    seed: int = 42                # seeds model init, block shuffles, sparsifier samples
    out_dir: str = "runs"         # runs/<run_id>/ holds config, metrics, model, report
    deterministic: bool = False   # TF op determinism + fixed seeds (sync mode only)

    def validate(self, p: str) -> None:
        _check(bool(self.name) and "/" not in self.name, f"{p}.name", "a non-empty name without '/'", self.name)
        _check(self.seed >= 0, f"{p}.seed", ">= 0", self.seed)


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

    def validate(self, p: str) -> None:
        _check(self.format in ("auto", "prepared", "parquet", "table", "images"), f"{p}.format",
               "one of auto, prepared, parquet, table, images", self.format)
        _check(bool(self.image_col), f"{p}.image_col", "a column name", self.image_col)
        _check(bool(self.label_col), f"{p}.label_col", "a column name", self.label_col)
        _check(self.image_shape == [] or (len(self.image_shape) == 3 and all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in self.image_shape)),
            f"{p}.image_shape", "[H, W, C] of positive integers", self.image_shape)
        _check(all(isinstance(c, (str, int)) for c in self.classes), f"{p}.classes", "a list of names",
               self.classes)
        _check(1 <= self.num_blocks <= 4096, f"{p}.num_blocks", "in [1, 4096]", self.num_blocks)
        _check(1 <= self.test_blocks <= 4096, f"{p}.test_blocks", "in [1, 4096]", self.test_blocks)


@dataclass(frozen=True)
class ModelConfig:
    name: str = "fmnist_cnn"  # builder name (fmnist_cnn, resnet20) or "package.module:function"

    def validate(self, p: str) -> None:
        _check(bool(self.name), f"{p}.name", "a builder name", self.name)


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
        _check(1 <= self.epochs <= 10000, f"{p}.epochs", "in [1, 10000]", self.epochs)
        _check(1 <= self.batch_size <= 65536, f"{p}.batch_size", "in [1, 65536]", self.batch_size)
        _check(1 <= self.steps_per_round <= 100000, f"{p}.steps_per_round", "in [1, 100000]", self.steps_per_round)
        _check(0 < self.lr <= 10, f"{p}.lr", "in (0, 10]", self.lr)
        _check(0 <= self.momentum < 1, f"{p}.momentum", "in [0, 1)", self.momentum)
        _check(0 <= self.weight_decay < 1, f"{p}.weight_decay", "in [0, 1)", self.weight_decay)
        _check(0 <= self.lr_warmup_epochs <= self.epochs, f"{p}.lr_warmup_epochs",
               f"in [0, epochs={self.epochs}]", self.lr_warmup_epochs)
        _check(self.lr_schedule in ("constant", "cosine", "step"), f"{p}.lr_schedule",
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
        _check(self.method in ("none", "threshold", "topk"), f"{p}.method",
               "one of none, threshold, topk", self.method)
        _check(0 < self.density <= 1, f"{p}.density", "in (0, 1]", self.density)
        _check(0 < self.initial_density <= 1, f"{p}.initial_density", "in (0, 1]", self.initial_density)
        _check(self.warmup_epochs >= 0, f"{p}.warmup_epochs", ">= 0", self.warmup_epochs)
        _check(self.value_dtype in ("float16", "float32"), f"{p}.value_dtype",
               "one of float16, float32", self.value_dtype)
        _check(self.dense_below >= 0, f"{p}.dense_below", ">= 0", self.dense_below)
        _check(0 <= self.density_down <= 1, f"{p}.density_down", "in [0, 1]", self.density_down)
        _check(0 <= self.initial_density_down <= 1, f"{p}.initial_density_down", "in [0, 1]",
               self.initial_density_down)
        _check(self.momentum in ("correction", "sparsification_aware"), f"{p}.momentum",
               "one of correction, sparsification_aware", self.momentum)
        _check(self.clip_norm >= 0, f"{p}.clip_norm", ">= 0", self.clip_norm)


@dataclass(frozen=True)
class PSConfig:
    staleness: str = "auto"     # async: none (lambda = 1) | inverse (lambda = 1/tau) | auto: none where the
                                # stream's lookahead compensates the delay (H = 1), else inverse
    max_staleness: int = 8      # async: blocks are held back beyond it; a result arriving staler is dropped
                                # and its steps trained again. The stream raises it to 4 x data.num_blocks
                                # (its own overlap makes tau about 2-3 at 2 blocks), with a log line
    shards: int = 1             # stream: processes keeping the weights, each a contiguous range of whole
                                # tensors (1: the driver alone); the driver still decides every push

    def validate(self, p: str) -> None:
        _check(self.staleness in ("auto", "none", "inverse"), f"{p}.staleness", "one of auto, none, inverse",
               self.staleness)
        _check(self.max_staleness >= 1, f"{p}.max_staleness", ">= 1", self.max_staleness)
        _check(self.shards >= 1, f"{p}.shards", ">= 1", self.shards)


TRANSPORTS = ("auto", "jobs", "stream")


@dataclass(frozen=True)
class EngineConfig:
    mode: str = "sync"          # sync (one treeAggregate job per round) | async (ASGD)
    master: str = ""            # used only when set and no session is active; "": the launcher's, else local[2]
    pipeline: bool = False      # sync: compute round t+1 while the driver applies round t
    tree_depth: int = 2         # treeAggregate depth
    threads: int = 0            # async: jobs in flight, fixed; 0 = live executor slots (load monitor)
    transport: str = "auto"     # jobs (a Spark job per exchange) | stream (a barrier task per block and
                                # epoch exchanging with the driver's parameter-server service) | auto
                                # (jobs on a classic session, stream on Spark Connect)
    stream_timeout_s: float = 60.0  # stream: a task gives up when the server does not answer this long
    max_message_bytes: int = 0  # stream: larger messages are refused unread; 0 = 8 x parameters + 1 MiB

    def validate(self, p: str) -> None:
        _check(self.mode in ("sync", "async"), f"{p}.mode", "one of sync, async", self.mode)
        _check(self.tree_depth >= 1, f"{p}.tree_depth", ">= 1", self.tree_depth)
        _check(self.threads >= 0, f"{p}.threads", ">= 0", self.threads)
        _check(self.transport in TRANSPORTS, f"{p}.transport", "one of " + ", ".join(TRANSPORTS), self.transport)
        _check(self.stream_timeout_s > 0, f"{p}.stream_timeout_s", "> 0", self.stream_timeout_s)
        _check(self.max_message_bytes >= 0, f"{p}.max_message_bytes", ">= 0", self.max_message_bytes)


@dataclass(frozen=True)
class SchedulerConfig:
    target_job_seconds: float = 1.0  # async: size H so one job lasts about this long
    queue_depth: int = 1             # async: jobs queued in Spark beyond the free task slots (when
                                     # there are more blocks than slots), so a freed slot starts one at once
    balance: bool = False            # sync: size H per executor by measured speed so a round's
                                     # tasks finish together (blocks then see different sample counts)

    def validate(self, p: str) -> None:
        _check(self.target_job_seconds > 0, f"{p}.target_job_seconds", "> 0", self.target_job_seconds)
        _check(self.queue_depth >= 0, f"{p}.queue_depth", ">= 0", self.queue_depth)


@dataclass(frozen=True)
class CheckpointConfig:
    every_rounds: int = 0  # 0 = only at epoch ends

    def validate(self, p: str) -> None:
        _check(self.every_rounds >= 0, f"{p}.every_rounds", ">= 0", self.every_rounds)


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
        _check(self.max_norm_factor > 1, f"{p}.max_norm_factor", "> 1", self.max_norm_factor)
        _check(self.loss_spike_factor > 1, f"{p}.loss_spike_factor", "> 1", self.loss_spike_factor)
        _check(self.loss_samples >= 0, f"{p}.loss_samples", ">= 0", self.loss_samples)
        _check(self.warmup_steps >= 0, f"{p}.warmup_steps", ">= 0", self.warmup_steps)
        _check(self.action in ("halve_lr", "raise_density", "stop"), f"{p}.action",
               "one of halve_lr, raise_density, stop", self.action)
        _check(self.max_spikes_in_a_row >= 0, f"{p}.max_spikes_in_a_row", ">= 0", self.max_spikes_in_a_row)
        _check(self.max_chance_in_a_row >= 0, f"{p}.max_chance_in_a_row", ">= 0", self.max_chance_in_a_row)


@dataclass(frozen=True)
class TrackingConfig:
    """Where records go besides metrics.jsonl; each tracker is a sink beside the JSONL one."""

    mlflow: bool = False                 # MLflow run: params, round/epoch metrics, model.keras and summary.json
                                         # (server from MLFLOW_TRACKING_URI; needs the mlflow extra)
    mlflow_experiment: str = "sparkcnn"  # experiment name, created when missing
    tensorboard: bool = False            # scalars per round and per epoch in <run_dir>/tensorboard

    def validate(self, p: str) -> None:
        _check(bool(self.mlflow_experiment), f"{p}.mlflow_experiment", "a non-empty name", self.mlflow_experiment)


@dataclass(frozen=True)
class ChaosConfig:
    """Fault injection, for tests and drills only. Leave at defaults in production."""

    fail_task_probability: float = 0.0  # fail a task's first attempt with this probability
    kill_worker_probability: float = 0.0  # os._exit the Python worker mid-task (first attempts only)
    slow_executor: float = 1.0          # local mode: slow block 0's tasks by this factor (clusters:
                                        # set SPARKCNN_CHAOS_SLOW=<factor> in one worker's environment)
    nan_round: int = -1                 # inject NaN into block 0's delta in this round (-1 = never)
    kill_driver_round: int = -1         # SIGKILL the driver right after this round (-1 = never)
    kill_shard_round: int = -1          # ps.shards > 1: SIGKILL the last shard right after this round
    hold_every: int = 0                 # block 0 holds the result of every n-th exchange (its first
                                        # try) for hold_s seconds, so that it arrives stale (0 = never)
    hold_s: float = 1.0

    def validate(self, p: str) -> None:
        _check(0 <= self.fail_task_probability < 1, f"{p}.fail_task_probability", "in [0, 1)",
               self.fail_task_probability)
        _check(0 <= self.kill_worker_probability < 1, f"{p}.kill_worker_probability", "in [0, 1)",
               self.kill_worker_probability)
        _check(self.slow_executor >= 1, f"{p}.slow_executor", ">= 1", self.slow_executor)
        _check(self.hold_every >= 0, f"{p}.hold_every", ">= 0", self.hold_every)
        _check(self.hold_s >= 0, f"{p}.hold_s", ">= 0", self.hold_s)


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


# a number in exponent form that YAML 1.1 leaves a string: 1e-4, 5E3, 2.e+9
_EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _coerce(key: str, tp, value):
    """Check ``value`` against the annotated field type; ints widen to floats."""
    if tp is bool:
        _check(isinstance(value, bool), key, "true or false", value)
    elif tp is int:
        _check(isinstance(value, int) and not isinstance(value, bool), key, "an integer", value)
    elif tp is float:
        if isinstance(value, str) and _EXPONENT.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads 1e-4 (no dot, or no exponent sign) as a string
        _check(isinstance(value, (int, float)) and not isinstance(value, bool), key, "a number", value)
        value = float(value)
    elif tp is str:
        _check(isinstance(value, str), key, "a string", value)
    elif tp is list:
        _check(isinstance(value, (list, tuple)), key, "a list", value)
        value = list(value)
    return value


def from_dict(data: dict, source: str = "config") -> Config:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise BadInput(f"{source}: top level must be a mapping of sections, got {type(data).__name__}")
    sections = {}
    hints = typing.get_type_hints(Config)
    for name, value in data.items():
        if name not in hints:
            raise BadInput(f"{source}: unknown config key {name!r} (sections: {', '.join(hints)})")
        cls = hints[name]
        if not isinstance(value, dict):
            raise BadInput(f"{source}: {name} must be a mapping, got {value!r}")
        fhints = typing.get_type_hints(cls)
        kwargs = {}
        for k, v in value.items():
            if k not in fhints:
                raise BadInput(f"{source}: unknown config key '{name}.{k}' (known: {', '.join(fhints)})")
            kwargs[k] = _coerce(f"{name}.{k}", fhints[k], v)
        sections[name] = cls(**kwargs)
    return Config(**sections).validate()


def parse_override(text: str) -> tuple[list[str], object]:
    if "=" not in text:
        raise BadInput(f"--set {text!r}: expected section.key=value")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise BadInput(f"--set {text!r}: key must look like section.key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return parts, value


def load(path: str | None = None, overrides: typing.Iterable[str] = ()) -> Config:
    """Load a YAML config file (or the defaults) and apply ``section.key=value`` overrides."""
    data: dict = {}
    source = "--set"
    if path:
        source = path
        from sparkcnn import runfs

        runfs.check(path, "config file")
        try:
            if not runfs.isfile(path):
                raise BadInput(f"config file not found: {path}")
            data = yaml.safe_load(runfs.read_text(path)) or {}
        except OSError as e:
            raise BadInput(f"config file {path}: unreadable ({' '.join(str(e).split())})") from None
        except yaml.YAMLError as e:
            line = getattr(getattr(e, "problem_mark", None), "line", None)
            where = f" line {line + 1}" if line is not None else ""
            raise BadInput(f"{path}{where}: not valid YAML") from None
        if not isinstance(data, dict):
            raise BadInput(f"{path}: top level must be a mapping of sections")
    for text in overrides:
        (sec, key), value = parse_override(text)
        data.setdefault(sec, {})
        if not isinstance(data[sec], dict):
            raise BadInput(f"{source}: {sec} must be a mapping")
        data[sec][key] = value
    return from_dict(data, source)


def file_sets(path: str | None, section: str, key: str) -> bool:
    """Whether the YAML config file at ``path`` gives ``section.key`` itself (a default does not).

    For callers that choose a value when the user chose none; ``path`` was read by
    :func:`load` already, so it exists and parses.
    """
    if not path:
        return False
    with open(path, encoding="utf-8") as fh:
        data = yaml.safe_load(fh) or {}
    return isinstance(data.get(section), dict) and key in data[section]


def dump(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
