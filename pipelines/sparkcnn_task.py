"""spark-submit application for schedulers: one ``sparkcnn`` command, its exit code kept.

    spark-submit [options] pipelines/sparkcnn_task.py --exit-file F -- train --run-dir D ...

Runs ``sparkcnn <command> ...`` in the driver that spark-submit starts and, before
exiting with the command's code, writes ``{"command": ..., "exit_code": N}`` to ``F``
(a temp file renamed into place). In client mode spark-submit already exits with the
same code; in cluster deploy mode (standalone, YARN) it reports only that the driver
failed, so the scheduler reads the code from ``F``, which must then be on storage the
driver and the scheduler share, like the run directory: a path, or a URI such as
``s3://bucket/runs/x.exit/train.json`` (one object, written whole). A driver killed
by a signal writes nothing: the scheduler sees a plain failure, which it may retry.

Exit codes are the CLI's: 0 success · 2 bad input or config · 3 diverged · 1 other.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile


def write_exit_file(path: str, command: str, code: int) -> None:
    if "://" in path:
        from sparkcnn import runfs

        runfs.write_text(path, json.dumps({"command": command, "exit_code": code}))
        return
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".exit-")
    with os.fdopen(fd, "w") as fh:
        json.dump({"command": command, "exit_code": code}, fh)
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    exit_file = None
    if argv[:1] == ["--exit-file"] and len(argv) > 1:
        exit_file, argv = argv[1], argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    command = next((a for a in argv if not a.startswith("-")), "")
    code = 1  # an exception escaping the CLI is "anything else"
    try:
        from sparkcnn.cli import main as cli

        code = int(cli(argv) or 0)
    finally:
        if exit_file:
            write_exit_file(exit_file, command, code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
