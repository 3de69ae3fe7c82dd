"""Executor-side round: replica, TF local steps, per-block state, delta encoding.

Worker round for block ``k`` starting from the replica ``V`` (version ``b``)::

    for h in range(H):  V = sgd_momentum_step(V, batch(k, epoch, round, h))
    delta = V_start - V_after          # lr-scaled update; positive means "subtract"
    payload = encode(delta)            # dense now; sparse with error feedback later

The Keras model, optimizer and ``tf.function`` are built once per Python
worker process and reused across rounds (TF import and tracing cost seconds).
Everything a task needs arrives as plain values in ``TaskSpec`` and
``RoundOrder``; nothing here imports Spark.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from sparkcnn import blockstore
from sparkcnn.compression import codec
from sparkcnn.compression.delta import SparseDelta

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TaskSpec:
    """Per-run constants shipped to executors (plain values only)."""

    run_id: str
    train_dir: str
    test_dir: str
    num_blocks: int
    test_blocks: int
    model_name: str
    input_shape: tuple
    num_classes: int
    seed: int
    batch_size: int
    momentum: float
    weight_decay: float
    layout: tuple            # tensor sizes of the flat parameter vector
    value_dtype: str = "float32"
    method: str = "none"     # compression.method: none | threshold | topk
    dense_below: int = 16384 # tensors smaller than this travel dense
    momentum_mode: str = "correction"  # correction | sparsification_aware (steps_per_round = 1)
    per_step: bool = False   # steps_per_round = 1 with compression: the DGC per-step form
    # fault injection (chaos.*): tests and drills only
    chaos_fail_p: float = 0.0
    chaos_kill_p: float = 0.0
    chaos_slow: float = 1.0
    chaos_nan_round: int = -1
    deterministic: bool = False
    local_root: str = ""     # "" = the executor's Spark local directory


@dataclass(frozen=True)
class RoundOrder:
    """What one round asks of every block."""

    round: int
    epoch: int
    round_in_epoch: int
    steps: dict              # block -> local steps H for this round
    step_offset: dict        # block -> cursor: minibatches this block has done since epoch 0
    lr: float
    base_version: int
    expect_state: dict = field(default_factory=dict)  # block -> round tag of its last applied state
    density: float = 1.0     # uplink density for this round (after warm-up)
    state_wait_s: float = 0.0  # pipelined: wait this long for the previous round's block state
    steps_by_executor: dict = field(default_factory=dict)  # balanced sync: executor -> H (overrides steps)
    return_state: bool = False  # checkpoint round: return the block state with the result
    initial_state: dict = field(default_factory=dict)  # block -> state arrays restored from a checkpoint
    # sparse downlink (weights == b""): recent downlinks as (version, base_version,
    # checksum_after, assign, encoded delta), and a broadcast of the dense view U at
    # view_version that a replica reads only when it is missing or behind
    downlinks: tuple = ()
    view: object = None
    view_version: int = 0
    weights: bytes = b""     # dense float32 W inline (an order built by hand); the engines broadcast it
    # dense downlink: W as a broadcast (bytes), read by each Python worker from the executor's
    # copy; inline in the job's closure it would cross py4j as base64 text and be re-serialised
    # into every task (measured: ~3x the driver JVM's CPU per round at 225 k parameters)
    weights_bcast: object = None


@functools.lru_cache(maxsize=8)
def _epoch_permutation(n: int, seed: int, epoch: int, block: int) -> np.ndarray:
    perm = np.random.default_rng([seed, epoch, block]).permutation(n)
    perm.setflags(write=False)
    return perm


def batch_indices(n: int, batch_size: int, seed: int, epoch: int, block: int, step: int) -> np.ndarray:
    """Rows of minibatch ``step`` of ``block`` in ``epoch``: a seeded permutation, sliced."""
    return _epoch_permutation(n, seed, epoch, block)[step * batch_size:(step + 1) * batch_size]


def steps_per_epoch(n: int, batch_size: int) -> int:
    return n // batch_size


class Trainer:
    """One Keras model + SGD-momentum optimizer + compiled step, per process and model."""

    def __init__(self, spec: TaskSpec):
        import tensorflow as tf
        import keras
        from sparkcnn.models import build_model

        self.tf = tf
        self.model = build_model(spec.model_name, spec.input_shape, spec.num_classes, spec.seed)
        self.weights = list(self.model.weights)
        self.trainable = list(self.model.trainable_weights)
        self.opt = keras.optimizers.SGD(learning_rate=0.01, momentum=spec.momentum)
        self.opt.build(self.trainable)
        self.momentums = [self.opt.momentums[self.opt._get_variable_index(v)] for v in self.trainable]
        self.sizes = [int(np.prod(v.shape)) for v in self.weights]
        offsets = np.concatenate([[0], np.cumsum(self.sizes)])
        self.offsets = offsets
        self.trainable_pos = [self._index_of(v) for v in self.trainable]
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        wd = float(spec.weight_decay)
        model, trainable, opt = self.model, self.trainable, self.opt

        def forward_backward(x, y):
            with tf.GradientTape() as tape:
                logits = model(x, training=True)
                loss = loss_fn(y, logits)
            grads = tape.gradient(loss, trainable)
            if wd:
                grads = [g + wd * v for g, v in zip(grads, trainable)]
            correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), y), tf.int32))
            return loss, correct, grads

        # no XLA: measured ~2x slower than plain graph mode for fmnist_cnn on CPU
        @tf.function(reduce_retracing=True)
        def train_step(x, y):
            loss, correct, grads = forward_backward(x, y)
            opt.apply(grads, trainable)
            return loss, correct

        @tf.function(reduce_retracing=True)
        def eval_step(x, y):
            logits = model(x, training=False)
            loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(tf.cast(y, tf.int32), logits))
            correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), y), tf.int32))
            return loss, correct

        grad_step = tf.function(forward_backward, reduce_retracing=True)

        self.train_step, self.eval_step, self.grad_step = train_step, eval_step, grad_step

        # Copies between the variables and one flat float32 vector, one TF call per direction
        # (traced on first use) instead of a Keras assign/numpy per variable: ~3 ms a round
        # instead of ~10 (fmnist_cnn) for weights and momentum.
        flat_spec = [tf.TensorSpec([int(offsets[-1])], tf.float32)]
        shapes = [tuple(w.shape) for w in self.weights]
        momentum_of = dict(zip(self.trainable_pos, self.momentums))

        def parts(flat):
            return [tf.reshape(p, s) for p, s in zip(tf.split(flat, self.sizes), shapes)]

        @tf.function(input_signature=flat_spec)
        def set_weights(flat):
            for w, p in zip(self.weights, parts(flat)):
                w.assign(tf.cast(p, w.dtype))

        @tf.function(input_signature=flat_spec)
        def set_momentum(flat):
            for i, p in enumerate(parts(flat)):
                if i in momentum_of:
                    momentum_of[i].assign(tf.cast(p, momentum_of[i].dtype))

        @tf.function(input_signature=[])
        def get_weights():
            return tf.concat([tf.reshape(tf.cast(w, tf.float32), [-1]) for w in self.weights], 0)

        @tf.function(input_signature=[])
        def get_momentum():
            return tf.concat([tf.reshape(tf.cast(momentum_of[i], tf.float32), [-1]) if i in momentum_of
                              else tf.zeros([n], tf.float32) for i, n in enumerate(self.sizes)], 0)

        self._set_weights, self._set_momentum = set_weights, set_momentum
        self._get_weights, self._get_momentum = get_weights, get_momentum

    def _index_of(self, var) -> int:
        for i, w in enumerate(self.weights):
            if w is var:
                return i
        raise KeyError(var.path)

    def get_flat(self) -> np.ndarray:
        return self._get_weights().numpy()

    def set_flat(self, flat: np.ndarray) -> None:
        self._set_weights(np.asarray(flat, np.float32))

    def get_momentum(self) -> np.ndarray:
        """Momentum as a flat vector over all weights (zeros at non-trainable entries)."""
        return self._get_momentum().numpy()

    def set_momentum(self, flat: np.ndarray | None) -> None:
        if flat is None:
            flat = np.zeros(self.offsets[-1], np.float32)
        self._set_momentum(np.asarray(flat, np.float32))

    def train(self, images: np.ndarray, labels: np.ndarray, batches: list[np.ndarray], lr: float):
        """Run one SGD step per batch; returns (summed loss·samples, correct, samples)."""
        self.opt.learning_rate.assign(lr)
        loss_sum, correct, seen = 0.0, 0, 0
        for idx in batches:
            loss, c = self.train_step(images[idx], labels[idx])
            loss_sum += float(loss) * len(idx)
            correct += int(c)
            seen += len(idx)
        return loss_sum, correct, seen

    def gradient(self, images: np.ndarray, labels: np.ndarray, idx: np.ndarray):
        """Flat gradient (zeros at non-trainable entries), loss and correct count for one batch."""
        loss, correct, grads = self.grad_step(images[idx], labels[idx])
        flat = np.zeros(self.offsets[-1], np.float32)
        for g, i in zip(grads, self.trainable_pos):
            flat[self.offsets[i]:self.offsets[i + 1]] = g.numpy().ravel()
        return flat, float(loss) * len(idx), int(correct), len(idx)

    @functools.cached_property
    def non_trainable_mask(self) -> np.ndarray:
        mask = np.ones(self.offsets[-1], bool)
        for i in self.trainable_pos:
            mask[self.offsets[i]:self.offsets[i + 1]] = False
        return mask

    def evaluate(self, images: np.ndarray, labels: np.ndarray, batch: int = 1000):
        loss_sum, correct = 0.0, 0
        for a in range(0, len(labels), batch):
            loss, c = self.eval_step(images[a:a + batch], labels[a:a + batch])
            loss_sum += float(loss)
            correct += int(c)
        return loss_sum, correct, len(labels)


_TRAINERS: dict[tuple, Trainer] = {}


def _configure_tf(cores: int, deterministic: bool) -> None:
    """Match TF's thread pools to the task's cores; must run before TF's first op."""
    import tensorflow as tf

    try:
        tf.config.threading.set_intra_op_parallelism_threads(max(1, cores))
        tf.config.threading.set_inter_op_parallelism_threads(1)
    except RuntimeError:  # already initialised in this process
        pass
    if deterministic:
        tf.config.experimental.enable_op_determinism()


