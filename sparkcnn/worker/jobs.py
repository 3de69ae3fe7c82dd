"""Executor side, round logic: block, state, replica, local steps, sparsify, encode.

Worker round for block ``k`` starting from the replica ``V`` (version ``b``)::

    H > 1:  V_after = H SGD-momentum steps from V;  Δ = V − V_after
            dense: S = Δ                      sparse: A += Δ; S = sparsify(A); A −= S; momentum[S] = 0
    H = 1, sparse (the per-step form): g = clip(∇loss(V));  S = policy.step(g)   (DGC momentum correction
            or sparsification-aware momentum; the server scales S as the policy says)
    payload = encode(S)

Everything a task needs arrives as plain values: :class:`TaskSpec`,
:class:`ExchangeOrder` and the task's :class:`TaskContextInfo`. Nothing here
imports Spark; TensorFlow is reached through :mod:`sparkcnn.worker.trainer`.
"""

from __future__ import annotations

import os
import time

import numpy as np

from sparkcnn.compression import codec
from sparkcnn.compression.delta import SparseDelta
from sparkcnn.compression.feedback import mask_momentum
from sparkcnn.data.augment import BatchAugment, batch_augment
from sparkcnn.protocol import (
    EvalResult,
    ExchangeOrder,
    ExchangeResult,
    TaskContextInfo,
    TaskSpec,
    steps_per_epoch,
)
from sparkcnn.worker import blockstore, chaos
from sparkcnn.worker.devices import VISIBLE
from sparkcnn.worker.task import downlinks, freeze_heap_once, local_root, start_task
from sparkcnn.worker.trainer import batch_indices, get_trainer

def _weights(spec: TaskSpec, order: ExchangeOrder) -> tuple[np.ndarray, bool, int]:
    """(weights the block starts from, replica resynced, dense bytes read)."""
    if not spec.sparse_downlink:
        data = order.weights.value
        return np.frombuffer(data, np.float32), False, len(data)
    return replica_view(spec, order)


def block_batches(spec: TaskSpec, block: int, rows: int, start: int,
                  steps: int) -> tuple[list[np.ndarray], BatchAugment | None]:
    """The full minibatches of steps ``start .. start + steps - 1`` of ``block`` (its cursor runs
    across epochs: step c is minibatch ``c mod per_epoch`` of the block's pass ``c // per_epoch``),
    and their augmentation (``data.augment``; None: none), seeded by each one's (epoch, step)."""
    per_epoch = max(1, steps_per_epoch(rows, spec.batch_size))
    keys = [divmod(c, per_epoch) for c in range(start, start + steps)]
    batches = [(batch_indices(rows, spec.batch_size, spec.seed, e, block, s), (e, s)) for e, s in keys]
    full = [(b, k) for b, k in batches if len(b) == spec.batch_size]
    return [b for b, _ in full], batch_augment(spec.augment, spec.seed, block, [k for _, k in full])


