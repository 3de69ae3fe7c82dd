"""Messages of the streaming transport: typed dataclasses, encoded field by field, no pickle.

    message = b"SCW2" | u32 header length | header (UTF-8 JSON) | u32 count | (u64 length | bytes)*
    header  = {"type": <class name>, "fields": {<field>: <value>, ...}}

A field's value is its JSON value; a ``bytes`` field is the index of its blob;
a nested message (``StreamPlan``, ``DownlinkMsg``, ``StateArray``) is an object
of its own fields, a tuple of them a list. :func:`decode` takes the classes it
accepts and refuses, naming the field, an unknown type, an unknown, missing or
mistyped field, a blob used twice or never, and trailing bytes. So nothing
malformed reaches the engine: the driver decodes every message with it, after
checking its size against the cap. Standard library only.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import struct
import types
import typing

MAGIC = b"SCW2"
MAX_HEADER = 64 * 1024
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


class WireError(ValueError):
    """A message that does not parse, or whose fields are not its type's."""


def encode(msg) -> bytes:
    """``msg`` (a frozen dataclass of the protocol) as one wire message."""
    blobs: list[bytes] = []
    header = {"type": type(msg).__name__, "fields": _fields_out(msg, blobs)}
    h = json.dumps(header, separators=(",", ":")).encode()
    parts = [MAGIC, _U32.pack(len(h)), h, _U32.pack(len(blobs))]
    for b in blobs:
        parts += [_U64.pack(len(b)), b]
    return b"".join(parts)


def decode(buf, accept: tuple[type, ...]):
    """The message in ``buf``, an instance of one of ``accept``; :class:`WireError` otherwise."""
    header, blobs = _split(buf)
    kinds = {c.__name__: c for c in accept}
    name = header.get("type")
    if not isinstance(name, str) or name not in kinds:
        raise WireError(f"message type {name!r} is not one of {sorted(kinds)}")
    used: set[int] = set()
    msg = _build(kinds[name], header.get("fields"), blobs, used, name)
    if len(used) != len(blobs):
        raise WireError(f"{name}: {len(blobs) - len(used)} blob(s) belong to no field")
    return msg


# -- field by field ------------------------------------------------------------------------------
# Each class's fields are read once into small functions (``_writers``/``_reader``), so a message
# costs a few calls per field, not a walk of its type hints.
def _fields_out(msg, blobs: list[bytes]) -> dict:
    return {name: out(getattr(msg, name), blobs) for name, out in _writers(type(msg))}


def _blob_out(v, blobs: list[bytes]) -> int:
    blobs.append(bytes(v))
    return len(blobs) - 1


def _plain_out(v, blobs: list[bytes]):
    return v


def _value_out(v, blobs: list[bytes]):
    """Any value, by what it is (a field whose type allows several kinds)."""
    if isinstance(v, (bytes, bytearray, memoryview)):
        return _blob_out(v, blobs)
    if dataclasses.is_dataclass(v):
        return _fields_out(v, blobs)
    if isinstance(v, tuple):
        return [_value_out(x, blobs) for x in v]
    return v


@functools.lru_cache(maxsize=None)
def _writers(cls: type) -> tuple[tuple[str, object], ...]:
    """(name, writer) of each field of ``cls``: a blob index for bytes, the value for JSON scalars."""
    hints = typing.get_type_hints(cls)
    plain = (bool, int, float, str)
    return tuple((f.name, _blob_out if hints[f.name] is bytes else _plain_out if hints[f.name] in plain
                  else _value_out) for f in dataclasses.fields(cls))


