"""Error types that map to the CLI's exit codes.

Exit codes (every command): 0 success · 2 bad input or config · 3 training
diverged · 1 anything else.
"""


class SparkCNNError(Exception):
    """Base class for errors sparkcnn raises on purpose."""

    exit_code = 1


class BadInput(SparkCNNError, ValueError):
    """Bad data file, schema, config value, checkpoint or model builder.

    The message is one line and names the file, field or value at fault.
    """

    exit_code = 2


class CodecError(BadInput):
    """A serialized delta is malformed or carries non-finite values."""


class Diverged(SparkCNNError):
    """Training diverged (non-finite loss or a guard said stop)."""

    exit_code = 3
