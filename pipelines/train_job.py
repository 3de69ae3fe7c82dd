"""spark-submit entry point: ``spark-submit [--py-files dist/sparkcnn.zip] pipelines/train_job.py
--config conf/x.yaml [--set k=v ...]`` (the README's two routes).

Uses the SparkSession that spark-submit provides and exits with the CLI's codes
(0 ok, 2 bad input, 3 diverged, 1 other), so schedulers such as Airflow can
tell a bad config from a crash. sparkcnn is installed, or arrives with
``--py-files``: spark-submit puts the zip on this driver's path and ships it to
every executor; nothing here needs a repository checkout beside this file.
"""

import sys


def _main() -> int:
    try:
        from sparkcnn.cli import main
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "sparkcnn":
            raise  # a dependency is missing: its own message says which
        print("train_job: sparkcnn is not importable; install it, or ship it with "
              "--py-files dist/sparkcnn.zip (make dist)", file=sys.stderr)
        return 1
    return main(["train", "--no-progress", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(_main())
