"""Key-range shards (pure tier): K shards driven by one log give bitwise the weights, views and
downlinks of one parameter server, and refuse to drift from it."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from sparkcnn.compression import codec
from sparkcnn.compression.delta import SparseDelta
from sparkcnn.compression.sparsify import Sparsifier
from sparkcnn.server.apply import apply_deltas
from sparkcnn.transport.shard import RangeShard, ShardDisagrees
from sparkcnn.errors import BadInput
from sparkcnn.protocol import Answer, Piece, PieceRef, ShardStep
from sparkcnn.ps import ParameterServer
from sparkcnn.replica import Downlink, Replica
from sparkcnn.shards import merge_downlinks, shard_ranges, split_delta, sum_squares

LAYOUT = (288, 32, 9216, 32, 18432, 64, 2000, 10)  # conv, bias, ... : a small CNN's tensors


def test_ranges_are_whole_tensors_covering_the_layout_and_balanced():
    P = sum(LAYOUT)
    for k in range(1, len(LAYOUT) + 1):
        rs = shard_ranges(LAYOUT, k)
        assert len(rs) == k and rs[0][0] == 0 and rs[-1][1] == P
        assert all(a[1] == b[0] for a, b in zip(rs, rs[1:])) and all(lo < hi for lo, hi in rs)
        offsets = set(np.cumsum((0,) + LAYOUT).tolist())
        assert all(lo in offsets and hi in offsets for lo, hi in rs)
    # the largest tensor alone bounds every cut: at 2 shards it stands alone
    assert max(hi - lo for lo, hi in shard_ranges(LAYOUT, 2)) == 18432 + 64 + 2000 + 10
    assert max(hi - lo for lo, hi in shard_ranges(LAYOUT, 3)) == 18432
    with pytest.raises(BadInput, match="ps.shards=9"):
        shard_ranges(LAYOUT, 9)


def _delta(rng, P, nnz):
    idx = np.sort(rng.choice(P, nnz, replace=False)).astype(np.int64)
    return SparseDelta(P, idx, (rng.standard_normal(nnz) * 0.01).astype(np.float32))


def _pieces(delta, ranges, value_dtype):
    return [codec.encode(p, LAYOUT, value_dtype=value_dtype) for p in split_delta(delta, ranges)]


def _merged(replies, shards, layout):
    """The whole-vector downlinks of the shards' replies (decoded), as a task merges them."""
    parts = [[Downlink(m.version, codec.decode(m.payload, layout), m.checksum_after, m.base_version, m.assign)
              for m in r.downlinks] for r in replies]
    partial = [[int(m.checksum_after, 16) for m in r.downlinks] for r in replies]
    return merge_downlinks(parts, partial)


@pytest.mark.parametrize("value_dtype", ["float32", "float16"])
@pytest.mark.parametrize("k", [2, 3])
def test_shards_follow_one_server_bitwise(value_dtype, k):
    """Async pushes and BSP rounds through K shards: W, U and every downlink (indices, values,
    checksum) bitwise those of one server, and a replica following the merged downlinks checks out."""
    rng = np.random.default_rng(7)
    P = sum(LAYOUT)
    w0 = rng.standard_normal(P).astype(np.float32)
    ranges = shard_ranges(LAYOUT, k)
    ref = ParameterServer(w0, LAYOUT, density_down=0.05, sparsifier=Sparsifier("threshold", 1000),
                          value_dtype=value_dtype)
    shards = [RangeShard(lo, hi, w0, LAYOUT, density_down=0.05, dense_below=1000, value_dtype=value_dtype,
                         index=j, timeout_s=5) for j, (lo, hi) in enumerate(ranges)]
    replica = Replica()
    replica.load_snapshot(0, w0)
    ordinal = 0
    for t in range(40):
        n = 1 if t % 4 else 3  # every 4th entry is a BSP round of 3 pushes
        deltas = [_delta(rng, P, int(rng.integers(50, 400))) for _ in range(n)]
        factors = [float(rng.uniform(0.2, 1.0)) for _ in range(n)]
        samples = [64 * int(rng.integers(1, 4)) for _ in range(n)]
        apply_deltas(ref, [codec.encode(d, LAYOUT, value_dtype=value_dtype) for d in deltas], samples, factors)
        dl = ref.downlink(0.05)
        refs, answers = [], []
        per_shard = [[] for _ in shards]
        for d, f, s in zip(deltas, factors, samples):
            pieces = _pieces(d, ranges, value_dtype)
            for j, payload in enumerate(pieces):
                per_shard[j].append(Piece(stream=1, ordinal=ordinal, have=replica.version, payload=payload))
            refs.append(PieceRef(1, ordinal, f, s, tuple(sum_squares(codec.decode(pl, LAYOUT)) for pl in pieces)))
            answers.append(Answer(1, ordinal, retrain=False))
            ordinal += 1
        replies = []
        for j, shard in enumerate(shards):
            got = {}
            threads = [threading.Thread(target=lambda p=p: got.setdefault(p.ordinal, shard.piece(p)))
                       for p in per_shard[j]]
            for th in threads:  # the pieces arrive before their log entry, each on its own stream
                th.start()
            shard.step(ShardStep(version=ref.version, apply=tuple(refs), downlink=0.05,
                                 answer=tuple(answers)))
            for th in threads:
                th.join(5)
            replies.append(got[answers[-1].ordinal])
        merged = _merged(replies, shards, LAYOUT)
        assert len(merged) == 1 and dl is not None
        m = merged[0]
        assert (m.version, m.base_version, m.checksum_after) == (dl.version, dl.base_version, dl.checksum_after)
        np.testing.assert_array_equal(m.delta.indices, dl.delta.indices)
        assert m.delta.values.tobytes() == dl.delta.values.tobytes()
        replica.apply([m], full_check=True)
    for (lo, hi), shard in zip(ranges, shards):
        assert shard.ps.W[lo:hi].tobytes() == ref.W[lo:hi].tobytes()
        assert shard.ps.U[lo:hi].tobytes() == ref.U[lo:hi].tobytes()
    assert replica.U.tobytes() == ref.U.tobytes()


