"""``python -m sparkcnn``: the ``sparkcnn`` command line (same parser, same exit codes)."""

import sys

from sparkcnn.cli import main

if __name__ == "__main__":
    sys.exit(main())
