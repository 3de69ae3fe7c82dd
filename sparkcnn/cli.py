"""Command line: ``sparkcnn prepare | train | evaluate | predict | report``.

Exit codes: 0 success · 2 bad input or config (one line naming the file, field
or value) · 3 training diverged · 1 anything else.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from sparkcnn.errors import BadInput, SparkCNNError

log = logging.getLogger("sparkcnn")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse exits 2 already; keep the one-line form
        self.exit(2, f"sparkcnn: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="sparkcnn", description="Data-parallel CNN training on Spark with sparse communication.")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    pr = sub.add_parser("prepare", help="validate raw files and write a Parquet dataset")
    pr.add_argument("--format", required=True, choices=["idx", "cifar10-bin", "cifar10-py", "parquet"])
    pr.add_argument("--source", required=True, help="directory (or file, for parquet) with the raw data")
    pr.add_argument("--out", required=True, help="output dataset directory (replaced atomically)")
    pr.add_argument("--height", type=int)
    pr.add_argument("--width", type=int)
    pr.add_argument("--channels", type=int)

    tr = sub.add_parser("train", help="train a model; writes runs/<run_id>/")
    tr.add_argument("--config", "-c", help="YAML config (default: built-in defaults)")
    tr.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override one config field (repeatable)")
    tr.add_argument("--no-progress", action="store_true", help="no progress bar")
    tr.add_argument("--resume", metavar="RUN_DIR",
                    help="continue runs/<run_id> from its latest checkpoint (same run id and config)")
    tr.add_argument("--run-dir", metavar="DIR",
                    help="train in DIR: a new run there, or, once DIR holds a run (config.yaml), resume it "
                         "with its own config (a scheduler's retry passes the same arguments)")

    ev = sub.add_parser("evaluate", help="test loss and accuracy of a saved model on a prepared split")
    ev.add_argument("--model", required=True, help="model.keras file or run directory")
    ev.add_argument("--data", required=True, help="prepared split directory (e.g. data/fashion-mnist/test)")

    pd = sub.add_parser("predict", help="write predicted classes of a prepared split as CSV")
    pd.add_argument("--model", required=True, help="model.keras file or run directory")
    pd.add_argument("--data", required=True, help="prepared split directory")
    pd.add_argument("--out", required=True, help="CSV file: row,label,predicted,class")

    rp = sub.add_parser("report", help="plots (PNG) and a markdown report from a run directory")
    rp.add_argument("run_dir")
    return p


def _model_path(path: str) -> str:
    if os.path.isdir(path):
        path = os.path.join(path, "model.keras")
    if not os.path.isfile(path):
        raise BadInput(f"--model: no model file at {path}")
    return path


def _load_model(path: str):
    import keras

    path = _model_path(path)
    try:
        return keras.saving.load_model(path, safe_mode=True)
    except Exception as e:
        raise BadInput(f"{path}: not a loadable Keras model ({type(e).__name__})") from None


def _predict(model, split_dir: str):
    import numpy as np
    from sparkcnn.data.parquet_io import read_meta, read_split_numpy

    meta = read_meta(split_dir)
    x, y = read_split_numpy(split_dir)
    want = tuple(model.input_shape[1:])
    if want != (meta.height, meta.width, meta.channels):
        raise BadInput(f"{split_dir}: images are {meta.height}x{meta.width}x{meta.channels}, "
                       f"the model expects {'x'.join(map(str, want))}")
    logits = model.predict(x, batch_size=1000, verbose=0)
    return meta, y, logits, np.argmax(logits, axis=-1)


def cmd_prepare(a) -> int:
    from sparkcnn.data.prepare import prepare

    summary = prepare(a.format, a.source, a.out, height=a.height, width=a.width, channels=a.channels)
    print(json.dumps(summary, indent=2))
    return 0


def cmd_train(a) -> int:
    from sparkcnn import config
    from sparkcnn.metrics import ProgressBar
    from sparkcnn.train import train

    progress = None if a.no_progress else ProgressBar()
    if a.resume and a.run_dir:
        raise BadInput("--resume and --run-dir: give one of them")
    if a.resume and a.config:
        raise BadInput("--resume uses the run's own config.yaml; drop --config")
    # --run-dir resumes once the directory holds a run; its own config.yaml then wins over --config
    existing = a.resume or (a.run_dir if a.run_dir and os.path.isfile(os.path.join(a.run_dir, "config.yaml"))
                            else None)
    if existing:
        from sparkcnn.train import resume_config

        cfg = resume_config(existing, a.overrides)
        summary = train(cfg, progress=progress, run_dir=existing, resume=True)
    else:
        cfg = config.load(a.config, a.overrides)
        summary = train(cfg, progress=progress, run_dir=a.run_dir)
    print(json.dumps(summary, indent=2))
    return 0


def cmd_evaluate(a) -> int:
    import numpy as np

    model = _load_model(a.model)
    _, y, logits, pred = _predict(model, a.data)
    z = logits - logits.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    loss = float(-logp[np.arange(len(y)), y].mean()) if len(y) else float("nan")
    print(json.dumps({"samples": int(len(y)), "test_loss": loss,
                      "test_accuracy": float((pred == y).mean()) if len(y) else float("nan")}))
    return 0


def cmd_predict(a) -> int:
    from sparkcnn.metrics import atomic_write_text

    model = _load_model(a.model)
    meta, y, _, pred = _predict(model, a.data)
    out_dir = os.path.dirname(os.path.abspath(a.out))
    if not os.path.isdir(out_dir) or not os.access(out_dir, os.W_OK):
        raise BadInput(f"--out {a.out}: directory {out_dir} is missing or not writable")
    lines = ["row,label,predicted,class"]
    lines += [f"{i},{t},{p},{meta.classes[p]}" for i, (t, p) in enumerate(zip(y.tolist(), pred.tolist()))]
    atomic_write_text(a.out, "\n".join(lines) + "\n")
    print(json.dumps({"rows": len(y), "out": a.out}))
    return 0


def cmd_report(a) -> int:
    from sparkcnn.report import write_report

    print(json.dumps(write_report(a.run_dir), indent=2))
    return 0


COMMANDS = {"prepare": cmd_prepare, "train": cmd_train, "evaluate": cmd_evaluate,
            "predict": cmd_predict, "report": cmd_report}


def main(argv=None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # argparse: usage errors (2) and --help (0), already printed
        return int(e.code or 0)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        return COMMANDS[args.command](args)
    except SparkCNNError as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"sparkcnn {args.command}: error: {msg}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"sparkcnn {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