def compute(spec: TaskSpec, trainer, policy, state: dict, w: np.ndarray, images, labels, batches,
            lr: float, density: float, *, live: bool = False, augment: BatchAugment | None = None):
    """One exchange's local work from weights ``w``: (sent delta, new state, loss sum, correct, samples).

    ``w`` is loaded into the trainer here (the per-step form loads it in the
    gradient's own TF call). H local steps (or, per-step form, one gradient)
    then the momentum policy's sparsification; the module docstring gives the
    rule. No full minibatch: the state carries over and nothing is sent.

    ``live``: the block's state already sits in ``policy`` and the trainer's
    momentum (:func:`hold_state`, once per stage) and stays there: nothing
    is copied in or out (the returned state is None; :func:`held_state` reads it
    at the end). The stream's tasks step thousands of times per stage, and the
    copies cost O(P) each step.

    ``augment``: the batches' augmentation (:func:`block_batches`), applied as each is gathered.
    """
    if not batches:
        return SparseDelta.empty(int(sum(spec.layout))), (None if live else state), 0.0, 0, 0
    if spec.per_step:
        # gradient only; non-trainable entries (BN statistics) carry their forward-pass
        # change / lr, so that the server's ``W -= lr * S`` averages them
        g, loss_sum, correct, seen = trainer.gradient(images, labels, batches[0], at=w,  # g: read-only
                                                      augment=augment)
        nt = trainer.non_trainable_mask
        has_nt = trainer.has_non_trainable
        if has_nt:
            g = g.copy()
        scale = None
        if spec.clip_norm > 0:
            if has_nt:
                g = clip_gradient(g, ~nt, spec.clip_norm)[0]
            else:  # the policy scales as it reads (g is read-only: clipping here would copy it)
                scale = clip_scale(g, spec.clip_norm)
        if has_nt:
            g[nt] = (w[nt] - trainer.weights_view()[nt]) / lr
        if not live:
            _load_policy(policy, state)
        sent = policy.step(g, density, lr=lr, weights=w, scale=scale)
        return sent, (None if live else _policy_state(policy)), loss_sum, correct, seen
    trainer.set_flat(w)
    if not live:
        trainer.set_momentum(state.get("momentum"))
    loss_sum, correct, seen = trainer.train(images, labels, batches, lr, augment=augment)
    delta = w - trainer.weights_view()
    if policy is None:  # dense
        return (SparseDelta.from_dense(delta), None if live else {"momentum": trainer.get_momentum()},
                loss_sum, correct, seen)
    if not live:
        _load_policy(policy, state)
    sent = policy.step(delta, density, lr=lr, weights=w)
    if live:
        trainer.mask_momentum(sent.indices)
        return sent, None, loss_sum, correct, seen
    momentum = mask_momentum(trainer.get_momentum(), sent)
    return sent, {"momentum": momentum, **_policy_state(policy)}, loss_sum, correct, seen


def hold_state(spec: TaskSpec, trainer, policy, state: dict) -> None:
    """Put a block's state where :func:`compute` keeps it with ``live=True``."""
    if policy is not None:
        _load_policy(policy, state)
    if not spec.per_step:
        trainer.set_momentum(state.get("momentum"))


def held_state(spec: TaskSpec, trainer, policy) -> dict:
    """The block state :func:`hold_state` and live :func:`compute` steps left (the dict
    :func:`compute` returns otherwise)."""
    out = {} if spec.per_step else {"momentum": trainer.get_momentum()}
    return {**out, **(_policy_state(policy) if policy is not None else {})}


def clip_scale(g: np.ndarray, max_norm: float) -> float | None:
    """The factor :func:`clip_gradient` would scale all of ``g`` by, or None where ``g`` is
    within the cap: a policy's ``scale`` (``policy.step(g, ..., scale=)``), bitwise the same."""
    norm = float(np.sqrt(np.dot(g, g)))
    return None if norm <= max_norm else max_norm / norm


def clip_gradient(g: np.ndarray, trainable: np.ndarray | None, max_norm: float) -> tuple[np.ndarray, float]:
    """DGC's local gradient clipping: ``g`` with its ``trainable`` entries scaled so that their L2
    norm is at most ``max_norm``, and their norm before. ``g`` itself when it is within the cap
    (it may be read-only), else scaled in place when writeable, or a scaled copy."""
    part = g if trainable is None else g[trainable]
    norm = float(np.sqrt(np.dot(part, part)))
    if norm <= max_norm:
        return g, norm
    if not g.flags.writeable:
        g = g.copy()
    if trainable is None:
        g *= max_norm / norm
    else:
        g[trainable] = part * (max_norm / norm)
    return g, norm


