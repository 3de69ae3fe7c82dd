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
    pr.add_argument("--format", required=True,
                    choices=["idx", "cifar10-bin", "cifar10-py", "images", "parquet"])
    pr.add_argument("--source", required=True, help="directory (or file, for parquet) with the raw data; "
                    "images: one sub-folder per class, or train/ and test/ holding them")
    pr.add_argument("--out", required=True, help="output dataset directory (replaced atomically)")
    pr.add_argument("--height", type=int)
    pr.add_argument("--width", type=int)
    pr.add_argument("--channels", type=int)
    pr.add_argument("--max-image-pixels", type=int, metavar="N",
                    help="images: refuse an image over N pixels (default: data.max_image_pixels's)")
    pr.add_argument("--no-progress", action="store_true", help="images: no progress bar")

    tr = sub.add_parser("train", help="train a model; writes runs/<run_id>/")
    tr.add_argument("--config", "-c", help="YAML config (default: built-in defaults)")
    tr.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override one config field (repeatable)")
    tr.add_argument("--no-progress", action="store_true", help="no progress bar")
    tr.add_argument("--resume", metavar="RUN_DIR",
                    help="continue runs/<run_id> (a path or a URI such as s3://bucket/runs/<run_id>) "
                         "from its latest checkpoint (same run id and config)")
    tr.add_argument("--run-dir", metavar="DIR",
                    help="train in DIR (a path or a URI): a new run there, or, once DIR holds a run "
                         "(config.yaml), resume it with its own config (a scheduler's retry passes the same "
                         "arguments)")

    ev = sub.add_parser("evaluate",
                        help="accuracy, loss and confusion matrix of a saved model, on the executors")
    pd = sub.add_parser("predict",
                        help="predicted classes of (unlabelled) images as Parquet, on the executors")
    for sp in (ev, pd):
        sp.add_argument("--model", required=True, help="model.keras file or run directory")
        src = sp.add_mutually_exclusive_group(required=True)
        src.add_argument("--data", help="Parquet file, split or URI (e.g. data/fashion-mnist/test)"
                         + (", or a folder of JPEG/PNG images" if sp is pd else ""))
        src.add_argument("--table", help="table name (instead of --data)")
        sp.add_argument("--image-col", default="image", help="image column (default: image)")
        sp.add_argument("--id-cols", default="", metavar="A,B", help="columns passed through to the output")
        sp.add_argument("--batch-size", type=int, default=256, help="images per model call on an executor")
    ev.add_argument("--label-col", default="label", help="label column (default: label)")
    ev.add_argument("--out",
                    help="directory for predictions/ (Parquet), confusion_matrix.png and metrics.json "
                         "(a path or a URI such as s3://bucket/runs/<id>/evaluation; replaced when complete)")
    pd.add_argument("--out", required=True, help="Parquet output directory (replaced when complete)")

    rp = sub.add_parser("report", help="plots (PNG) and a markdown report from a run directory")
    rp.add_argument("run_dir")
    return p


def _scoring_setup(a):
    """What predict and evaluate check before Spark starts: (model bytes, input shape, classes, ids)."""
    from sparkcnn import scoring
    from sparkcnn.inference import load_model_bytes, model_bytes

    path = scoring.model_path(a.model)
    data = model_bytes(path)
    model = load_model_bytes(data, path)
    shape = tuple(int(d) for d in model.input_shape[1:])
    classes = None
    if a.data:
        a.data, classes = scoring.local_input(a.data, shape)
    if a.out:
        scoring.check_out(a.out)
    if a.batch_size < 1:
        raise BadInput(f"--batch-size must be >= 1, got {a.batch_size}")
    ids = [c.strip() for c in a.id_cols.split(",") if c.strip()]
    return data, shape, int(model.output_shape[-1]), classes, ids


def _scoring_spark():
    from sparkcnn.backends import session

    return session.get_or_create_spark(app_name="sparkcnn-score")


def cmd_prepare(a) -> int:
    from sparkcnn.data.prepare import prepare

    summary = prepare(a.format, a.source, a.out, height=a.height, width=a.width, channels=a.channels,
                      max_image_pixels=a.max_image_pixels, progress=not a.no_progress)
    print(json.dumps(summary, indent=2))
    return 0


def cmd_train(a) -> int:
    from sparkcnn import config
    from sparkcnn.metrics import ProgressBar
    from sparkcnn.train import is_run_dir, train

    progress = None if a.no_progress else ProgressBar()
    if a.resume and a.run_dir:
        raise BadInput("--resume and --run-dir: give one of them")
    if a.resume and a.config:
        raise BadInput("--resume uses the run's own config.yaml; drop --config")
    # --run-dir resumes once the directory holds a run; its own config.yaml then wins over --config
    existing = a.resume or (a.run_dir if a.run_dir and is_run_dir(a.run_dir) else None)
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
    from sparkcnn import scoring

    data, shape, num_classes, classes, ids = _scoring_setup(a)
    if classes is not None and len(classes) != num_classes:
        raise BadInput(f"{a.data}: {len(classes)} classes, the model outputs {num_classes}")
    if a.out:
        from sparkcnn import runfs
        from sparkcnn.data.source import is_uri

        if is_uri(a.out) and not runfs.is_uri(a.out):  # file:/x, hdfs:/x: Spark's, not the run directory's
            raise BadInput(f"--out {a.out}: a local path or a URI such as s3://bucket/runs/<id>/evaluation")
        runfs.check(a.out, "--out")  # credentials and bucket, before Spark starts
    result = scoring.evaluate(_scoring_spark(), data, a.data, shape, num_classes, table=a.table,
                              image_col=a.image_col, label_col=a.label_col, id_cols=ids, classes=classes,
                              out=a.out, batch_size=a.batch_size)
    print(json.dumps(result))
    return 0


def cmd_predict(a) -> int:
    from sparkcnn import scoring

    data, shape, _, classes, ids = _scoring_setup(a)
    print(json.dumps(scoring.predict(_scoring_spark(), data, a.data, shape, out=a.out, table=a.table,
                                     image_col=a.image_col, id_cols=ids, classes=classes,
                                     batch_size=a.batch_size)))
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
