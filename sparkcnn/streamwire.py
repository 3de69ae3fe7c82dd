"""Messages of the streaming transport: a JSON header and byte blobs, no pickle.

    message = b"SCW1" | u32 header length | header (UTF-8 JSON) | u32 count | (u64 length | bytes)*

Both sides speak it over one Arrow Flight ``DoExchange`` stream per task, as
app-metadata buffers; payloads stay the codec's bytes. The driver opens every
message with :func:`unpack` only after checking its size against the cap.
Standard library only.
"""

from __future__ import annotations

import json
import struct

MAGIC = b"SCW1"
MAX_HEADER = 64 * 1024


class WireError(ValueError):
    """A message that does not parse."""


def pack(header: dict, *blobs: bytes) -> bytes:
    h = json.dumps(header, separators=(",", ":")).encode()
    parts = [MAGIC, struct.pack("<I", len(h)), h, struct.pack("<I", len(blobs))]
    for b in blobs:
        parts += [struct.pack("<Q", len(b)), bytes(b)]
    return b"".join(parts)


def unpack(buf) -> tuple[dict, list[bytes]]:
    mv = memoryview(buf)
    if len(mv) < 12 or bytes(mv[:4]) != MAGIC:
        raise WireError("not a sparkcnn stream message")
    (hlen,) = struct.unpack_from("<I", mv, 4)
    if hlen > MAX_HEADER or 8 + hlen + 4 > len(mv):
        raise WireError(f"header length {hlen} out of range")
    try:
        header = json.loads(bytes(mv[8:8 + hlen]))
    except ValueError:
        raise WireError("header is not JSON") from None
    if not isinstance(header, dict):
        raise WireError("header is not an object")
    pos = 8 + hlen
    (count,) = struct.unpack_from("<I", mv, pos)
    pos += 4
    blobs = []
    for _ in range(count):
        if pos + 8 > len(mv):
            raise WireError("truncated blob length")
        (n,) = struct.unpack_from("<Q", mv, pos)
        pos += 8
        if pos + n > len(mv):
            raise WireError("truncated blob")
        blobs.append(bytes(mv[pos:pos + n]))
        pos += n
    if pos != len(mv):
        raise WireError("trailing bytes")
    return header, blobs
