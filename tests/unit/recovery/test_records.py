"""Records read from etcd or a peer: round trips, and refusals that name the field."""

from __future__ import annotations

import json

import pytest

from worker.recovery.records import Checkin, Desired, GenRecord, MemberInfo, RecordError, dump, parse

RECORD = GenRecord(
    generation=4, members=("a", "b", "c"), addrs=("h:1", "h:2", "h:3"), leader="b", leader_addr="h:2",
    store="h:9", world_size=3, reason="same size", incident="job/g3", formed_at=12.5,
)  # fmt: skip


def test_round_trips() -> None:
    assert GenRecord.from_json(parse(dump(RECORD.to_json()), what="gen")) == RECORD
    info = MemberInfo("m1", "spare", "h:7", launch_id="L", node_index=2, local_rank=1, pid=5)
    assert MemberInfo.from_json(parse(dump(info), what="member")) == info
    checkin = Checkin("a", 3, 40, True, 1.5, "RuntimeError: x", True, ("c",))
    assert Checkin.from_json(parse(dump(checkin.to_json()), what="checkin")) == checkin
    assert Desired.from_json({"nodes": 3, "spares": 1, "epoch": 2}) == Desired(3, 1, 2)


def test_launch_ids_travel_with_the_members() -> None:
    record = GenRecord.from_json(RECORD.to_json() | {"launch_ids": ["n0", "n1", "n2"]})
    assert record.launch_ids == ("n0", "n1", "n2")
    assert GenRecord.from_json(parse(dump(record.to_json()), what="gen")) == record
    with pytest.raises(RecordError, match="3 members, 1 launch ids"):
        GenRecord.from_json(RECORD.to_json() | {"launch_ids": ["n0"]})


def test_candidates_start_with_the_leader_then_rank_order() -> None:
    assert RECORD.candidates() == [("b", "h:2"), ("a", "h:1"), ("c", "h:3")]
    assert RECORD.rank_of("c") == 2 and RECORD.rank_of("z") is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"generation": "4"}, "'generation' has type str"),
        ({"members": ["a", 1, "c"]}, "'members' must be a list of strings"),
        ({"addrs": ["h:1"]}, "3 members, 1 addresses"),
        ({"world_size": 2}, "world size 2"),
        ({"members": ["a", "a", "c"]}, "appears twice"),
        ({"state": "maybe"}, "state 'maybe'"),
        ({"world_size": True}, "not a boolean"),
    ],
)
def test_bad_generation_record(change: dict[str, object], message: str) -> None:
    raw = RECORD.to_json() | change
    with pytest.raises(RecordError, match=message):
        GenRecord.from_json(raw)


def test_missing_field_is_named() -> None:
    raw = RECORD.to_json()
    del raw["store"]
    with pytest.raises(RecordError, match="'store' is missing"):
        GenRecord.from_json(raw)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"[1, 2]", "expected a JSON object"),
        (b'{"a": 1, "a": 2}', "duplicate key"),
        (b'{"a": NaN}', "non-finite"),
        (b"{" * 20 + b"}" * 20, "nested"),
        (json.dumps({"x": "y" * 100}).encode(), "over the limit"),
    ],
)
def test_parse_limits(data: bytes, message: str) -> None:
    with pytest.raises(RecordError, match=message):
        parse(data, what="line", max_bytes=64)


def test_member_role_and_desired_nodes_refused() -> None:
    with pytest.raises(RecordError, match="role 'boss'"):
        MemberInfo.from_json(json.loads(dump(MemberInfo("m", "member", "h:1"))) | {"role": "boss"})
    with pytest.raises(RecordError, match="nodes must be at least 1"):
        Desired.from_json({"nodes": 0, "spares": 0, "epoch": 0})
