"""bench/scale.py's executor-side merge: one merged payload applies as the N payloads one by one."""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.scale import merge_payloads, random_delta  # noqa: E402
from sparkcnn.compression import decode, encode  # noqa: E402
from sparkcnn.server.apply import apply_deltas  # noqa: E402
from sparkcnn.ps import ParameterServer  # noqa: E402

LAYOUT = (3 * 3 * 8, 8, 20_000, 10)  # two small tensors sent whole, one sparse, a bias


def test_merged_apply_equals_payloads_one_by_one():
    rng = np.random.default_rng(0)
    payloads = [encode(random_delta(LAYOUT, 0.01, rng), LAYOUT) for _ in range(8)]
    size = sum(LAYOUT)
    w0 = rng.standard_normal(size).astype(np.float32)
    one_by_one = ParameterServer(w0.copy(), LAYOUT, density_down=None)
    for p in payloads:  # a lone payload's weight is 1: W -= 0.5 · decode(p)
        assert apply_deltas(one_by_one, [p], [64], [0.5]).applied == (0,)
    levels = [payloads]  # the executors' tree of twos
    while len(levels[-1]) > 1:
        levels.append([merge_payloads(levels[-1][i:i + 2], LAYOUT) for i in range(0, len(levels[-1]), 2)])
    assert [len(level) for level in levels] == [8, 4, 2, 1]
    merged = ParameterServer(w0.copy(), LAYOUT, density_down=None)
    assert apply_deltas(merged, [levels[-1][0]], [8 * 64], [0.5]).applied == (0,)

    support = np.unique(np.concatenate([decode(p, LAYOUT).indices for p in payloads]))
    assert np.array_equal(decode(levels[-1][0], LAYOUT).indices, support)  # the union, nothing lost
    moved = np.abs(w0 - one_by_one.W).max()
    assert moved > 1e-4  # the payloads did change W
    # float16 values rounded once more per level: relative 2^-11 of each partial sum, 3 levels
    np.testing.assert_allclose(merged.W, one_by_one.W, rtol=0, atol=4 * 3 * 2.0 ** -11 * moved)
    # float32 on the wire for the merge: only the sum's own float32 rounding is left
    exact = ParameterServer(w0.copy(), LAYOUT, density_down=None)
    apply_deltas(exact, [merge_payloads(payloads, LAYOUT, value_dtype="float32")], [8 * 64], [0.5])
    np.testing.assert_allclose(exact.W, one_by_one.W, rtol=1e-6, atol=1e-7)