def task_gpus() -> list[str]:
    """GPU addresses Spark assigned to this task (spark.task.resource.gpu.amount), else []."""
    try:
        from pyspark import TaskContext

        tc = TaskContext.get()
        res = tc.resources() if tc is not None else {}
        return list(res["gpu"].addresses) if "gpu" in res else []
    except (ImportError, AttributeError, KeyError):
        return []


def get_trainer(spec: TaskSpec, cores: int = 1) -> Trainer:
    key = (spec.model_name, spec.input_shape, spec.num_classes, spec.seed, spec.momentum, spec.weight_decay)
    tr = _TRAINERS.get(key)
    if tr is None:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        gpus = task_gpus()
        if gpus and "tensorflow" not in sys.modules:
            # restrict TF to the GPUs Spark assigned before TF initialises (fine grain of the
            # multi-granularity design); without GPUs TF runs on CPU with the task's cores
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        _configure_tf(cores, spec.deterministic)
        tr = _TRAINERS[key] = Trainer(spec)
    return tr


def task_cores() -> int:
    try:
        from pyspark import TaskContext

        tc = TaskContext.get()
        if tc is not None:
            return int(tc.cpus())
    except ImportError:
        pass
    return 1


def local_root(spec: TaskSpec) -> str:
    if spec.local_root:
        return spec.local_root
    try:
        from pyspark import SparkFiles

        return SparkFiles.getRootDirectory()
    except Exception:  # no Spark here (in-process backend): a per-user temp dir
        import tempfile

        return os.path.join(tempfile.gettempdir(), f"sparkcnn-{os.getuid()}")


