"""The worker's Trainer: one flat float32 vector in and out of the Keras variables, BatchNorm included."""

import numpy as np
import pytest


def tiny_bn(input_shape, num_classes):
    """Conv + BatchNorm (non-trainable moving statistics) + dense: every kind of variable, small."""
    import keras
    from keras import layers

    return keras.Sequential([keras.Input(shape=input_shape), layers.Conv2D(4, 3), layers.BatchNormalization(),
                             layers.Flatten(), layers.Dense(num_classes)])


@pytest.fixture(scope="module")
def trainer():
    from sparkcnn.protocol import TaskSpec
    from sparkcnn.worker.trainer import Trainer

    spec = TaskSpec(run_id="t", num_blocks=1, test_blocks=1,
                    model_name="tests.spark.test_trainer:tiny_bn", input_shape=(8, 8, 1), num_classes=3, seed=0,
                    batch_size=4, momentum=0.9, weight_decay=0.0, layout=())
    return Trainer(spec)


def _per_variable(tr, values):
    return [values[a:b] for a, b in zip(tr.offsets[:-1], tr.offsets[1:])]


def test_weights_go_in_and_come_out_as_one_flat_vector_in_variable_order(trainer):
    tr = trainer
    x = np.random.default_rng(0).standard_normal(tr.offsets[-1]).astype(np.float32)
    tr.set_flat(x)
    for w, part in zip(tr.weights, _per_variable(tr, x)):
        assert np.array_equal(np.asarray(w.numpy()).ravel(), part), w.path
    out = tr.get_flat()
    assert out.dtype == np.float32 and np.array_equal(out, x)
    out[0] += 1  # the caller owns what it gets: writable, and not the variables' memory
    assert np.array_equal(tr.get_flat(), x)


def test_momentum_covers_trainable_variables_and_is_zero_at_batchnorm_statistics(trainer):
    tr = trainer
    non_trainable = np.ones(tr.offsets[-1], bool)
    for i in tr.trainable_pos:
        non_trainable[tr.offsets[i]:tr.offsets[i + 1]] = False
    assert non_trainable.sum() == 8  # moving mean and variance of 4 channels
    m = np.random.default_rng(1).standard_normal(tr.offsets[-1]).astype(np.float32)
    tr.set_momentum(m)
    for slot, i in zip(tr.momentums, tr.trainable_pos):
        assert np.array_equal(np.asarray(slot.numpy()).ravel(), m[tr.offsets[i]:tr.offsets[i + 1]])
    got = tr.get_momentum()
    assert np.array_equal(got[~non_trainable], m[~non_trainable])
    assert not got[non_trainable].any()
    tr.set_momentum(None)
    assert not tr.get_momentum().any()


def test_the_weights_view_and_momentum_masking_are_get_flat_and_feedback_masking(trainer):
    """The exchange's calls without their copies: the view is what get_flat gives, read-only;
    masking zeroes the momentum at the sent indices and nowhere else, as feedback's on a copy,
    and the same array handed to set_flat twice is read anew each time."""
    from sparkcnn.buffers import aligned_copy
    from sparkcnn.compression.feedback import mask_momentum

    tr = trainer
    rng = np.random.default_rng(3)
    w = aligned_copy(rng.standard_normal(tr.offsets[-1]).astype(np.float32))
    tr.set_flat(w)
    view = tr.weights_view()
    assert np.array_equal(view, tr.get_flat()) and np.array_equal(view, w) and not view.flags.writeable
    w[0] += 1.0  # the same (aligned, shared) array again, changed in between
    tr.set_flat(w)
    assert tr.get_flat()[0] == w[0] and view[0] == w[0] - 1.0  # the earlier view keeps its values
    m = rng.standard_normal(tr.offsets[-1]).astype(np.float32)
    tr.set_momentum(m)
    sent = np.sort(rng.choice(tr.offsets[-1], 50, replace=False))
    expected = mask_momentum(tr.get_momentum(), sent)
    tr.mask_momentum(sent)
    tr.mask_momentum(sent[:0])  # nothing sent: nothing changes (the kept buffer read anew)
    got = tr.get_momentum()
    assert np.array_equal(got, expected) and not got[sent].any() and np.count_nonzero(got != 0) >= m.size - 58


