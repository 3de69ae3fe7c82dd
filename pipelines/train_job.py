"""spark-submit entry point: ``spark-submit pipelines/train_job.py --config conf/x.yaml [--set k=v ...]``.

Uses the SparkSession that spark-submit provides and exits with the CLI's codes
(0 ok, 2 bad input, 3 diverged, 1 other), so schedulers such as Airflow can
tell a bad config from a crash.
"""

import sys

from sparkcnn.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", "--no-progress", *sys.argv[1:]]))