def _policy(spec: TaskSpec, per_step: bool, momentum: float):
    from sparkcnn.compression import DGCMomentum, ErrorFeedback, SparsificationAwareMomentum, Sparsifier

    sp = Sparsifier(spec.method, spec.dense_below)
    if not per_step:
        return ErrorFeedback(spec.layout, sp, spec.value_dtype)
    if spec.momentum_mode == "sparsification_aware":
        return SparsificationAwareMomentum(spec.layout, sp, spec.value_dtype, momentum=momentum,
                                           weight_decay=0.0)
    return DGCMomentum(spec.layout, sp, spec.value_dtype, momentum=momentum)


def run_block_round(spec: TaskSpec, order: RoundOrder, block: int, attempt: int = 0) -> dict:
    """Train ``block`` for ``order.steps[block]`` local steps; return its encoded delta and stats.

    Dense (``method = none``): ``S = V − V_after``. Sparse, local-step form
    (H > 1): ``A += Δ; S = sparsify(A); A −= S; momentum[S] = 0``. Sparse,
    per-step form (H = 1): the replica is not stepped; DGC momentum correction
    ``u = m·u + g; v += u; S = top(v); u[S] = v[S] = 0`` (or the
    sparsification-aware variant), and the server applies ``W −= lr·S``.
    """
    t0 = time.perf_counter()
    root = local_root(spec)
    images, labels = blockstore.get_block(root, spec.run_id, spec.train_dir, "train", spec.num_blocks, block)
    trainer = get_trainer(spec, task_cores())
    expect = order.expect_state.get(block, -1)
    if block in order.initial_state:  # resumed run: the checkpoint carries the block's state
        state = dict(order.initial_state[block])
    else:
        state = (blockstore.load_state(root, spec.run_id, block, expect, wait_s=order.state_wait_s)
                 if expect >= 0 else None)
    state_stale = False
    if state is None and expect >= 1 and order.state_wait_s > 0:
        # pipelined: the previous round's task on this block is still queued behind this one;
        # take the state of the round before (bounded staleness 1, as for the weights), counted
        state = blockstore.load_state(root, spec.run_id, block, expect - 1)
        state_stale = state is not None
    state_reset = expect >= 0 and state is None
    if state_reset:
        log.warning("block %s: state of round %s gone; restarting from zero momentum and residual", block, expect)
    state = state or {}
    resynced, view_bytes = False, 0
    if order.weights:
        w = np.frombuffer(order.weights, np.float32)
    elif order.weights_bcast is not None:
        w = np.frombuffer(order.weights_bcast.value, np.float32)
    else:
        w, resynced, view_bytes = replica_view(spec, order)
    trainer.set_flat(w)
    # host + the executor's local dir name it (stable across its tasks and Python workers)
    executor = f"{socket.gethostname()}:{os.path.realpath(root)}"
    h = int(order.steps_by_executor.get(executor, order.steps.get(block, 0)))
    start = order.step_offset.get(block, 0)
    per_epoch = max(1, steps_per_epoch(len(labels), spec.batch_size))
    batches = [batch_indices(len(labels), spec.batch_size, spec.seed, c // per_epoch, block, c % per_epoch)
               for c in range(start, start + h)]
    batches = [b for b in batches if len(b) == spec.batch_size]
    if not batches:  # this block has no full minibatch left this epoch: carry its state over
        blockstore.save_state(root, spec.run_id, block, order.round, state)
        empty = codec.encode(SparseDelta.empty(int(sum(spec.layout))), spec.layout, value_dtype=spec.value_dtype)
        return {"round": order.round, "block": block, "attempt": attempt, "base_version": order.base_version,
                "samples": 0, "loss_sum": 0.0, "correct": 0, "steps": 0, "prep_s": 0.0, "compute_s": 0.0,
                "encode_s": 0.0, "task_s": time.perf_counter() - t0, "nnz": 0, "lr_scale": 1.0,
                "replica_resync": resynced, "view_bytes": view_bytes, "state_reset": state_reset,
                "state_stale": state_stale,
                "pid": os.getpid(), "payload": empty, "state": state if order.return_state else None,
                "executor": executor}
    sparse = spec.method != "none"
    per_step = sparse and spec.per_step
    lr_scale = 1.0
    t1 = time.perf_counter()
    if per_step:
        # DGC form: gradient only; non-trainable entries (BN statistics) carry their
        # forward-pass change / lr so that the server's ``W -= lr * S`` averages them
        g, loss_sum, correct, seen = trainer.gradient(images, labels, batches[0])
        nt = trainer.non_trainable_mask
        if nt.any():
            g[nt] = (w[nt] - trainer.get_flat()[nt]) / order.lr
        policy = _policy(spec, True, spec.momentum)
        _load_policy(policy, state)
        t2 = time.perf_counter()
        if spec.momentum_mode == "sparsification_aware":
            sent = policy.step(g, w, order.lr, order.density)
        else:
            sent = policy.step(g, order.density)
            lr_scale = order.lr
        new_state = {f"policy.{k}": v for k, v in policy.state_dict().items()}
    else:
        trainer.set_momentum(state.get("momentum"))
        loss_sum, correct, seen = trainer.train(images, labels, batches, order.lr)
        t2 = time.perf_counter()
        delta = w - trainer.get_flat()
        momentum = trainer.get_momentum()
        if sparse:
            policy = _policy(spec, False, spec.momentum)
            _load_policy(policy, state)
            sent = policy.step(delta, order.density)
            momentum[sent.indices] = 0.0  # momentum factor masking
            new_state = {"momentum": momentum, **{f"policy.{k}": v for k, v in policy.state_dict().items()}}
        else:
            sent = SparseDelta.from_dense(delta)
            new_state = {"momentum": momentum}
    t2 = _chaos_slow(spec, block, t1, t2)
    if order.round == spec.chaos_nan_round and block == 0:
        vals = sent.values.copy()
        vals[: max(1, len(vals) // 100)] = np.nan
        sent = SparseDelta(sent.size, sent.indices, vals)
    payload = codec.encode(sent, spec.layout, value_dtype=spec.value_dtype,
                           unchecked_values=order.round == spec.chaos_nan_round)
    t3 = time.perf_counter()
    _freeze_heap_once()
    if attempt == 0 and _chaos_draw(spec, order.round, block, 1) < spec.chaos_kill_p:
        log.warning("chaos: killing the Python worker (block %s round %s)", block, order.round)
        os._exit(17)
    blockstore.save_state(root, spec.run_id, block, order.round, new_state)
    if attempt == 0 and _chaos_draw(spec, order.round, block, 0) < spec.chaos_fail_p:
        raise RuntimeError(f"chaos: injected failure of block {block} round {order.round} attempt 0")
    return {
        "state": new_state if order.return_state else None,
        "round": order.round, "block": block, "attempt": attempt, "base_version": order.base_version,
        "samples": seen, "loss_sum": loss_sum, "correct": correct, "steps": len(batches),
        "prep_s": t1 - t0, "compute_s": t2 - t1, "encode_s": t3 - t2, "task_s": time.perf_counter() - t0,
        "nnz": int(sent.nnz), "lr_scale": lr_scale,
        "replica_resync": resynced, "view_bytes": view_bytes,
        "state_reset": state_reset, "state_stale": state_stale, "pid": os.getpid(), "payload": payload,
        "executor": executor,
    }


def _chaos_draw(spec: TaskSpec, round_: int, block: int, stream: int) -> float:
    """A reproducible uniform draw per (seed, round, block, stream): the same attempts fail on rerun."""
    return float(np.random.default_rng([spec.seed, round_, block, stream, 7]).random())


def _chaos_slow(spec: TaskSpec, block: int, t1: float, t2: float) -> float:
    """Slow this task by a factor: SPARKCNN_CHAOS_SLOW on an executor, or chaos.slow_executor on block 0."""
    factor = float(os.environ.get("SPARKCNN_CHAOS_SLOW", "1") or 1)
    if block == 0:
        factor = max(factor, spec.chaos_slow)
    if factor > 1:
        time.sleep((factor - 1) * (t2 - t1))
        return time.perf_counter()
    return t2


_HEAP_FROZEN = False


def _freeze_heap_once() -> None:
    """After the first round in this process (TF loaded, model built and traced): collect, then
    freeze the survivors, so the full GC PySpark runs after every task of a reused worker no
    longer walks TF/Keras objects (measured 0.25-0.5 s per round at H=10 before, ~0.07 s after)."""
    global _HEAP_FROZEN
    if not _HEAP_FROZEN:
        import gc

        gc.collect()
        gc.freeze()
        _HEAP_FROZEN = True


_REPLICAS: dict = {}


def replica_view(spec: TaskSpec, order: RoundOrder):
    """This process's replica of ``U`` brought to ``order.view_version``.

    Follows the inline downlinks (checksum after each); a replica that is
    missing, behind them or corrupt reloads the broadcast view (counted).
    Returns (U, resynced, bytes read from the broadcast).
    """
    from sparkcnn.replica import Downlink, Replica, Snapshot

    rep = _REPLICAS.setdefault(spec.run_id, Replica())
    dls = [Downlink(v, codec.decode(b, spec.layout), cs, bv, assign)
           for v, bv, cs, assign, b in order.downlinks]
    fetched = []

    def snapshot():
        data = order.view.value
        fetched.append(len(data))
        return Snapshot(order.view_version, np.frombuffer(data, np.float32), [])

    # the initial load at version 0 is no resync; any later dense read is (lost or new replica)
    resynced = rep.sync(dls, snapshot=snapshot) and order.view_version > 0
    return rep.U, resynced, sum(fetched)  # read-only view: the trainer only reads it


def clear_replicas() -> None:
    """Drop this process's replicas (fault drills and tests)."""
    _REPLICAS.clear()


def _load_policy(policy, state: dict) -> None:
    sub = {k[len("policy."):]: v for k, v in state.items() if k.startswith("policy.")}
    if sub:
        policy.load_state_dict(sub)


def run_block_eval(spec: TaskSpec, weights: bytes, block: int) -> dict:
    root = local_root(spec)
    images, labels = blockstore.get_block(root, spec.run_id, spec.test_dir, "test", spec.test_blocks, block)
    trainer = get_trainer(spec, task_cores())
    trainer.set_flat(np.frombuffer(weights, np.float32))
    loss_sum, correct, n = trainer.evaluate(images, labels)
    return {"block": block, "loss_sum": loss_sum, "correct": correct, "samples": n}
