"""The stream's wire: every protocol message round-trips in the documented layout, and a bad one
is refused naming its field."""

from __future__ import annotations

import re
import struct

import pytest

from sparkcnn.protocol import Done, DownlinkMsg, Push, Reply, StateArray, StreamPlan
from sparkcnn.streamwire import WireError, decode, encode

DL = DownlinkMsg(version=4, base_version=3, checksum_after="ab12", assign=False, payload=b"\x01\x02")
PLAN = StreamPlan(seq0=3, first_step=9, steps=4, h=1, expect_state=-1, lookahead=True, overlap=True, attempt=0)


# the layout, written out from the module docstring: an independent reading of the format
def _str(s: bytes) -> bytes:
    return struct.pack("<I", len(s)) + s


def _blob(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def _head(name: bytes) -> bytes:
    return b"SCW3" + struct.pack("<H", len(name)) + name


def _dl(assign: int = 0, checksum: bytes = b"ab12", payload: bytes = b"\x01\x02") -> bytes:
    return struct.pack("<qq", 4, 3) + _str(checksum) + struct.pack("<B", assign) + _blob(payload)


def _plan() -> bytes:
    return struct.pack("<5qBBqq", 3, 9, 4, 1, -1, 1, 1, 0, 0)


def _reply(*, retrain: int = 0, refused: bytes = b"", dense: bytes = _blob(b""), downlinks: bytes | None = None,
           plan: bytes = b"\1" + _plan()) -> bytes:
    downlinks = struct.pack("<I", 2) + _dl() + _dl() if downlinks is None else downlinks
    return (_head(b"Reply") + struct.pack("<ddqBB", 0.05, 0.001, 1, retrain, 1) + _str(refused) + dense
            + struct.pack("<q", 4) + downlinks + plan)


GOOD = Reply(lr=0.05, density=0.001, tau=1, retrain=False, send_state=True, refused="", dense=b"",
             dense_version=4, downlinks=(DL, DL), plan=PLAN)


def test_every_message_round_trips_with_nested_messages_and_blobs():
    push = Push(seq=1, first_step=9, steps=1, samples=32, base_version=3, have=4, attempt=0, lr=0.05,
                density=0.001, loss_sum=float("nan"), correct=7, nnz=2, compute_s=0.01, wait_s=0.0, view_bytes=9,
                state_reset=False, replica_resync=True, pid=1, executor="h:/d é", payload=b"xyz",
                state=(StateArray(name="momentum", dtype="float32", data=b"\0" * 8),), sumsq=(1.5, 2.0))
    assert decode(encode(GOOD), (Reply,)) == GOOD
    got = decode(encode(push), (Push, Done))
    assert got.state == push.state and got.payload == b"xyz" and got.loss_sum != got.loss_sum  # NaN kept
    assert (got.executor, got.sumsq, got.replica_resync, got.state_reset) == ("h:/d é", (1.5, 2.0), True, False)
    assert type(got.lr) is float and type(got.seq) is int and type(got.replica_resync) is bool
    assert decode(encode(Done()), (Push, Done)) == Done()
    assert decode(encode(Reply(**{**GOOD.__dict__, "plan": None, "downlinks": ()})), (Reply,)).plan is None


def test_a_message_is_the_documented_layout():
    """The bytes are those the module docstring describes, field by field, and they decode."""
    assert encode(GOOD) == _reply()
    assert decode(_reply(), (Reply,)) == GOOD


@pytest.mark.parametrize("buf, why", [
    (_reply(retrain=2), "Reply.retrain: expected a bool (0 or 1), got 2"),
    (_reply(refused=b"\xff\xfe"), "Reply.refused: not UTF-8"),
    (_reply(dense=struct.pack("<Q", 10**9)), "Reply.dense: truncated"),
    (_reply(downlinks=struct.pack("<I", 10**6)), "Reply.downlinks: 1000000 items cannot fit in the 59 bytes left"),
    (_reply(downlinks=struct.pack("<I", 1) + _dl(assign=3)), "Reply.downlinks[0].assign: expected a bool (0 or 1), "
                                                               "got 3"),
    (_reply(downlinks=struct.pack("<I", 1) + _dl(checksum=b"\xc3")), "Reply.downlinks[0].checksum_after: not UTF-8"),
    (_reply(plan=b"\2"), "Reply.plan: expected 0 (None) or 1 (a value follows), got 2"),
    (_reply(plan=b"\1" + _plan()[:30]), "Reply.plan.h: truncated"),
    (_reply(plan=b"\0") + b"\0\0\0", "Reply: 3 trailing bytes"),
])
def test_a_bad_message_is_refused_naming_its_field(buf, why):
    with pytest.raises(WireError, match="^" + re.escape(why) + "$"):
        decode(buf, (Reply,))


def test_every_truncation_is_refused_by_name():
    """A message cut anywhere is refused, naming where it stops (or, in its first bytes, its framing)."""
    buf = encode(GOOD)
    for n in range(len(buf)):
        with pytest.raises(WireError) as e:
            decode(buf[:n], (Reply,))
        msg = str(e.value)
        assert (msg.startswith("Reply.") and msg.endswith("truncated") or "items cannot fit" in msg
                or msg in ("not a sparkcnn stream message", "type name length 5 out of range")), (n, msg)


def test_framing_and_type_are_checked_before_any_field():
    good = encode(Done())
    for buf, why in [(b"SCW2" + good[4:], "not a sparkcnn stream message"),
                     (good[:4] + struct.pack("<H", 0) + good[6:], "type name length 0 out of range"),
                     (good + b"\0", "message type 'Done' is not one of ['Push']")]:
        with pytest.raises(WireError, match="^" + re.escape(why) + "$"):
            decode(buf, (Push,))
    with pytest.raises(WireError, match="^Done: 1 trailing bytes$"):
        decode(good + b"\0", (Push, Done))


def test_a_value_its_field_cannot_hold_is_refused_when_encoded():
    with pytest.raises(WireError, match=r"^Reply\.tau: "):
        encode(Reply(**{**GOOD.__dict__, "tau": 2**70}))
    with pytest.raises(WireError, match=r"^Reply\.downlinks\[1\]\.version: "):
        encode(Reply(**{**GOOD.__dict__, "downlinks": (DL, DownlinkMsg(1.5, 3, "", False, b""))}))