def _one_of_two(seed: int, which: int):
    """(rng, P, w0, lo, hi, shard): shard ``which`` of 2 over random weights."""
    rng = np.random.default_rng(seed)
    P = sum(LAYOUT)
    w0 = rng.standard_normal(P).astype(np.float32)
    lo, hi = shard_ranges(LAYOUT, 2)[which]
    return rng, P, w0, lo, hi, RangeShard(lo, hi, w0, LAYOUT, density_down=0.05, timeout_s=5)


def test_a_dropped_push_is_answered_with_the_dense_view_and_moves_nothing():
    rng, P, w0, lo, hi, shard = _one_of_two(1, 1)
    payload = _pieces(_delta(rng, P, 100), ((0, lo), (lo, hi)), "float32")[1]
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("r", shard.piece(Piece(3, 0, 0, payload))))
    th.start()
    shard.step(ShardStep(version=0, answer=(Answer(3, 0, retrain=True),)))
    th.join(5)
    assert shard.ps.version == 0 and out["r"].dense == w0[lo:hi].tobytes() and out["r"].dense_version == 0


def test_a_shard_refuses_to_drift_from_the_log():
    """A piece whose norm is not the one declared to the guard, or a log at another version,
    stops the shard, and its waiting pieces see the failure instead of a reply."""
    rng = np.random.default_rng(2)
    P = sum(LAYOUT)
    w0 = rng.standard_normal(P).astype(np.float32)
    d = _delta(rng, P, 200)
    payload = codec.encode(d, LAYOUT, value_dtype="float32")
    shard = RangeShard(0, P, w0, LAYOUT, density_down=0.05, timeout_s=5)
    out = {}

    def send():
        try:
            shard.piece(Piece(1, 0, 0, payload))
        except ShardDisagrees as e:
            out["error"] = str(e)

    th = threading.Thread(target=send)
    th.start()
    with pytest.raises(ShardDisagrees, match="declared"):
        shard.step(ShardStep(version=1, apply=(PieceRef(1, 0, 1.0, 64, (4 * sum_squares(d),)),),
                             answer=(Answer(1, 0, False),)))
    th.join(5)
    assert "declared" in out["error"] and shard.ps.version == 0

    other = RangeShard(0, P, w0, LAYOUT, density_down=0.05, timeout_s=5)
    th = threading.Thread(target=lambda: pytest.raises(ShardDisagrees, other.piece, Piece(1, 0, 0, payload)))
    th.start()
    with pytest.raises(ShardDisagrees, match="version 1, the log at 2"):
        other.step(ShardStep(version=2, apply=(PieceRef(1, 0, 1.0, 64, (sum_squares(d),)),),
                             answer=(Answer(1, 0, False),)))
    th.join(5)


def test_each_log_entry_wakes_only_the_pieces_it_answers():
    """Many streams' pieces wait at once: none of them waits on the shard's condition (each
    notify would wake them all: at 64 workers the shard spent 3x a push's CPU re-checking),
    each log entry releases exactly the pieces it names, and one never named times out."""
    rng, P, w0, lo, hi, shard = _one_of_two(3, 0)
    shard.timeout_s = 1.0
    n = 24
    out: dict = {}

    def send(stream):
        try:
            out[stream] = shard.piece(Piece(stream, 0, -1, b""))
        except TimeoutError as e:
            out[stream] = e

    threads = [threading.Thread(target=send, args=(k,)) for k in range(n + 1)]
    for th in threads:
        th.start()
    deadline = time.monotonic() + 5
    while len(shard.ready) < n + 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(shard.ready) == n + 1
    assert not shard.cond._waiters  # the pieces wait on their own events
    for k in reversed(range(n)):  # stream n is never answered
        shard.step(ShardStep(version=0, answer=(Answer(k, 0, retrain=True),)))
        threads[k].join(5)
        assert out[k].dense == w0[lo:hi].tobytes()
        assert all(j not in out for j in range(k))  # the others still wait
    threads[n].join(5)
    assert isinstance(out[n], TimeoutError) and "was not answered" in str(out[n])
    assert not shard.ready and not shard.replies


def test_a_log_entry_whose_piece_never_comes_times_out_naming_it():
    P = sum(LAYOUT)
    shard = RangeShard(0, P, np.zeros(P, np.float32), LAYOUT, density_down=None, timeout_s=0.2)
    with pytest.raises(TimeoutError, match=r"pieces \[\(4, 9\)\] of version 1"):
        shard.step(ShardStep(version=1, apply=(PieceRef(4, 9, 1.0, 64, (0.0,)),)))


def test_state_is_the_range_and_load_restores_it():
    _, _, w0, lo, hi, shard = _one_of_two(3, 0)
    W, U = w0 + 1, w0 + 2
    shard.load(W, U, 7, 5)
    st = shard.state()
    assert st["W"].tobytes() == W[lo:hi].tobytes() and st["U"].tobytes() == U[lo:hi].tobytes()
    assert (st["version"], st["view_version"]) == (7, 5)
    assert shard.reply(-1).dense == U[lo:hi].tobytes() and shard.reply(5).dense == b""
    # a restored run's W differs from U everywhere: this shard sends only its own range's residual
    shard.step(ShardStep(version=7, downlink=0.05))
    (dl,) = shard.downlinks
    idx = codec.decode(dl.payload, LAYOUT).indices
    assert idx.size and lo <= idx.min() and idx.max() < hi
