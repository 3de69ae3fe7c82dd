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
import operator
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
    h = _JSON_OUT.encode(header).encode()
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
# Each class's fields are read once into a plan (``_layout``, ``_spec``): a message's plain
# fields are read in one call and type-checked inline, and only its blobs, nested messages and
# tuples cost a call each. The driver and every task handle a push and a reply per step.
def _fields_out(msg, blobs: list[bytes]) -> dict:
    names, values_of, special = _layout(type(msg))
    values = values_of(msg)
    out = dict(zip(names, values))
    for i, name, write in special:  # in field order: blob indices follow the fields
        out[name] = write(values[i], blobs)
    return out


@functools.lru_cache(maxsize=None)
def _layout(cls: type):
    """(field names, msg -> tuple of their values, (index, name, writer) of the fields that are
    not plain JSON scalars)."""
    writers = _writers(cls)
    names = tuple(name for name, _ in writers)
    get = operator.attrgetter(*names) if names else None
    values_of = ((lambda m: ()) if not names else (lambda m: (get(m),)) if len(names) == 1 else get)
    return names, values_of, tuple((i, name, w) for i, (name, w) in enumerate(writers) if w is not _plain_out)


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


_SCALARS = {bool: ("a bool", (bool,)), int: ("an int", (int,)), float: ("a number", (int, float)),
            str: ("a string", (str,))}


@functools.lru_cache(maxsize=None)
def _spec(cls: type) -> tuple[tuple[str, bool, tuple | None, object], ...]:
    """(name, required, accepted JSON types, reader) of each field of ``cls``: a scalar field
    has its accepted types and no reader (checked inline), any other a reader and None."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        scalar = _SCALARS.get(hints[f.name])
        out.append((f.name, required, scalar[1] if scalar else None, None if scalar else _reader(hints[f.name])))
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _names(cls: type) -> frozenset[str]:
    return frozenset(name for name, _, _, _ in _spec(cls))


def _build(cls: type, fields, blobs: list[bytes], used: set[int], where: str):
    if not isinstance(fields, dict):
        raise WireError(f"{where}: expected an object of fields")
    if not _names(cls).issuperset(fields):
        raise WireError(f"{where}: unknown field {sorted(set(fields) - _names(cls))[0]!r}")
    kwargs = {}
    for name, required, ok, read in _spec(cls):
        if name not in fields:
            if required:
                raise WireError(f"{where}.{name}: missing")
            continue
        v = fields[name]
        if read is not None:
            kwargs[name] = read(v, blobs, used, f"{where}.{name}")
        elif type(v) in ok:
            kwargs[name] = float(v) if type(v) is int and float in ok else v
        else:
            raise WireError(f"{where}.{name}: expected {_what(ok)}, got {type(v).__name__}")
    return cls(**kwargs)


def _what(ok: tuple) -> str:
    return next(what for what, types_ in _SCALARS.values() if types_ == ok)


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
    if typ in _SCALARS:
        return _scalar(typ, *_SCALARS[typ])

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
        header = _JSON_IN.decode(str(mv[8:8 + hlen], "utf-8"))
    except ValueError:  # UnicodeDecodeError too
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


# one of each, reused: ``json.dumps``/``loads`` with options build a new one per call
_JSON_OUT = json.JSONEncoder(separators=(",", ":"))
_JSON_IN = json.JSONDecoder(parse_constant=_constant)
