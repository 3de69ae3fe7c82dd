"""A real :class:`~sparkcnn.server.run.Run` without Spark or TensorFlow, for the unit tier: a
config, the run's TaskSpec, a small flat weight vector, a backend that only keeps broadcasts,
codec payloads of random sparse deltas, and the server's arithmetic written out in numpy (the
expected ``W``), from DESIGN §3 and server/apply.py's docstring rather than from the code.
"""

from __future__ import annotations

import functools

import numpy as np

from sparkcnn import config
from sparkcnn.compression.codec import decode, encode
from sparkcnn.compression.delta import SparseDelta
from sparkcnn.errors import CodecError
from sparkcnn.protocol import Arrival, TaskSpec
from sparkcnn.server.run import Run, RunShape

LAYOUT = (300, 12, 1100, 10)  # a few tensors; dense_below=64 makes the small ones travel dense
P = sum(LAYOUT)
BATCH = 8
CLASSES = 10
LOSS = 0.5  # per sample: well below ln 10, so the guard's chance rule stays quiet


class Broadcast:
    def __init__(self, value: bytes):
        self.value = value


class FakeBackend:
    """What Run, Downlink, PushHandler and Cut ask of a backend when nothing runs on executors."""

    resident = True

    def __init__(self):
        self.live: list[Broadcast] = []
        self.stopped = False

    def broadcast(self, data: bytes) -> Broadcast:
        b = Broadcast(data)
        self.live.append(b)
        return b

    def unpersist(self, b: Broadcast) -> None:
        self.live.remove(b)

    def stop(self) -> None:
        self.stopped = True


@functools.lru_cache(maxsize=None)
def make_cfg(mode: str, *, h: int, blocks: int, max_staleness: int = 8, staleness: str = "inverse",
             density_down: float = 0.0, value_dtype: str = "float16", epochs: int = 1, extra: tuple = ()):
    """Plain threshold compression (the server scale is 1 at H > 1 and lr at H = 1, DGC's
    per-step form); the guard's norm rule never judges (warm-up past any run here) and a loss
    never stops the run, so every delta that decodes is applied. Cached: a Config is frozen."""
    return config.load(None, [
        f"engine.mode={mode}", f"data.num_blocks={blocks}", f"train.steps_per_round={h}",
        f"train.batch_size={BATCH}", f"train.epochs={epochs}", "train.lr=0.05", "train.lr_warmup_epochs=0",
        "train.lr_schedule=constant", "compression.method=threshold", "compression.density=0.05",
        f"compression.density_down={density_down}", f"compression.value_dtype={value_dtype}",
        "compression.dense_below=64", f"ps.max_staleness={max_staleness}", f"ps.staleness={staleness}",
        "guard.warmup_steps=1000000000", "guard.max_spikes_in_a_row=0", "guard.max_chance_in_a_row=0",
        "guard.loss_spike_factor=1e300", *extra])


def make_spec(cfg) -> TaskSpec:
    """The TaskSpec train.build_spec would make for this config and LAYOUT."""
    c = cfg.compression
    return TaskSpec(run_id="fake", num_blocks=cfg.data.num_blocks, test_blocks=0, model_name="fake",
                    input_shape=(4, 4, 1), num_classes=CLASSES, seed=cfg.run.seed,
                    batch_size=cfg.train.batch_size, momentum=cfg.train.momentum,
                    weight_decay=cfg.train.weight_decay, layout=LAYOUT, value_dtype=c.value_dtype,
                    method=c.method, dense_below=c.dense_below, momentum_mode=c.momentum,
                    per_step=cfg.train.steps_per_round == 1, sparse_downlink=c.density_down > 0)


def initial_weights(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(P).astype(np.float32)


def make_run(cfg, spec, w0: np.ndarray, shape: RunShape, backend: FakeBackend | None = None) -> Run:
    return Run(cfg, spec, w0, shape, backend=backend or FakeBackend(),
               evaluate=lambda W, epoch: {"test_loss": 0.0, "test_accuracy": 0.0, "test_samples": 0})


@functools.lru_cache(maxsize=None)
def payloads(value_dtype: str, n: int = 61) -> tuple[bytes, ...]:
    """Codec bytes of ``n`` random deltas: a few entries (applied in place), a quarter, or every one."""
    rng = np.random.default_rng(7)
    out = []
    for i in range(n):
        nnz = int(rng.integers(1, 20)) if i % 3 == 0 else P // 4 if i % 3 == 1 else P
        idx = np.sort(rng.choice(P, nnz, replace=False)).astype(np.int64)
        vals = (rng.standard_normal(nnz) * 0.01).astype(np.float32)
        out.append(encode(SparseDelta(P, idx, vals), LAYOUT, value_dtype=value_dtype))
    return tuple(out)


def random_payload(rng: np.random.Generator, value_dtype: str) -> bytes:
    """One of :func:`payloads`, at random (encoding a new one per result costs a millisecond)."""
    pool = payloads(value_dtype)
    return pool[int(rng.integers(len(pool)))]


def arrival(block: int, seq: int, base_version: int, first_step: int, steps: int, lr: float,
            payload: bytes, density: float = 0.05) -> Arrival:
    samples = steps * BATCH
    return Arrival(block=block, seq=seq, base_version=base_version, payload=payload, samples=samples,
                   steps=steps, first_step=first_step, lr=lr, density=density, loss_sum=LOSS * samples,
                   correct=0, nnz=0, state_reset=False, state_stale=False, replica_resync=False, view_bytes=0,
                   executor=f"fake:{block}")


# -- the server's arithmetic, written out ------------------------------------------------------------
def server_scale(h: int, lr: float) -> float:
    """Threshold compression: at H = 1 the workers send lr-free momentum-corrected gradients
    (DGC) and the server multiplies by lr; at H > 1 they send lr-scaled deltas (scale 1)."""
    return lr if h == 1 else 1.0


def staleness_lambda(tau: int, rule: str) -> float:
    return 1.0 / tau if rule == "inverse" and tau >= 1 else 1.0


def apply_expected(W: np.ndarray, terms) -> np.ndarray:
    """``W - Σ_k float32(w_k) · decode(payload_k)``, summed in float32 in the given order;
    ``terms``: (w_k, payload_k) of the payloads that decode."""
    G = np.zeros(P, np.float32)
    for w, payload in terms:
        d = decode(payload, LAYOUT)
        G[d.indices] += np.float32(w) * d.values
    return W - G


def decodes(payload: bytes) -> bool:
    """Whether the codec takes ``payload`` (anything but a CodecError is a bug and propagates)."""
    try:
        decode(payload, LAYOUT)
    except CodecError:
        return False
    return True
