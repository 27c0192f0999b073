"""The values the group's members exchange, and their JSON forms (pure, torch-free).

Everything read from outside the process (etcd values, control-channel lines) goes through
:func:`parse`: size and depth limits, no duplicate keys, no NaN (:mod:`worker.jobspec.jsonlimits`), then a
field-by-field check that names the field it refuses (:class:`RecordError`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from worker.jobspec.jsonlimits import JSONRefused, loads

MAX_RECORD_BYTES = 1 << 20  # a generation record of ~10k members; control lines are smaller
MAX_DEPTH = 8
ROLES = ("member", "spare", "joiner")


class RecordError(ValueError):
    """A record from etcd or a peer that is not what this version of the worker writes."""


def parse(data: bytes | str, *, what: str, max_bytes: int = MAX_RECORD_BYTES) -> dict[str, Any]:
    try:
        value = loads(
            data, max_bytes=max_bytes, max_depth=MAX_DEPTH, what=what,
            reject_duplicate_keys=True, reject_non_finite=True,
        )  # fmt: skip
    except JSONRefused as exc:
        raise RecordError(str(exc)) from None
    if not isinstance(value, dict):
        raise RecordError(f"{what}: expected a JSON object, got {type(value).__name__}")
    return value


def dump(value: Any) -> bytes:
    raw = asdict(value) if hasattr(value, "__dataclass_fields__") else value
    return json.dumps(raw, separators=(",", ":"), sort_keys=True).encode()


def _get(raw: dict[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    if key not in raw:
        raise RecordError(f"{what}: field {key!r} is missing")
    value = raw[key]
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise RecordError(f"{what}: field {key!r} must be a number, not a boolean")
    if not isinstance(value, kind):
        raise RecordError(f"{what}: field {key!r} has type {type(value).__name__}")
    return value


def _strings(raw: dict[str, Any], key: str, what: str) -> tuple[str, ...]:
    values = _get(raw, key, list, what)
    if not all(isinstance(v, str) for v in values):
        raise RecordError(f"{what}: field {key!r} must be a list of strings")
    return tuple(values)


@dataclass(frozen=True, slots=True)
class MemberInfo:
    """One worker process as the group knows it (etcd ``members/<member_id>``, the hello)."""

    member_id: str
    role: str
    control: str  # host:port of its control server
    launch_id: str = ""
    node_index: int = 0
    local_rank: int = 0
    pid: int = 0
    generation: int = -1
    version: int = 0

    @property
    def order(self) -> tuple[int, int, str]:
        """Rank order among newcomers: node, then local rank, then id (same on every reader)."""
        return (self.node_index, self.local_rank, self.member_id)

    @staticmethod
    def from_json(raw: dict[str, Any], what: str = "member") -> MemberInfo:
        role = _get(raw, "role", str, what)
        if role not in ROLES:
            raise RecordError(f"{what}: role {role!r} is not one of {', '.join(ROLES)}")
        return MemberInfo(
            member_id=_get(raw, "member_id", str, what), role=role, control=_get(raw, "control", str, what),
            launch_id=_get(raw, "launch_id", str, what), node_index=_get(raw, "node_index", int, what),
            local_rank=_get(raw, "local_rank", int, what), pid=_get(raw, "pid", int, what),
            generation=_get(raw, "generation", int, what), version=_get(raw, "version", int, what),
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class GenRecord:
    """A generation of the group (etcd ``gen``, written by compare-and-set; the fencing token).

    ``members`` in rank order, ``addrs`` their control addresses, ``launch_ids`` the node apps
    that started them (the service's names for them; empty when unknown); ``leader`` hosts the
    generation's store and the control hub; ``state`` is ``gathering`` while the first
    generation's leader waits for members, ``formed`` otherwise."""

    generation: int
    members: tuple[str, ...]
    addrs: tuple[str, ...]
    leader: str
    leader_addr: str
    store: str
    world_size: int
    state: str = "formed"
    reason: str = ""
    incident: str = ""
    formed_at: float = 0.0
    launch_ids: tuple[str, ...] = ()

    def rank_of(self, member_id: str) -> int | None:
        return self.members.index(member_id) if member_id in self.members else None

    def candidates(self) -> list[tuple[str, str]]:
        """Who leads the next generation, in order: this leader, then the members by rank."""
        out = [(self.leader, self.leader_addr)]
        out += [(m, a) for m, a in zip(self.members, self.addrs, strict=True) if m != self.leader]
        return out

    def to_json(self) -> dict[str, Any]:
        raw = asdict(self)
        raw["members"], raw["addrs"], raw["launch_ids"] = (
            list(self.members),
            list(self.addrs),
            list(self.launch_ids),
        )
        return raw

    @staticmethod
    def from_json(raw: dict[str, Any], what: str = "generation record") -> GenRecord:
        members, addrs = _strings(raw, "members", what), _strings(raw, "addrs", what)
        world = _get(raw, "world_size", int, what)
        state = _get(raw, "state", str, what)
        if state not in ("formed", "gathering"):
            raise RecordError(f"{what}: state {state!r} is not formed or gathering")
        if len(addrs) != len(members) or (state == "formed" and world != len(members)):
            raise RecordError(f"{what}: {len(members)} members, {len(addrs)} addresses, world size {world}")
        if len(set(members)) != len(members):
            raise RecordError(f"{what}: a member appears twice")
        launch_ids = _strings(raw, "launch_ids", what) if "launch_ids" in raw else ()
        if launch_ids and len(launch_ids) != len(members):
            raise RecordError(f"{what}: {len(members)} members, {len(launch_ids)} launch ids")
        return GenRecord(
            generation=_get(raw, "generation", int, what), members=members, addrs=addrs,
            leader=_get(raw, "leader", str, what), leader_addr=_get(raw, "leader_addr", str, what),
            store=_get(raw, "store", str, what), world_size=world, state=state,
            reason=_get(raw, "reason", str, what), incident=_get(raw, "incident", str, what),
            formed_at=float(_get(raw, "formed_at", (int, float), what)), launch_ids=launch_ids,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Checkin:
    """A member of generation ``generation`` reporting to the next leader after a failure."""

    member_id: str
    generation: int
    version: int
    has_state: bool
    failed_at: float
    error: str = ""
    in_window: bool = False
    dead: tuple[str, ...] = field(default_factory=tuple)

    def to_json(self) -> dict[str, Any]:
        raw = asdict(self)
        raw["dead"] = list(self.dead)
        return raw

    @staticmethod
    def from_json(raw: dict[str, Any], what: str = "checkin") -> Checkin:
        return Checkin(
            member_id=_get(raw, "member_id", str, what), generation=_get(raw, "generation", int, what),
            version=_get(raw, "version", int, what), has_state=_get(raw, "has_state", bool, what),
            failed_at=float(_get(raw, "failed_at", (int, float), what)),
            error=_get(raw, "error", str, what)[:300], in_window=_get(raw, "in_window", bool, what),
            dead=_strings(raw, "dead", what),
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Desired:
    """What the service wants (etcd ``desired``): node count and spares."""

    nodes: int
    spares: int = 0
    epoch: int = 0

    @staticmethod
    def from_json(raw: dict[str, Any], what: str = "desired") -> Desired:
        nodes = _get(raw, "nodes", int, what)
        if nodes < 1:
            raise RecordError(f"{what}: nodes must be at least 1, got {nodes}")
        return Desired(
            nodes=nodes, spares=_get(raw, "spares", int, what), epoch=_get(raw, "epoch", int, what)
        )
