"""Driver-side cost of sparse communication; prints one JSON object.

    python bench/scale.py [--quick] [--seed 0]

Keys:
  codec_bytes_per_nonzero  whole payload / nnz, one 1 M-entry tensor with a
                           uniformly random support, float16 values, by density
  driver_apply_s           seconds of the engine's apply path for N payloads,
                           sparkcnn.server.apply.apply_deltas: decode and validate
                           each, the divergence guard on each norm, the weighted
                           sum and ParameterServer.apply (``W -= G``), by model
                           size then N (density 0.001, small tensors dense as in
                           training)
  driver_apply_cpu_s       the same, CPU seconds of this process (contention-free;
                           summed over its threads)
  driver_apply_1thread_s   driver_apply_s with threads=1, and its CPU seconds in
                           driver_apply_1thread_cpu_s
  driver_threads           the decode and sum threads of driver_apply_s (the default)
                           (payloads under PARALLEL_MIN_BYTES in all run on one)
  driver_decode_s          the decode-and-validate part of driver_apply_s (decode_batch)
  driver_apply_numpy_s     driver_apply_s on the numpy path (compiled kernels off,
                           SPARKCNN_NATIVE=0), side by side with the compiled one;
                           driver_native says whether the compiled kernels ran
  payload_bytes            mean bytes of one payload, by model
  driver_apply_merged_s    executor-side merging: for the same models and N as
                           driver_apply_s, seconds of apply_deltas on ONE payload,
                           enc(Σ_k decode(p_k)) of the N payloads (float16, as
                           sent), merged by the executors in a tree of twos; no
                           guard (a merged sum has no per-block norm to judge)
  executor_merge_s         one executor's cost of one merge of that tree, by model
                           then tree level l = 1 … log2(max N): decode two payloads
                           of 2^(l-1) deltas each, sum them on the union of their
                           supports, encode once; N blocks pay levels 1 … log2 N
                           one after another (the right subtree's root is built in
                           one merge of its payloads: the same entries, rounded once)
  sparsify_s_per_mparam    threshold selection seconds per million parameters
                           (25 M model); by model in sparsify_s_per_mparam_by_model
Times are the best of a few repetitions on this machine; compare runs side by
side, never against absolute numbers from another machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from unittest import mock

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import emit, exit_status  # noqa: E402
from sparkcnn.compression import SparseDelta, Sparsifier, decode_batch, encode  # noqa: E402
from sparkcnn.compression.delta import Layout  # noqa: E402
from sparkcnn.compression import native  # noqa: E402
from sparkcnn.compression.sparse_sum import DEFAULT_THREADS  # noqa: E402
from sparkcnn.server.apply import apply_deltas  # noqa: E402
from sparkcnn.guard import DivergenceGuard  # noqa: E402
from sparkcnn.ps import ParameterServer  # noqa: E402

DENSITY = 0.001
DENSE_BELOW = 16384  # elements: tensors below this go whole, as in training


def _bn(c: int) -> list[int]:
    return [c] * 4  # gamma, beta, moving mean, moving variance


def layout_cnn_small() -> tuple[int, ...]:
    """~0.2 M: conv5x5(1→32), conv5x5(32→64), dense 3136→48, dense 48→10."""
    return (5 * 5 * 1 * 32, 32, 5 * 5 * 32 * 64, 64, 3136 * 48, 48, 48 * 10, 10)


def layout_cifar_resnet(blocks: int = 5, widths=(32, 64, 128)) -> tuple[int, ...]:
    """~1.9 M: CIFAR ResNet-32 at twice the usual width (basic blocks)."""
    sizes = [3 * 3 * 3 * widths[0], *_bn(widths[0])]
    c_in = widths[0]
    for w in widths:
        for _ in range(blocks):
            sizes += [3 * 3 * c_in * w, *_bn(w), 3 * 3 * w * w, *_bn(w)]
            if c_in != w:
                sizes += [c_in * w, *_bn(w)]  # 1x1 projection shortcut
            c_in = w
    return tuple(sizes + [c_in * 10, 10])


def layout_resnet50() -> tuple[int, ...]:
    """~25.6 M: ResNet-50 (bottlenecks 3-4-6-3, 1000 classes), BN with moving stats."""
    sizes = [7 * 7 * 3 * 64, *_bn(64)]
    c_in = 64
    for w, n in zip((64, 128, 256, 512), (3, 4, 6, 3)):
        for i in range(n):
            sizes += [c_in * w, *_bn(w), 3 * 3 * w * w, *_bn(w), w * 4 * w, *_bn(4 * w)]
            if i == 0:
                sizes += [c_in * 4 * w, *_bn(4 * w)]
            c_in = 4 * w
    return tuple(sizes + [c_in * 1000, 1000])


MODELS = {"0.2M": layout_cnn_small, "2M": layout_cifar_resnet, "25M": layout_resnet50}


def random_delta(layout, density: float, rng) -> SparseDelta:
    """Uniformly random support on the big tensors, every entry of the small ones."""
    sizes = np.asarray(layout, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    big = sizes >= DENSE_BELOW
    # Draw positions in the concatenation of the big tensors, then map back.
    span = np.concatenate([[0], np.cumsum(sizes[big])])
    pos = np.unique(rng.integers(0, span[-1], size=int(round(density * span[-1]))))
    t = np.searchsorted(span, pos, side="right") - 1
    sparse_idx = pos - span[t] + offsets[:-1][big][t]
    dense_idx = np.concatenate(
        [np.arange(offsets[i], offsets[i + 1]) for i in np.flatnonzero(~big)] or [np.empty(0, np.int64)]
    )
    idx = np.sort(np.concatenate([sparse_idx, dense_idx]))
    vals = (rng.standard_normal(idx.size) * 1e-3).astype(np.float32)
    return SparseDelta(int(offsets[-1]), idx, vals)


def best_of(fn, repeat: int) -> tuple[float, float]:
    """Least wall-clock and least CPU seconds of ``repeat`` calls.

    CPU time is what the code costs; on a shared machine wall time also
    counts waiting for a core.
    """
    wall = cpu = float("inf")
    for _ in range(repeat):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall = min(wall, time.perf_counter() - w0)
        cpu = min(cpu, time.process_time() - c0)
    return wall, cpu


def merge_payloads(payloads: list[bytes], layout: Layout, value_dtype: str = "float16") -> bytes:
    """What an executor sends up after merging: ``encode(Σ_k decode(payloads[k]))``.

    The sum is sparse_sum's rule (``acc[indices] += values``, payload by payload,
    float32) on the union of the supports, so its cost grows with the entries,
    not with P; one encode at the end (``value_dtype``: the wire's, float16 in
    training, so the merged values are rounded once more).
    """
    batch = decode_batch(payloads, layout, threads=1)
    if batch.errors:
        k, err = next(iter(batch.errors.items()))
        raise ValueError(f"payload {k} does not decode: {err}")
    deltas = [batch.delta(k) for k in range(len(payloads))]
    idx = np.sort(np.concatenate([d.indices for d in deltas]), kind="stable")  # sorted runs: merged fast
    if idx.size:  # the union of the supports, ascending (np.unique hashes: 10x slower here)
        idx = idx[np.concatenate([[True], idx[1:] != idx[:-1]])]
    acc = np.zeros(idx.size, np.float32)
    for d in deltas:  # each delta's indices are unique: plain fancy-index add
        acc[np.searchsorted(idx, d.indices)] += d.values
    return encode(SparseDelta(batch.size, idx, acc), layout, value_dtype=value_dtype)


def codec_bytes_per_nonzero(rng) -> dict:
    n = 1_000_000
    out = {}
    for density in (0.01, 0.001):
        idx = np.sort(rng.choice(n, size=int(density * n), replace=False))
        delta = SparseDelta(n, idx, rng.standard_normal(idx.size).astype(np.float32))
        out[str(density)] = round(len(encode(delta, (n,), value_dtype="float16")) / delta.nnz, 4)
    return out


def driver_apply(quick: bool, rng) -> dict:
    ns = (2, 32, 256) if quick else (2, 8, 32, 128, 256)
    repeat = 3 if quick else 5
    out = {"driver_apply_s": {}, "driver_apply_cpu_s": {}, "driver_apply_1thread_s": {},
           "driver_apply_1thread_cpu_s": {}, "driver_decode_s": {}, "driver_apply_numpy_s": {},
           "payload_bytes": {}, "driver_apply_merged_s": {}, "executor_merge_s": {}}
    for name, make in MODELS.items():
        layout = make()
        size = sum(layout)
        payloads = [encode(random_delta(layout, DENSITY, rng), layout) for _ in range(max(ns))]
        samples = rng.integers(48, 80, size=max(ns)).tolist()  # images per block and round
        ps = ParameterServer(np.ones(size, np.float32), layout, density_down=None)
        guard = DivergenceGuard()
        for key in out:
            out[key][name] = {}
        out["payload_bytes"][name] = int(np.mean([len(p) for p in payloads]))
        for n in ns:
            def apply(threads=None):
                done = apply_deltas(ps, payloads[:n], samples[:n], [0.01] * n, guard=guard, steps=[10] * n,
                                    threads=threads)
                assert len(done.applied) == n, done.rejected  # a rejection would time less work

            wall, cpu = best_of(apply, repeat)
            out["driver_apply_s"][name][str(n)] = round(wall, 5)
            out["driver_apply_cpu_s"][name][str(n)] = round(cpu, 5)
            wall, cpu = best_of(lambda: apply(threads=1), repeat)
            out["driver_apply_1thread_s"][name][str(n)] = round(wall, 5)
            out["driver_apply_1thread_cpu_s"][name][str(n)] = round(cpu, 5)
            wall, _ = best_of(lambda: decode_batch(payloads[:n], layout), repeat)
            out["driver_decode_s"][name][str(n)] = round(wall, 5)
            with mock.patch.dict(os.environ, {"SPARKCNN_NATIVE": "0"}):  # the numpy path
                wall, _ = best_of(apply, repeat)
            out["driver_apply_numpy_s"][name][str(n)] = round(wall, 5)
        _merged(out, name, layout, ps, payloads, samples, ns, repeat)
    out["driver_threads"] = DEFAULT_THREADS
    out["driver_native"] = native.enabled()
    return out


def _merged(out: dict, name: str, layout, ps: ParameterServer, payloads: list[bytes], samples: list[int],
            ns, repeat: int) -> None:
    """``driver_apply_merged_s`` and ``executor_merge_s`` of one model (see the module docstring)."""
    merged = {1: payloads[0]}  # N -> the merge of payloads[:N], as the tree's root sends it
    for level in range(1, int(np.log2(max(ns))) + 1):
        half = 2 ** (level - 1)
        a = merged[half]  # the left subtree's root; the right one's holds payloads[half:2 half]
        b = merge_payloads(payloads[half:2 * half], layout) if half > 1 else payloads[1]
        wall, _ = best_of(lambda: merge_payloads([a, b], layout), repeat)
        out["executor_merge_s"][name][str(level)] = round(wall, 5)
        merged[2 * half] = merge_payloads([a, b], layout)
    for n in ns:
        def apply():
            done = apply_deltas(ps, [merged[n]], [sum(samples[:n])], [0.01], steps=[10 * n])
            assert done.applied == (0,), done.rejected

        wall, _ = best_of(apply, repeat)
        out["driver_apply_merged_s"][name][str(n)] = round(wall, 5)


def sparsify_s_per_mparam(quick: bool, rng) -> dict:
    out = {}
    sparsifier = Sparsifier("threshold", dense_below=DENSE_BELOW)
    for name, make in MODELS.items():
        layout = make()
        flat = rng.standard_normal(sum(layout)).astype(np.float32)
        seconds, _ = best_of(lambda: sparsifier.indices(flat, layout, DENSITY), 3 if quick else 5)
        out[name] = round(seconds / (flat.size / 1e6), 6)
    return out


def measure_sparsify_share(density: float = 0.001, steps: int = 10, reps: int = 5) -> dict:
    """Sparsify + encode time over the compute time of one round (fmnist_cnn, H local steps).

    The round is the worker's real TF loop (single-thread, as in a 1-core task) on real
    Fashion-MNIST; the sparse side is the worker's error-feedback step and wire encode.
    """
    import os
    import sys

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench._common import DATA, ensure_data
    from sparkcnn.worker.blockstore import read_block
    from sparkcnn.compression import ErrorFeedback, Sparsifier, encode
    from sparkcnn.protocol import TaskSpec
    from sparkcnn.worker.trainer import Trainer, batch_indices

    ensure_data()
    x, y = read_block(os.path.join(DATA, "train"), 2, 0)
    spec = TaskSpec(run_id="share", num_blocks=2, test_blocks=1,
                    model_name="fmnist_cnn", input_shape=x.shape[1:], num_classes=10, seed=0, batch_size=64,
                    momentum=0.9, weight_decay=0.0, layout=())
    tr = Trainer(spec)
    layout = tuple(int(np.prod(w.shape)) for w in tr.weights)
    ef = ErrorFeedback(layout, Sparsifier("threshold", 1000), "float16")
    tr.train(x, y, [batch_indices(len(y), 64, 0, 0, 0, i) for i in range(3)], 0.05)  # trace
    compute, sparse = [], []
    for r in range(reps):
        w = tr.get_flat()
        t = time.perf_counter()
        tr.train(x, y, [batch_indices(len(y), 64, 0, 1, 0, r * steps + i) for i in range(steps)], 0.05)
        compute.append(time.perf_counter() - t)
        delta = w - tr.get_flat()
        t = time.perf_counter()
        sent = ef.step(delta, density, lr=0.05, weights=None)
        encode(sent, layout, value_dtype="float16")
        sparse.append(time.perf_counter() - t)
    c, s_ = float(np.median(compute)), float(np.median(sparse))
    return {"sparsify_share_of_compute": s_ / c, "round_compute_s": c, "sparsify_encode_s": s_,
            "params": int(sum(layout)), "steps_per_round": steps, "density": density}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer N and repetitions (< 60 s)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)

    t0 = time.perf_counter()
    driver = driver_apply(args.quick, rng)
    by_model = sparsify_s_per_mparam(args.quick, rng)
    result = {
        "bench": "scale",
        "quick": args.quick,
        "density": DENSITY,
        "dense_below": DENSE_BELOW,
        "model_params": {name: sum(make()) for name, make in MODELS.items()},
        "codec_bytes_per_nonzero": codec_bytes_per_nonzero(rng),
        **driver,
        "sparsify_s_per_mparam": by_model["25M"],
        "sparsify_s_per_mparam_by_model": by_model,
        "machine": {
            "cpus": os.cpu_count(),
            "load_average_1m": round(os.getloadavg()[0], 2),  # > cpus: timings include contention
            "python": platform.python_version(),
            "numpy": np.__version__,
        },
        "wall_s": None,
    }
    share = measure_sparsify_share(reps=3 if args.quick else 7)
    result["sparsify_share_of_compute"] = share.pop("sparsify_share_of_compute")
    result["sparsify_share_detail"] = share
    result.setdefault("targets", {}).update({"sparsify_share_of_compute": "<= 0.05",
                                             "codec_bytes_per_nonzero": {"0.01": "<= 3.2", "0.001": "<= 3.5"},
                                             "driver_apply_s[25M][256]": "<= 0.3"})
    result["wall_s"] = round(time.perf_counter() - t0, 2)
    emit(result)


if __name__ == "__main__":
    sys.exit(exit_status("scale", main()))
