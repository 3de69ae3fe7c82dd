"""The notebook API: ``sparkcnn.fit(config, data=...) -> Result``.

    import sparkcnn
    result = sparkcnn.fit({"train": {"epochs": 1}}, data=df)   # df: image + label columns
    result.history[-1]["test_accuracy"], result.model, result.plot()

It runs the same training as ``sparkcnn train`` (same run directory, same
summary) in the caller's SparkSession. Ctrl-C (``KeyboardInterrupt``) cancels
the run's Spark jobs and keeps a checkpoint of the rounds done; ``fit(...,
run_dir=result_dir, resume=True)`` continues it.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

from sparkcnn import config as config_mod
from sparkcnn.config_sections import Config
from sparkcnn.errors import BadInput


@dataclasses.dataclass
class Result:
    """What a training run left: its records, the model, where it lives."""

    summary: dict                  # as summary.json: accuracy, wall time, bytes, session, ...
    run_dir: str                   # runs/<run_id> (or a URI): config.yaml, metrics.jsonl, model.keras, report
    history: list[dict]            # one record per epoch (test_accuracy, test_loss, train_loss, ...)
    rounds: list[dict]             # one record per exchange (loss, images_per_s, bytes_up, ...)
    _model: object = dataclasses.field(default=None, repr=False)

    @property
    def model(self):
        """The trained Keras model (loaded from ``model.keras`` on first use)."""
        if self._model is None:
            import keras

            from sparkcnn import runfs

            path = runfs.join(self.run_dir, "model.keras")
            if not runfs.is_uri(path):
                self._model = keras.saving.load_model(path, safe_mode=True)
                return self._model
            with tempfile.TemporaryDirectory(prefix="sparkcnn-model-") as tmp:  # Keras reads local files
                local = os.path.join(tmp, "model.keras")
                with open(local, "wb") as fh:
                    fh.write(runfs.read_bytes(path))
                self._model = keras.saving.load_model(local, safe_mode=True)
        return self._model

    def plot(self):
        """A matplotlib Figure: training loss per exchange and test accuracy per epoch."""
        import matplotlib.pyplot as plt

        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
        a.plot([r["round"] + 1 for r in self.rounds], [r["loss"] for r in self.rounds], lw=1)
        a.set(title="training loss", xlabel="exchange", ylabel="loss")
        scored = [e for e in self.history if e.get("test_accuracy") is not None]
        b.plot([e["epoch"] + 1 for e in scored], [e["test_accuracy"] for e in scored], "o-")
        b.set(title="test accuracy" if scored else "test accuracy (no test data)", xlabel="epoch",
              ylabel="accuracy")
        for ax in (a, b):
            ax.grid(alpha=0.3)
        fig.suptitle(self.summary.get("run_id", ""))
        fig.tight_layout()
        plt.close(fig)  # returned, not shown twice in notebooks
        return fig

    def _repr_html_(self) -> str:
        acc = self.summary.get("test_accuracy")
        acc = "–" if acc is None else f"{acc:.4f}"
        return (f"<b>sparkcnn</b> {self.summary.get('run_id')}: test accuracy {acc}, "
                f"{self.summary.get('wall_s', 0):.1f} s, {len(self.history)} epochs, "
                f"<code>{self.run_dir}</code>")


def as_config(config=None) -> Config:
    """A Config from a YAML path, a dict of sections, a list of ``section.key=value`` strings or a Config."""
    if config is None:
        return config_mod.load(None)
    if isinstance(config, Config):
        return config.validate()
    if isinstance(config, str):
        return config_mod.load(config)
    if isinstance(config, dict):
        return config_mod.from_dict(config, "fit(config=...)")
    if isinstance(config, (list, tuple)) and all(isinstance(x, str) for x in config):
        return config_mod.load(None, config)
    raise BadInput(f"fit(config=...): expected a YAML path, a dict, a list of 'section.key=value' or a "
                   f"Config, got {type(config).__name__}")


def fit(config=None, data=None, *, test_data=None, spark=None, progress=True, run_dir: str | None = None,
        resume: bool = False) -> Result:
    """Train; see the module docstring and :mod:`sparkcnn.data.source` for ``data``.

    ``progress``: True for a progress bar (a widget in notebooks), False for none,
    or an object with ``round(rec, total)`` and ``epoch(rec)``.
    """
    from sparkcnn import runfs
    from sparkcnn.metrics import read_jsonl
    from sparkcnn.train import resume_config, train

    if resume:
        if run_dir is None:
            raise BadInput("fit(resume=True) needs run_dir")
        cfg = resume_config(run_dir) if config is None else as_config(config)
    else:
        cfg = as_config(config)
    if progress is True:
        from sparkcnn.metrics import ProgressBar

        progress = ProgressBar()
    summary = train(cfg, progress=progress or None, run_dir=run_dir, resume=resume, data=data,
                    test_data=test_data, spark=spark)
    records = read_jsonl(runfs.join(summary["run_dir"], "metrics.jsonl"))
    return Result(summary=summary, run_dir=summary["run_dir"],
                  history=[r for r in records if r.get("kind") == "epoch"],
                  rounds=[r for r in records if r.get("kind") == "round"])
