"""The stream's wire: every protocol message round-trips, and a bad one is refused naming its field."""

from __future__ import annotations

import json
import struct

import pytest

from sparkcnn.protocol import Done, DownlinkMsg, Push, Reply, StateArray, StreamPlan
from sparkcnn.streamwire import WireError, decode, encode

DL = DownlinkMsg(version=4, base_version=3, checksum_after="ab12", assign=False, payload=b"\x01\x02")
PLAN = StreamPlan(seq0=3, first_step=9, steps=4, h=1, expect_state=-1, lookahead=True, overlap=True, attempt=0)


def _frame(header: dict, *blobs: bytes) -> bytes:
    h = json.dumps(header).encode()
    return b"".join([b"SCW2", struct.pack("<I", len(h)), h, struct.pack("<I", len(blobs)),
                     *[struct.pack("<Q", len(b)) + b for b in blobs]])


def _reply_fields(**kw) -> dict:
    return {"lr": 0.1, "density": 0.01, "tau": 2, "retrain": False, "send_state": False, "refused": "",
            "dense": 0, "dense_version": 4, **kw}


def test_every_message_round_trips_with_nested_messages_and_blobs():
    reply = Reply(lr=0.05, density=0.001, tau=1, retrain=False, send_state=True, refused="", dense=b"",
                  dense_version=4, downlinks=(DL, DL), plan=PLAN)
    push = Push(seq=1, first_step=9, steps=1, samples=32, base_version=3, have=4, attempt=0, lr=0.05,
                density=0.001, loss_sum=float("nan"), correct=7, nnz=2, compute_s=0.01, wait_s=0.0, down_bytes=9,
                state_reset=False, resync=True, pid=1, executor="h:/d", payload=b"xyz",
                state=(StateArray(name="momentum", dtype="float32", data=b"\0" * 8),))
    assert decode(encode(reply), (Reply,)) == reply
    got = decode(encode(push), (Push, Done))
    assert got.state == push.state and got.payload == b"xyz" and got.loss_sum != got.loss_sum  # NaN kept
    assert decode(encode(Done()), (Push, Done)) == Done()
    assert decode(encode(Reply(**{**reply.__dict__, "plan": None, "downlinks": ()})), (Reply,)).plan is None


@pytest.mark.parametrize("fields, blobs, why", [
    (_reply_fields(tau=True), [b""], "Reply.tau: expected an int, got bool"),
    (_reply_fields(lr="0.1"), [b""], "Reply.lr: expected a number, got str"),
    (_reply_fields(retrain=1), [b""], "Reply.retrain: expected a bool, got int"),
    (_reply_fields(downlinks={}), [b""], "Reply.downlinks: expected a list, got dict"),
    (_reply_fields(downlinks=[{"version": 4, "base_version": "3", "checksum_after": "", "assign": False,
                               "payload": 1}]), [b"", b"d"], "Reply.downlinks[0].base_version: expected an int"),
    (_reply_fields(plan=[]), [b""], "Reply.plan: expected an object of fields"),
    (_reply_fields(dense=1), [b""], "Reply.dense: expected the index of an unused blob, got 1"),
    (_reply_fields(downlinks=[{"version": 4, "base_version": 3, "checksum_after": "", "assign": False,
                               "payload": 0}]), [b""], "Reply.downlinks[0].payload: expected the index of an "
                                                        "unused blob, got 0"),
    ({k: v for k, v in _reply_fields().items() if k != "tau"}, [b""], "Reply.tau: missing"),
    (_reply_fields(extra=1), [b""], "Reply: unknown field 'extra'"),
    (_reply_fields(), [b"", b"spare"], "Reply: 1 blob(s) belong to no field"),
])
def test_a_bad_message_is_refused_naming_its_field(fields, blobs, why):
    with pytest.raises(WireError, match="^" + why.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                       .replace(")", r"\)")):
        decode(_frame({"type": "Reply", "fields": fields}, *blobs), (Reply,))


def test_framing_and_type_are_checked_before_any_field():
    good = encode(Done())
    for buf, why in [(b"SCW1" + good[4:], "not a sparkcnn stream message"), (good + b"\0", "trailing bytes"),
                     (good, "message type 'Done' is not one of ['Push']")]:
        with pytest.raises(WireError, match=why.replace("[", r"\[").replace("]", r"\]")):
            decode(buf, (Push,))