def test_a_training_step_moves_the_flat_weights_and_fills_the_momentum(trainer):
    tr = trainer
    rng = np.random.default_rng(2)
    tr.set_flat(rng.standard_normal(tr.offsets[-1]).astype(np.float32) * 0.1)
    tr.set_momentum(None)
    before = tr.get_flat()
    images = rng.integers(0, 255, (8, 8, 8, 1)).astype(np.uint8)
    labels = rng.integers(0, 3, 8).astype(np.int32)
    _, _, seen = tr.train(images, labels, [np.arange(4), np.arange(4, 8)], lr=0.1)
    assert seen == 8
    assert not np.array_equal(tr.get_flat(), before)
    assert tr.get_momentum().any()


def test_per_step_gradient_is_clipped_to_the_block_cap_and_batchnorm_statistics_are_not(trainer):
    """DGC's local gradient clipping in the per-step form: the trainable part of a block's
    gradient is capped at spec.clip_norm; BatchNorm statistics' entries are no gradient."""
    import dataclasses

    from sparkcnn.compression.feedback import make_policy
    from sparkcnn.worker.jobs import clip_gradient, compute

    tr, rng = trainer, np.random.default_rng(5)
    x, y = rng.standard_normal((8, 8, 8, 1)).astype(np.float32), rng.integers(0, 3, 8).astype(np.int32)
    w = rng.standard_normal(tr.offsets[-1]).astype(np.float32)
    nt = tr.non_trainable_mask
    tr.set_flat(w)
    g, *_ = tr.gradient(x, y, np.arange(4))
    full = float(np.linalg.norm(g[~nt]))
    assert full > 0.01
    from sparkcnn.protocol import TaskSpec

    spec = TaskSpec(run_id="t", num_blocks=1, test_blocks=1, model_name="tests.spark.test_trainer:tiny_bn",
                    input_shape=(8, 8, 1), num_classes=3, seed=0, batch_size=4, momentum=0.0, weight_decay=0.0,
                    layout=tuple(b - a for a, b in zip(tr.offsets[:-1], tr.offsets[1:])), method="topk",
                    per_step=True, dense_below=0)
    sent = {}
    for cap in (0.0, full / 4):
        s = dataclasses.replace(spec, clip_norm=cap)
        policy = make_policy("topk", "correction", True, s.layout, "float32", 0, 0.0)
        tr.set_flat(w)
        out, *_ = compute(s, tr, policy, {}, w, x, y, [np.arange(4)], 0.1, 1.0)
        sent[cap] = out.to_dense()
    np.testing.assert_allclose(np.linalg.norm(sent[full / 4][~nt]), full / 4, rtol=1e-4)
    np.testing.assert_allclose(sent[full / 4][~nt], sent[0.0][~nt] / 4, rtol=1e-4, atol=1e-7)
    np.testing.assert_array_equal(sent[full / 4][nt], sent[0.0][nt])  # statistics: not clipped
    v = np.array([3.0, 4.0, 12.0], np.float32)
    out, norm = clip_gradient(v, np.array([True, True, False]), 1.0)
    assert norm == 5.0 and out is v  # writeable: scaled in place
    np.testing.assert_allclose(v, [0.6, 0.8, 12.0])
    v.flags.writeable = False  # as the per-step gradient comes: a copy when scaled, itself when not
    out, norm = clip_gradient(v, None, 1.0)
    assert out is not v and norm == pytest.approx(np.sqrt(0.36 + 0.64 + 144)) and np.linalg.norm(out) == pytest.approx(1)
    assert clip_gradient(v, None, 100.0)[0] is v


def tiny_plain(input_shape, num_classes):
    """Conv + dense, no BatchNorm: every weight trainable."""
    import keras
    from keras import layers

    return keras.Sequential([keras.Input(shape=input_shape), layers.Conv2D(4, 3), layers.Flatten(),
                             layers.Dense(num_classes)])


