"""The compiled kernels on or off, for tests that check them against their numpy references."""

from unittest import mock


def compiled(on: bool):
    """A context in which ``sparkcnn.compression.native`` is in use (``on``) or off (``SPARKCNN_NATIVE=0``)."""
    return mock.patch.dict("os.environ", {} if on else {"SPARKCNN_NATIVE": "0"})