@functools.lru_cache(maxsize=None)
def _spec(cls: type) -> tuple[tuple[str, object, bool], ...]:
    """(name, reader, required) of each field of ``cls``."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, _reader(hints[f.name]),
                  f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                 for f in dataclasses.fields(cls))


@functools.lru_cache(maxsize=None)
def _names(cls: type) -> frozenset[str]:
    return frozenset(name for name, _, _ in _spec(cls))


def _build(cls: type, fields, blobs: list[bytes], used: set[int], where: str):
    if not isinstance(fields, dict):
        raise WireError(f"{where}: expected an object of fields")
    if not _names(cls).issuperset(fields):
        raise WireError(f"{where}: unknown field {sorted(set(fields) - _names(cls))[0]!r}")
    kwargs = {}
    for name, read, required in _spec(cls):
        if name not in fields:
            if required:
                raise WireError(f"{where}.{name}: missing")
            continue
        kwargs[name] = read(fields[name], blobs, used, f"{where}.{name}")
    return cls(**kwargs)


def _scalar(typ: type, what: str, ok: tuple[type, ...]):
    def read(v, blobs, used, where):
        if type(v) not in ok:
            raise WireError(f"{where}: expected {what}, got {type(v).__name__}")
        return typ(v) if typ is float else v
    return read


def _read_blob(v, blobs: list[bytes], used: set[int], where: str) -> bytes:
    if type(v) is not int or not 0 <= v < len(blobs) or v in used:
        raise WireError(f"{where}: expected the index of an unused blob, got {v!r}")
    used.add(v)
    return blobs[v]


@functools.lru_cache(maxsize=None)
def _reader(typ):
    """``read(v, blobs, used, where)`` for a field of type ``typ``, checking ``v`` against it."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(typ)
        (inner,) = [t for t in options if t is not type(None)]
        read_inner, nullable = _reader(inner), type(None) in options

        def read_optional(v, blobs, used, where):
            return None if v is None and nullable else read_inner(v, blobs, used, where)
        return read_optional
    if origin is tuple:
        read_item = _reader(typing.get_args(typ)[0])

        def read_tuple(v, blobs, used, where):
            if not isinstance(v, list):
                raise WireError(f"{where}: expected a list, got {type(v).__name__}")
            return tuple(read_item(x, blobs, used, f"{where}[{i}]") for i, x in enumerate(v))
        return read_tuple
    if dataclasses.is_dataclass(typ):
        return lambda v, blobs, used, where: _build(typ, v, blobs, used, where)
    if typ is bytes:
        return _read_blob
    scalars = {bool: ("a bool", (bool,)), int: ("an int", (int,)), float: ("a number", (int, float)),
               str: ("a string", (str,))}
    if typ in scalars:
        return _scalar(typ, *scalars[typ])

    def unsupported(v, blobs, used, where):  # a protocol field of an unsupported type
        raise WireError(f"{where}: no wire form for {typ!r}")
    return unsupported


def _split(buf) -> tuple[dict, list[bytes]]:
    """(header, blobs) of one message; its framing checked."""
    mv = memoryview(buf)
    if len(mv) < 12 or bytes(mv[:4]) != MAGIC:
        raise WireError("not a sparkcnn stream message")
    (hlen,) = _U32.unpack_from(mv, 4)
    if hlen > MAX_HEADER or 8 + hlen + 4 > len(mv):
        raise WireError(f"header length {hlen} out of range")
    try:
        header = json.loads(bytes(mv[8:8 + hlen]), parse_constant=_constant)
    except ValueError:
        raise WireError("header is not JSON") from None
    if not isinstance(header, dict):
        raise WireError("header is not an object")
    pos = 8 + hlen
    (count,) = _U32.unpack_from(mv, pos)
    pos += 4
    blobs = []
    for _ in range(count):
        if pos + 8 > len(mv):
            raise WireError("truncated blob length")
        (n,) = _U64.unpack_from(mv, pos)
        pos += 8
        if pos + n > len(mv):
            raise WireError("truncated blob")
        blobs.append(bytes(mv[pos:pos + n]))
        pos += n
    if pos != len(mv):
        raise WireError("trailing bytes")
    return header, blobs


def _constant(name: str) -> float:
    """JSON's NaN and ±Infinity (a diverging task's loss) as floats."""
    return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}[name]