def test_a_clipped_gradient_without_batchnorm_is_scaled_by_the_policy_as_clipping_would():
    """Without BatchNorm the read-only per-step gradient is not copied to be clipped: the policy
    takes the clip's factor and scales as it reads. Its sends and state are bit for bit those of
    stepping the clipped copy."""
    import dataclasses

    from sparkcnn.compression.feedback import make_policy
    from sparkcnn.protocol import TaskSpec
    from sparkcnn.worker.jobs import clip_gradient, compute
    from sparkcnn.worker.trainer import Trainer

    spec = TaskSpec(run_id="t", num_blocks=1, test_blocks=1, model_name="tests.spark.test_trainer:tiny_plain",
                    input_shape=(8, 8, 1), num_classes=3, seed=0, batch_size=4, momentum=0.9, weight_decay=0.0,
                    layout=(), method="threshold", per_step=True, dense_below=16)
    tr = Trainer(spec)
    assert not tr.has_non_trainable
    layout = tuple(b - a for a, b in zip(tr.offsets[:-1], tr.offsets[1:]))
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((8, 8, 8, 1)).astype(np.float32), rng.integers(0, 3, 8).astype(np.int32)
    w = (rng.standard_normal(tr.offsets[-1]) * 3).astype(np.float32)
    g, *_ = tr.gradient(x, y, np.arange(4), at=w)
    norm = float(np.linalg.norm(g))
    s = dataclasses.replace(spec, layout=layout, clip_norm=norm / 3)
    ours = make_policy("threshold", "correction", True, layout, "float16", 16, 0.9)
    ref = make_policy("threshold", "correction", True, layout, "float16", 16, 0.9)
    for _ in range(3):
        sent, *_ = compute(s, tr, ours, None, w, x, y, [np.arange(4)], 0.1, 0.05, live=True)
        clipped, n = clip_gradient(tr.gradient(x, y, np.arange(4), at=w)[0], None, s.clip_norm)
        assert n == pytest.approx(norm, rel=1e-6) and np.linalg.norm(clipped) == pytest.approx(norm / 3, rel=1e-5)
        expect = ref.step(clipped, 0.05, lr=0.1, weights=w)
        assert np.array_equal(sent.indices, expect.indices)
        assert np.array_equal(sent.values.view(np.uint32), expect.values.view(np.uint32))
    assert np.array_equal(ours.velocity.view(np.uint32), ref.velocity.view(np.uint32))


@pytest.mark.parametrize("per_step, method", [(True, "topk"), (False, "topk"), (False, "none")])
def test_live_compute_matches_the_state_passing_form(trainer, per_step, method):
    """The stream keeps a block's state in the policy and the trainer through a stage (live);
    the steps and the state it leaves are exactly those of passing the state each step."""
    from sparkcnn.compression.feedback import make_policy
    from sparkcnn.protocol import TaskSpec
    from sparkcnn.worker.jobs import compute, held_state, hold_state

    tr, rng = trainer, np.random.default_rng(6)
    layout = tuple(b - a for a, b in zip(tr.offsets[:-1], tr.offsets[1:]))
    spec = TaskSpec(run_id="t", num_blocks=1, test_blocks=1, model_name="tests.spark.test_trainer:tiny_bn",
                    input_shape=(8, 8, 1), num_classes=3, seed=0, batch_size=4, momentum=0.9, weight_decay=0.0,
                    layout=layout, method=method, per_step=per_step, dense_below=0)
    x, y = rng.standard_normal((16, 8, 8, 1)).astype(np.float32), rng.integers(0, 3, 16).astype(np.int32)
    w0 = rng.standard_normal(tr.offsets[-1]).astype(np.float32) * 0.1
    start = {"momentum": rng.standard_normal(tr.offsets[-1]).astype(np.float32) * 0.01} if not per_step else {}
    batches = [[np.arange(4 * i, 4 * i + 4)] for i in range(3)]

    def new_policy():
        return make_policy(method, "correction", per_step, layout, "float32", 0, 0.9)

    sent_a, state, w = [], dict(start), w0.copy()
    policy = new_policy()
    for b in batches:
        tr.set_flat(w)
        s, state, *_ = compute(spec, tr, policy, state, w, x, y, b, 0.05, 0.2)
        sent_a.append(s.to_dense())
        w = w - 0.5 * s.to_dense()
    sent_b, w, policy = [], w0.copy(), new_policy()
    hold_state(spec, tr, policy, dict(start))
    for b in batches:
        tr.set_flat(w)
        s, none, *_ = compute(spec, tr, policy, None, w, x, y, b, 0.05, 0.2, live=True)
        assert none is None
        sent_b.append(s.to_dense())
        w = w - 0.5 * s.to_dense()
    for a, b in zip(sent_a, sent_b):
        np.testing.assert_array_equal(a, b)
    held = held_state(spec, tr, policy)
    assert sorted(held) == sorted(state)
    for k in state:
        np.testing.assert_array_equal(held[k], state[k])