def run_block_exchange(spec: TaskSpec, order: ExchangeOrder, block: int,
                       ctx: TaskContextInfo) -> ExchangeResult:
    """Train ``block`` for its steps of ``order``; return its encoded delta and stats (module docstring)."""
    task = start_task(spec, ctx, block, f"block {block} exchange {order.seq}")
    state, state_reset, state_stale = task.state(order.initial_state, order.expect_state.get(block, -1),
                                                 order.state_wait_s)
    w, resynced, view_bytes = _weights(spec, order)
    h = int(order.steps_by_executor.get(task.executor, order.steps.get(block, 0)))
    start = order.step_offset.get(block, 0)
    batches, augment = block_batches(spec, block, len(task.labels), start, h)
    t1 = time.perf_counter()
    sent, new_state, loss_sum, correct, seen = compute(spec, task.trainer, task.policy, state, w, task.images,
                                                       task.labels, batches, order.lr, order.density,
                                                       augment=augment)
    t2 = chaos.slowed(spec, block, t1, time.perf_counter()) if batches else time.perf_counter()
    # counted in the block's own exchanges: a global seq may never fall on block 0's turn
    if chaos.holds(spec, block, order.seq if order.block_seq < 0 else order.block_seq, ctx.attempt == 0):
        chaos.hold(spec)  # this result arrives stale
    sent, unchecked = chaos.poisoned(spec, order.seq, block, sent)
    payload = codec.encode(sent, spec.layout, value_dtype=spec.value_dtype, unchecked_values=unchecked)
    t3 = time.perf_counter()
    freeze_heap_once()
    if batches and chaos.kills(spec, order.seq, block, ctx.attempt):
        chaos.kill_worker(block, order.seq)
    blockstore.save_state(task.root, spec.run_id, block, order.seq, new_state)
    if batches and chaos.fails(spec, order.seq, block, ctx.attempt):
        chaos.fail(block, order.seq)
    return ExchangeResult(
        block=block, seq=order.seq, attempt=ctx.attempt, base_version=order.base_version, payload=payload,
        samples=seen, steps=len(batches), loss_sum=loss_sum, correct=correct, nnz=int(sent.nnz),
        prep_s=t1 - task.t0, compute_s=t2 - t1, encode_s=t3 - t2, task_s=time.perf_counter() - task.t0,
        state_reset=state_reset, state_stale=state_stale, replica_resync=resynced, view_bytes=view_bytes,
        pid=os.getpid(), executor=task.executor, lr=order.lr, density=order.density, first_step=start,
        gpus=ctx.gpus, devices=os.environ.get(VISIBLE), state=new_state if order.return_state else None,
        first_step_at=task.trainer.step_ended_at if batches else 0.0)


def _policy_state(policy) -> dict:
    return {f"policy.{k}": v for k, v in policy.state_dict().items()}


def _load_policy(policy, state: dict) -> None:
    sub = {k[len("policy."):]: v for k, v in state.items() if k.startswith("policy.")}
    if sub:
        policy.load_state_dict(sub)


_REPLICAS: dict = {}


def replica_view(spec: TaskSpec, order: ExchangeOrder) -> tuple[np.ndarray, bool, int]:
    """This process's replica of ``U`` brought to ``order.weights_version``.

    Follows the inline downlinks (checksum after each); a replica that is
    missing, behind them or corrupt reloads the dense view (counted).
    Returns (U, resynced, bytes read from the dense view).
    """
    from sparkcnn.replica import Replica

    rep = _REPLICAS.setdefault(spec.run_id, Replica())
    if order.resync:
        rep.invalidate()
    dls = downlinks(order.downlinks, spec.layout)
    fetched = []

    def reload():
        data = order.weights.value
        fetched.append(len(data))
        return order.weights_version, np.frombuffer(data, np.float32)

    # the initial load at version 0 is no resync; any later dense read is (lost or new replica)
    resynced = rep.sync(dls, reload) and order.weights_version > 0
    return rep.U, resynced, sum(fetched)  # read-only view: the trainer only reads it


def clear_replicas() -> None:
    """Drop this process's replicas (fault drills and tests)."""
    _REPLICAS.clear()


def run_block_eval(spec: TaskSpec, weights: bytes, block: int, ctx: TaskContextInfo) -> EvalResult:
    """Loss and correct predictions of test block ``block`` at ``weights`` (float32 bytes)."""
    root = local_root(spec, ctx)
    images, labels = blockstore.get_block(root, spec.run_id, "test", spec.test_blocks, block)
    trainer = get_trainer(spec, ctx, f"test block {block} attempt {ctx.attempt}")
    trainer.set_flat(np.frombuffer(weights, np.float32))
    loss_sum, correct, n = trainer.evaluate(images, labels)
    return EvalResult(block=block, samples=n, loss_sum=loss_sum, correct=correct)


def load_block_state(spec: TaskSpec, tags: dict, block: int, ctx: TaskContextInfo):
    """(block, the state its exchange ``tags[block]`` left, or None when it is gone): for checkpoints."""
    return block, blockstore.load_state(local_root(spec, ctx), spec.run_id, block, tags[block])
