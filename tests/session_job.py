"""Opens sessions with get_or_create_spark and prints what each got (tests/spark/test_session.py).

``session_job.py [MASTER ...]``: one session per argument (``-`` = no master given),
stopped before the next; without arguments one session with no master. Each
prints a line ``SESSION {json}`` with the settings the tests look at.
"""

import json
import sys

from sparkcnn.backends.session import get_or_create_spark

KEYS = ("spark.master", "spark.app.name", "spark.scheduler.mode", "spark.python.worker.reuse",
        "spark.sparkcnn.probe")


def main(masters: list[str]) -> None:
    for master in masters or ["-"]:
        spark = get_or_create_spark("" if master == "-" else master)
        conf = spark.sparkContext.getConf()
        print("SESSION " + json.dumps({k: conf.get(k, None) for k in KEYS}), flush=True)
        spark.stop()


if __name__ == "__main__":
    main(sys.argv[1:])
