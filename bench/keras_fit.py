"""The seed tables' reference row: single-process Keras ``model.fit`` on a run config.

    python bench/keras_fit.py --config conf/seed/fmnist_keras.yaml [--set section.key=value ...]

Reads the config as ``sparkcnn train`` does (same file, same ``--set``, same checks) and trains
its model, data, batch size, SGD momentum, weight decay and learning-rate schedule (linear warm-up
from lr/10, then the decay, per step) in this one process with TensorFlow's default threads,
``data.augment`` and ``data.normalize`` as the executors apply them, evaluating on the test split
after every epoch as the parallel runs do (the wall includes it). ``model.fit`` takes the arrays
as they are (its own shuffle) without augmentation, else one minibatch of a fresh permutation per
step, augmented with the draws of block 0 (``sparkcnn.data.augment``). Weight decay is Keras's
own (decoupled, ``w -= lr * wd * w`` per step), not the L2 term the engines add to the gradient:
the same at momentum 0, close at 0.9. The engine and compression sections do not apply.

Prints one JSON line (test accuracy per epoch, wall, images/s, seconds to 0.70, 0.80, 0.88, 0.90) and
writes it to ``<run.out_dir>/<run.name>/summary.json``. Bad input: one line naming it, exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: bench/ is on the path, the repository is not
    sys.path.insert(0, ROOT)


def _first(acc: list[float], walls: list[float], target: float) -> float | None:
    return next((w for a, w in zip(acc, walls) if a >= target), None)


def fit(cfg) -> dict:
    """Train ``cfg`` with ``model.fit`` (module docstring); its summary."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np

    from sparkcnn.compression.warmup import lr_at
    from sparkcnn.data.augment import AUGMENTERS, batch_rng
    from sparkcnn.data.normalize import normalization
    from sparkcnn.data.parquet_io import read_meta, read_split_numpy
    from sparkcnn.models import build_model

    t, path = cfg.train, cfg.data.path
    x, y = read_split_numpy(os.path.join(path, "train"))
    xt, yt = read_split_numpy(os.path.join(path, "test"))
    meta = read_meta(os.path.join(path, "train"))
    norm = normalization(cfg.data.normalize, (meta.mean, meta.std), path, meta.channels)
    keras.utils.set_random_seed(cfg.run.seed)
    steps = len(x) // t.batch_size  # full minibatches per epoch
    m = build_model(cfg.model.name, x.shape[1:], len(meta.classes), cfg.run.seed, normalize=norm)
    opt = keras.optimizers.SGD(t.lr, momentum=t.momentum, weight_decay=t.weight_decay or None)
    m.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
    acc, walls, t0 = [], [], time.perf_counter()

    class Schedule(keras.callbacks.Callback):
        epoch = 0

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            opt.learning_rate.assign(lr_at(self.epoch + batch / steps, base_lr=t.lr, total_epochs=t.epochs,
                                           warmup_epochs=t.lr_warmup_epochs, schedule=t.lr_schedule))

        def on_epoch_end(self, epoch, logs=None):
            walls.append(time.perf_counter() - t0)
            acc.append(float(m.evaluate(xt, yt, batch_size=1000, verbose=0)[1]))

    if cfg.data.augment == "none":
        m.fit(x, y, batch_size=t.batch_size, epochs=t.epochs, shuffle=True, verbose=0, callbacks=[Schedule()])
    else:
        augment, order = AUGMENTERS[cfg.data.augment], np.random.default_rng(cfg.run.seed)

        def batches():
            for epoch in range(t.epochs):
                perm = order.permutation(len(x))
                for step in range(steps):
                    idx = perm[step * t.batch_size:(step + 1) * t.batch_size]
                    yield augment(x[idx], batch_rng(cfg.run.seed, 0, epoch, step)), y[idx]

        m.fit(batches(), epochs=t.epochs, steps_per_epoch=steps, shuffle=False, verbose=0,
              callbacks=[Schedule()])
    wall = time.perf_counter() - t0
    return {"test_accuracy": acc[-1], "accuracy_per_epoch": acc, "wall_s": wall, "epochs": t.epochs,
            "images_per_s": t.epochs * steps * t.batch_size / wall,
            "time_to_0_88_s": _first(acc, walls, 0.88), "time_to_0_90_s": _first(acc, walls, 0.90),
            # CIFAR-10's marks (bench/cifar_seeds.py)
            "time_to_0_70_s": _first(acc, walls, 0.70), "time_to_0_80_s": _first(acc, walls, 0.80),
            "seed": cfg.run.seed, "lr": t.lr, "momentum": t.momentum, "batch_size": t.batch_size,
            "model": cfg.model.name}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", "-c", required=True, help="YAML run config (conf/seed/*_keras.yaml)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    a = ap.parse_args(argv)
    from sparkcnn import config
    from sparkcnn.errors import BadInput

    try:
        cfg = config.load(a.config, a.overrides)
        for split in (os.path.join(cfg.data.path, s) for s in ("train", "test")):
            if not os.path.isdir(split):
                raise BadInput(f"data.path {cfg.data.path!r}: no prepared split at {split}")
        summary = fit(cfg)
    except BadInput as e:
        print(f"bench/keras_fit.py: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    run_dir = os.path.join(cfg.run.out_dir, cfg.run.name)
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "summary.json"), "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=2)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
