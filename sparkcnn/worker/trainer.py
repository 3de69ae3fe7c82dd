"""Executor side, TensorFlow half: one Keras model, optimizer and compiled steps per process.

The model, optimizer and ``tf.function`` steps are built once per Python
worker process and reused across rounds (TF import and tracing cost seconds).
Weights and momentum move in and out as one flat float32 vector each way.
Task context values (cores, GPUs) come from the engine's task function as a
:class:`~sparkcnn.protocol.TaskContextInfo`; nothing here imports Spark. Every task binds
the process's TensorFlow to the GPUs Spark assigned it (:mod:`sparkcnn.worker.devices`)
before it gets the trainer, whether the trainer is new or reused.
"""

from __future__ import annotations

import functools
import os
import time

import numpy as np

from sparkcnn.buffers import aligned_copy, aligned_empty, as_tensor, shareable
from sparkcnn.compression.feedback import mask_momentum
from sparkcnn.protocol import TaskContextInfo, TaskSpec
from sparkcnn.worker import devices


@functools.lru_cache(maxsize=8)
def _epoch_permutation(n: int, seed: int, epoch: int, block: int) -> np.ndarray:
    perm = np.random.default_rng([seed, epoch, block]).permutation(n)
    perm.setflags(write=False)
    return perm


def batch_indices(n: int, batch_size: int, seed: int, epoch: int, block: int, step: int) -> np.ndarray:
    """Rows of minibatch ``step`` of ``block`` in ``epoch``: a seeded permutation, sliced."""
    return _epoch_permutation(n, seed, epoch, block)[step * batch_size:(step + 1) * batch_size]


def _direct(fn):
    """The ``tf.function`` ``fn`` (with its ``input_signature``) as its one concrete function,
    called directly: :func:`_direct_concrete`."""
    return _direct_concrete(fn.get_concrete_function())


def _direct_concrete(cf):
    """``cf(*tensors)`` without the argument binding of the public call: its flat call where this
    TensorFlow has one, its one output unwrapped (a list holds it there), else the public call."""
    flat_call = getattr(cf, "_call_flat", None)
    if not callable(flat_call):
        return cf

    def call(*tensors):
        out = flat_call(list(tensors), cf.captured_inputs)
        return out[0] if isinstance(out, (list, tuple)) and len(out) == 1 else out
    return call