def test_gradient_at_weights_is_loading_them_then_the_gradient(trainer):
    """The per-step form loads its weights inside the gradient's TF call: the same gradient,
    loss and BatchNorm statistics, bit for bit, as set_flat then gradient."""
    tr, rng = trainer, np.random.default_rng(11)
    x, y = rng.standard_normal((8, 8, 8, 1)).astype(np.float32), rng.integers(0, 3, 8).astype(np.int32)
    w = rng.standard_normal(tr.offsets[-1]).astype(np.float32) * 0.1
    tr.set_flat(w)
    g_a, loss_a, c_a, n_a = tr.gradient(x, y, np.arange(8))
    after_a = tr.get_flat()
    tr.set_flat(np.zeros_like(w))  # somewhere else entirely
    g_b, loss_b, c_b, n_b = tr.gradient(x, y, np.arange(8), at=w)
    np.testing.assert_array_equal(g_a, g_b)
    np.testing.assert_array_equal(after_a, tr.get_flat())  # the weights, and the statistics' update
    assert (loss_a, c_a, n_a) == (loss_b, c_b, n_b) and np.abs(g_a).max() > 0
    assert not g_a[tr.non_trainable_mask].any()
    # weights TF reads in place (aligned): the same results, and no memory shared past the call:
    # neither the BatchNorm statistics' update lands in them, nor do later writes reach the model
    from sparkcnn.buffers import aligned_copy, shareable

    at = aligned_copy(w)
    assert shareable(at) and not shareable(w[1:])
    tr.set_flat(np.zeros_like(w))
    g_c, *rest = tr.gradient(x, y, np.arange(8), at=at)
    np.testing.assert_array_equal(g_a, g_c)
    assert tuple(rest) == (loss_a, c_a, n_a) and not g_c.flags.writeable
    np.testing.assert_array_equal(at, w)
    at[:] = 7.0
    np.testing.assert_array_equal(after_a, tr.get_flat())


def test_gradient_at_a_reused_buffer_reads_what_it_holds_at_each_call(trainer):
    """The lookahead hands the gradient the same aligned buffer every step, rewritten in place;
    the tensor kept for it must read the new weights, and the loss and correct count that ride
    with the gradient must be this call's: each call equals one at a fresh copy."""
    from sparkcnn.buffers import aligned_copy

    tr, rng = trainer, np.random.default_rng(12)
    x, y = rng.standard_normal((8, 8, 8, 1)).astype(np.float32), rng.integers(0, 3, 8).astype(np.int32)
    ws = [rng.standard_normal(tr.offsets[-1]).astype(np.float32) * s for s in (0.1, 0.5, 0.05)]
    buf = aligned_copy(ws[0])
    fresh = [tr.gradient(x, y, np.arange(8), at=aligned_copy(w)) for w in ws]
    for w, (g_f, loss_f, c_f, n_f) in zip(ws, fresh):
        buf[:] = w
        g, loss, c, n = tr.gradient(x, y, np.arange(8), at=buf)
        np.testing.assert_array_equal(g, g_f)
        assert (loss, c, n) == (loss_f, c_f, n_f) and g.size == tr.offsets[-1]
    assert len({round(f[1], 6) for f in fresh}) == 3  # the three weights gave three losses
