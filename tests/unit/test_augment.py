"""data.augment's pure parts: crop_flip, its seeding, and the config key."""


import numpy as np
import pytest

from sparkcnn import config
from sparkcnn.data.augment import PAD, batch_augment, batch_rng, crop_flip


class Draws:
    """A generator stand-in that returns the crop offsets and flips it is given."""

    def __init__(self, dy, dx, flip):
        self.ints = [np.asarray(dy), np.asarray(dx)]
        self.flip = np.asarray(flip, bool)

    def integers(self, lo, hi, n):
        out = self.ints.pop(0)
        assert lo == 0 and hi == 2 * PAD + 1 and len(out) == n
        return out

    def random(self, n):
        return np.where(self.flip, 0.0, 0.9)


def images(n=3, h=28, w=28, c=1, seed=0):
    return np.random.default_rng(seed).integers(1, 256, size=(n, h, w, c), dtype=np.uint8)  # no zero pixel


@pytest.mark.parametrize("shape", [(5, 28, 28, 1), (4, 32, 32, 3), (2, 7, 9, 2)])
def test_crop_flip_keeps_the_shape_and_dtype(shape):
    x = images(*shape)
    y = crop_flip(x, batch_rng(1, 0, 0, 0))
    assert y.shape == x.shape and y.dtype == np.uint8


def test_offsets_pad_with_zeros_and_the_middle_is_the_identity():
    x = images(4)
    y = crop_flip(x, Draws([0, 2 * PAD, PAD, PAD], [0, 2 * PAD, PAD, PAD], [0, 0, 0, 1]))
    # top left corner: PAD rows and columns of zeros, then the image's top left
    assert not y[0, :PAD].any() and not y[0, :, :PAD].any()
    np.testing.assert_array_equal(y[0, PAD:, PAD:], x[0, :-PAD, :-PAD])
    # bottom right corner
    assert not y[1, -PAD:].any() and not y[1, :, -PAD:].any()
    np.testing.assert_array_equal(y[1, :-PAD, :-PAD], x[1, PAD:, PAD:])
    np.testing.assert_array_equal(y[2], x[2])              # centred, not flipped: unchanged
    np.testing.assert_array_equal(y[3], x[3][:, ::-1])     # centred and flipped left to right


def test_every_output_is_a_padded_crop_possibly_flipped():
    x = images(6, 10, 12, 3)
    y = crop_flip(x, batch_rng(7, 1, 2, 3))
    padded = np.pad(x, ((0, 0), (PAD, PAD), (PAD, PAD), (0, 0)))
    for i in range(len(x)):
        crops = [c for dy in range(2 * PAD + 1) for dx in range(2 * PAD + 1)
                 for c in (padded[i, dy:dy + 10, dx:dx + 12], padded[i, dy:dy + 10, dx:dx + 12][:, ::-1])]
        assert any(np.array_equal(y[i], c) for c in crops)


def test_in_place_gives_what_a_new_array_gets():
    x = images(8, 32, 32, 3)
    expect = crop_flip(x, batch_rng(3, 1, 0, 5))
    crop_flip(x, batch_rng(3, 1, 0, 5), out=x)
    np.testing.assert_array_equal(x, expect)


def test_same_seed_tuple_same_output_other_step_block_or_epoch_another():
    x = images(16)
    aug = batch_augment("crop_flip", 42, 1, [(0, 3), (0, 4), (1, 3)])
    outs = []
    for i in range(3):
        b = x.copy()
        aug(i, b)
        outs.append(b)
    again = x.copy()
    batch_augment("crop_flip", 42, 1, [(0, 3)])(0, again)        # the same (seed, block, epoch, step)
    np.testing.assert_array_equal(again, outs[0])
    assert not np.array_equal(outs[0], outs[1])                   # the next step
    assert not np.array_equal(outs[0], outs[2])                   # the same step of the next epoch
    other = x.copy()
    batch_augment("crop_flip", 42, 0, [(0, 3)])(0, other)         # another block
    assert not np.array_equal(other, outs[0])
    seeded = x.copy()
    batch_augment("crop_flip", 43, 1, [(0, 3)])(0, seeded)        # another run seed
    assert not np.array_equal(seeded, outs[0])


def test_none_augments_nothing():
    assert batch_augment("none", 42, 0, [(0, 0)]) is None


def test_defaults_leave_the_input_path_as_it_was():
    assert config.load(None).data.augment == "none"


def test_the_cifar_config_augments_and_normalises_as_the_recipe_does():
    cfg = config.load("conf/cifar10_resnet20.yaml")
    assert (cfg.data.augment, cfg.data.normalize) == ("crop_flip", "dataset")