class Trainer:
    """One Keras model + SGD-momentum optimizer + compiled step, per process and model."""

    def __init__(self, spec: TaskSpec):
        import tensorflow as tf
        import keras
        from sparkcnn.models import build_model

        self.tf = tf
        self.model = build_model(spec.model_name, spec.input_shape, spec.num_classes, spec.seed,
                                 spec.normalize or None)
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
            hits = tf.equal(tf.argmax(logits, -1, output_type=tf.int32), y)
            correct = tf.reduce_sum(tf.cast(hits, tf.int32))
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
            hits = tf.equal(tf.argmax(logits, -1, output_type=tf.int32), y)
            correct = tf.reduce_sum(tf.cast(hits, tf.int32))
            return loss, correct

        self.train_step, self.eval_step = train_step, eval_step

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

        def flat_gradient(x, y):
            # one output: the flat gradient, then the loss and the correct count (exact in float32
            # below 2**24), so that the caller converts one tensor and no scalars (~20 us a step)
            loss, correct, grads = forward_backward(x, y)
            by_pos = dict(zip(self.trainable_pos, grads))
            return tf.concat([tf.reshape(by_pos[i], [-1]) if i in by_pos else tf.zeros([n], tf.float32)
                              for i, n in enumerate(self.sizes)]
                             + [tf.reshape(tf.cast(loss, tf.float32), [1]),
                                tf.reshape(tf.cast(correct, tf.float32), [1])], 0)

        # The per-step form's step: load the weights and return the flat gradient in one TF
        # call (one .numpy()), not a set_flat call and one copy per tensor: ~1 ms of the
        # worker's CPU per step less at one step per exchange (fmnist_cnn).
        @tf.function(reduce_retracing=True)
        def gradient_at(flat, x, y):
            set_weights(flat)
            return flat_gradient(x, y)

        self._gradient = tf.function(flat_gradient, reduce_retracing=True)
        self._gradient_at = gradient_at
        self._direct_calls: dict[tuple, object] = {}  # (tf.function, batch dtypes and shapes) -> its call
        self._batch_bufs: list = [None, None]  # the per-step form's images and labels, aligned (_batch)
        # (array, tensor) of the TF calls' inputs (_tensor): the gradient call's weights, images
        # and labels, then set_flat's weights and set_momentum's momentum
        self._tensors: list = [None] * 5
        self._momentum_buf = None  # mask_momentum's
        self._last_call: tuple = (None, None, None)  # (images, labels, call) of the last gradient call
        self.tf_thread_s = 0.0  # the calling thread's CPU inside the TF step calls, summed (time.thread_time)
        self.step_ended_at = 0.0  # wall clock (s since the epoch) when the last call's first step ended
        self.warmed = False  # its step traced and run once at the block placement (warm_up)
        # called directly (_direct), not through the polymorphic call with an array converted on
        # the way: the four calls of an exchange in the local-step form (load the weights, read
        # them, factor masking's read and write of the momentum) took 2.1 ms of the calling
        # thread's CPU, 0.2 M parameters (fmnist_cnn); with weights_view and mask_momentum 0.5
        self._set_weights, self._set_momentum = _direct(set_weights), _direct(set_momentum)
        self._get_weights, self._get_momentum = _direct(get_weights), _direct(get_momentum)

    def _index_of(self, var) -> int:
        for i, w in enumerate(self.weights):
            if w is var:
                return i
        raise KeyError(var.path)

    def get_flat(self) -> np.ndarray:
        """The weights as one flat float32 vector: the caller's own copy, aligned (set_flat
        reads such an array in place)."""
        return aligned_copy(np.asarray(self._get_weights()))

    def weights_view(self) -> np.ndarray:
        """The weights as get_flat gives them, read-only and without the copy: the TF output's
        own memory (a fresh copy of 0.8 MB cost ~0.25 ms of page faults, fmnist_cnn)."""
        return np.asarray(self._get_weights())

    def set_flat(self, flat: np.ndarray) -> None:
        self._set_weights(self._tensor(3, np.asarray(flat, np.float32)))

    def get_momentum(self) -> np.ndarray:
        """Momentum as a flat vector over all weights (zeros at non-trainable entries): the
        caller's own copy (factor masking writes it in place), aligned as get_flat's."""
        return aligned_copy(np.asarray(self._get_momentum()))

    def set_momentum(self, flat: np.ndarray | None) -> None:
        if flat is None:
            flat = np.zeros(self.offsets[-1], np.float32)
        self._set_momentum(self._tensor(4, np.asarray(flat, np.float32)))

    def mask_momentum(self, indices: np.ndarray) -> None:
        """Momentum factor masking in place (``momentum[indices] = 0``, feedback.mask_momentum),
        through one buffer kept for it: each exchange of the local-step form does it."""
        if self._momentum_buf is None:
            self._momentum_buf = aligned_empty(int(self.offsets[-1]), np.float32)
        np.copyto(self._momentum_buf, np.asarray(self._get_momentum()))
        self.set_momentum(mask_momentum(self._momentum_buf, indices))

    def train(self, images: np.ndarray, labels: np.ndarray, batches: list[np.ndarray], lr: float,
              augment=None):
        """Run one SGD step per batch; returns (summed loss·samples, correct, samples).

        Each step calls the traced step directly, its batch gathered into the buffers TensorFlow
        reads in place (as :meth:`gradient`): through the polymorphic call, with the batch
        converted on the way, the calling thread spent 0.65 ms of each ~10.4 ms step (fmnist_cnn,
        one core), the step waiting meanwhile. ``augment(i, images)``, when given, rewrites the
        gathered images of batch ``i`` in place before its step
        (:class:`~sparkcnn.data.augment.BatchAugment`)."""
        self.opt.learning_rate.assign(lr)
        step = self._direct_batch_call(self.train_step, images, labels)
        loss_sum, correct, seen = 0.0, 0, 0
        for i, idx in enumerate(batches):
            loss, c = self._tf_call(step, *self._batch_tensors(images, labels, idx, augment, i))
            loss_sum += float(loss) * len(idx)  # float(): the step has ended
            if i == 0:
                self.step_ended_at = time.time()
            correct += int(c)
            seen += len(idx)
        return loss_sum, correct, seen

    def warm_up(self, images: np.ndarray, labels: np.ndarray, per_step: bool) -> None:
        """Trace and run once the step a task calls (``per_step``: :meth:`gradient` at given weights,
        else :meth:`train`) on two of ``images``, then put back all it moved: weights (BatchNorm
        statistics too), momentum, the optimizer's step count. The block placement calls it: the
        first call of a traced step (tracing, graph optimisation) took seconds of round 1 at
        ResNet-20 on one core; a deterministic run stays bit-identical. Once per trainer."""
        if self.warmed or not len(labels):
            return
        w, m, steps = self.get_flat(), self.get_momentum(), self.opt.iterations.numpy()
        idx = np.arange(min(2, len(labels)))
        if per_step:
            self.gradient(images, labels, idx, at=w)
        else:
            self.train(images, labels, [idx], 0.0)
        self.set_flat(w)
        self.set_momentum(m)
        self.opt.iterations.assign(steps)
        self.warmed = True

    def gradient(self, images: np.ndarray, labels: np.ndarray, idx: np.ndarray, at: np.ndarray | None = None,
                 augment=None):
        """Flat gradient (zeros at non-trainable entries; read-only), loss and correct count for one
        batch; at the weights ``at`` (loaded first, in the same TF call) or at the current ones.
        An aligned ``at`` (:func:`~sparkcnn.buffers.aligned_empty`) is read without a copy.
        ``augment``: as :meth:`train`'s, the batch being its batch 0."""
        if at is None:
            x = images[idx]
            if augment is not None:
                augment(0, x)
            out = self._gradient(x, labels[idx])
        else:
            fn = self._concrete_gradient_at(images, labels)
            out = self._tf_call(fn, self._tensor(0, np.asarray(at, np.float32)),
                                *self._batch_tensors(images, labels, idx, augment))
        # read-only, no copy: the array keeps the tensor alive (``.numpy()`` would copy P entries)
        flat = np.asarray(out)
        self.step_ended_at = time.time()
        p = flat.size - 2
        return flat[:p], float(flat[p]) * len(idx), int(flat[p + 1]), len(idx)

    def _tf_call(self, fn, *tensors):
        """``fn(*tensors)``, the calling thread's CPU in it added to ``tf_thread_s``."""
        t = time.thread_time()
        out = fn(*tensors)
        self.tf_thread_s += time.thread_time() - t
        return out

    def _batch_tensors(self, images: np.ndarray, labels: np.ndarray, idx: np.ndarray, augment=None,
                       i: int = 0) -> tuple:
        """The batch ``idx`` as the tensors of slots 1 and 2, gathered into the aligned buffers
        (:meth:`_batch`), the images augmented there as batch ``i`` of ``augment``. The labels
        too: tf.constant of 64 ints went through TF's weak-tensor wrapper, ~0.2 ms."""
        x = self._batch(0, images, idx)
        if augment is not None:
            augment(i, x)
        return self._tensor(1, x), self._tensor(2, self._batch(1, labels, idx))

    def _tensor(self, slot: int, a: np.ndarray):
        """A tensor of ``a`` (:func:`~sparkcnn.buffers.as_tensor`), kept for the next call while
        ``a`` is the same array: the lookahead's output and the batch buffers are reused every
        step, and a tensor sharing their memory reads what they hold at each TF call (made anew,
        it cost ~80 us of every step at one step per exchange, its cache cold after TF's call).
        A copy (an array TF cannot share) is made anew each call."""
        kept = self._tensors[slot]
        if kept is not None and kept[0] is a:
            return kept[1]
        t = as_tensor(self.tf, a)
        self._tensors[slot] = (a, t) if shareable(a) else None  # the array held: its memory stays its own
        return t

    def _batch(self, slot: int, rows: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """``rows[idx]`` gathered into aligned buffer ``slot`` (0: images, 1: labels), reused by
        the next call, which TensorFlow reads in place (:mod:`sparkcnn.buffers`)."""
        shape = (len(idx), *rows.shape[1:])
        buf = self._batch_bufs[slot]
        if buf is None or buf.shape != shape or buf.dtype != rows.dtype:
            buf = self._batch_bufs[slot] = aligned_empty(shape, rows.dtype)
        np.take(rows, idx, axis=0, out=buf, mode="clip")  # idx is in range; "raise" would buffer
        return buf

    def _concrete_gradient_at(self, images: np.ndarray, labels: np.ndarray):
        """The traced ``gradient_at`` for these arrays' dtypes and shapes, called directly
        (:meth:`_direct_batch_call`). Each call of the polymorphic function
        matches its arguments against its traces first: at one step per exchange that cost
        ~1 ms of a ~49 ms step (fmnist_cnn, one core: 49.4-51.0 ms per call that way,
        48.5-49.5 ms this way). The concrete function's own call binds its arguments against
        its signature too (0.48 ms of the calling thread's CPU per call, 0.30 without); where
        this TensorFlow has the flat call beneath it, the tensors go there directly."""
        last_images, last_labels, call = self._last_call
        if images is last_images and labels is last_labels:  # the block's arrays, every step
            return call
        call = self._direct_batch_call(self._gradient_at, images, labels,
                                       (self.tf.TensorSpec([int(self.offsets[-1])], self.tf.float32),))
        self._last_call = (images, labels, call)
        return call

    def _direct_batch_call(self, fn, images: np.ndarray, labels: np.ndarray, lead: tuple = ()):
        """The ``tf.function`` ``fn`` traced for batches of these arrays (dtypes and trailing shapes,
        the batch dimension open) after the inputs ``lead`` (TensorSpecs), called directly
        (:func:`_direct_concrete`); made once per function and key."""
        key = (fn, images.dtype.str, images.shape[1:], labels.dtype.str)
        call = self._direct_calls.get(key)
        if call is None:
            tf = self.tf
            call = self._direct_calls[key] = _direct_concrete(fn.get_concrete_function(
                *lead, tf.TensorSpec([None, *images.shape[1:]], tf.as_dtype(images.dtype)),
                tf.TensorSpec([None], tf.as_dtype(labels.dtype))))
        return call

    @functools.cached_property
    def non_trainable_mask(self) -> np.ndarray:
        mask = np.ones(self.offsets[-1], bool)
        for i in self.trainable_pos:
            mask[self.offsets[i]:self.offsets[i + 1]] = False
        return mask

    @functools.cached_property
    def has_non_trainable(self) -> bool:
        """Whether the model has non-trainable weights (BatchNorm statistics)."""
        return bool(self.non_trainable_mask.any())

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



def get_trainer(spec: TaskSpec, ctx: TaskContextInfo, task: str = "this task") -> Trainer:
    """This process's trainer for ``spec``'s model, built on first use.

    First the process's TensorFlow is bound to the task's GPUs (``ctx.gpus``; none: the CPU,
    with intra-op threads matched to ``ctx.cores``), or found bound to them already (a reused
    Python worker); a worker whose TensorFlow runs on other devices raises
    :class:`~sparkcnn.worker.devices.DeviceMismatch` naming ``task`` rather than train there.
    """
    devices.bind(ctx.gpus, task)
    key = (spec.model_name, spec.input_shape, spec.num_classes, spec.seed, spec.momentum, spec.weight_decay,
           spec.normalize)
    tr = _TRAINERS.get(key)
    if tr is None:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        _configure_tf(ctx.cores, spec.deterministic)
        tr = _TRAINERS[key] = Trainer(spec)
    return tr
