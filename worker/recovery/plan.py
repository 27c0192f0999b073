"""The decisions of a re-formation, as pure functions of plain values (torch-free).

* :func:`decide`: who forms the next generation, at which world size and in which rank order,
  or whether to wait, or to give up.
* :func:`choose_source`: which member's state every other member takes.
* :func:`committed_records`: the trace checker's rule for versions a failure superseded.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

WAITING = ("auto", "pause", "shrink")


@dataclass(frozen=True, slots=True)
class Policy:
    """Sizes in processes. ``unit``: processes per node (a world size is a multiple of it).
    ``while_waiting``: with too few members for the target size, ``pause`` waits for a
    replacement (no step at another size: bitwise equality holds), ``shrink`` goes on smaller at
    once; ``auto`` pauses when the size is fixed (``min == max``) and shrinks otherwise."""

    min_world: int
    max_world: int
    unit: int = 1
    while_waiting: str = "auto"
    join_window_s: float = 1.0
    replacement_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.unit < 1:
            raise ValueError(
                f"recovery policy: unit (processes per node) must be at least 1, got {self.unit}"
            )
        if not self.unit <= self.min_world <= self.max_world:
            raise ValueError(
                f"recovery policy: need unit <= min_world <= max_world, got {self.unit}, "
                f"{self.min_world}, {self.max_world}"
            )
        if self.min_world % self.unit or self.max_world % self.unit:
            raise ValueError(
                f"recovery policy: world sizes must be multiples of {self.unit} processes per node"
            )
        if self.while_waiting not in WAITING:
            raise ValueError(
                f"recovery.while_waiting: {self.while_waiting!r} is not one of {', '.join(WAITING)}"
            )
        if self.join_window_s < 0 or self.replacement_timeout_s < 0:
            raise ValueError("recovery policy: join_window_s and replacement_timeout_s must be >= 0")

    def fit(self, count: int) -> int:
        """The largest allowed world size of at most ``count`` processes (0 if none)."""
        size = min(count, self.max_world)
        return size - size % self.unit

    def shrinks(self) -> bool:
        if self.while_waiting == "auto":
            return self.min_world < self.max_world
        return self.while_waiting == "shrink"


@dataclass(frozen=True, slots=True)
class Newcomer:
    """A connected process without a rank: a warm ``spare`` or a ``joiner`` (fresh process)."""

    member_id: str
    role: str
    order: tuple[int, int, str]


@dataclass(frozen=True, slots=True)
class View:
    """What the deciding leader knows. ``old``: the broken generation's members in rank order
    (empty for the first generation); ``checked_in``/``dead``: old members that reported or are
    known gone; ``desired_world``: the service's wish (None: keep the old size)."""

    old: tuple[str, ...]
    checked_in: frozenset[str]
    dead: frozenset[str]
    newcomers: tuple[Newcomer, ...]
    leader: str
    since: float
    desired_world: int | None = None


@dataclass(frozen=True, slots=True)
class Wait:
    until: float
    reason: str


@dataclass(frozen=True, slots=True)
class Form:
    """The next generation: ``members`` in rank order."""

    members: tuple[str, ...]
    promoted: tuple[str, ...]  # newcomers given a rank
    lost: tuple[str, ...]  # old members not in it (dead or stalled)
    leaving: tuple[str, ...]  # old members alive but not kept (a smaller target)
    reason: str

    @property
    def world_size(self) -> int:
        return len(self.members)


@dataclass(frozen=True, slots=True)
class Fallback:
    reason: str


Decision = Wait | Form | Fallback


def has_quorum(old: tuple[str, ...], checked_in: frozenset[str], dead: frozenset[str]) -> bool:
    """More than half of the old members not known dead checked in; a tie goes to the side that
    holds the lowest old rank among them (the split-brain rule)."""
    living = [m for m in old if m not in dead]
    present = sum(1 for m in living if m in checked_in)
    if 2 * present != len(living):
        return 2 * present > len(living)
    return bool(living) and living[0] in checked_in


def _fill_order(view: View) -> list[Newcomer]:
    """Spares first (they are warm), then joiners; the first generation is made of joiners only
    (a spare stands by from the start: its warmed-up state is not the job's)."""
    if not view.old:
        return sorted((n for n in view.newcomers if n.role == "joiner"), key=lambda n: n.order)
    return sorted(view.newcomers, key=lambda n: (n.role != "spare", n.order))


def _members(view: View, survivors: list[str], fill: list[Newcomer], world: int) -> Form:
    old = view.old
    if old and world == len(old):  # same size: survivors keep their ranks, newcomers take the holes
        slots = list(old)
        holes = [i for i, m in enumerate(old) if m not in survivors]
        for i, newcomer in zip(holes, fill, strict=False):
            slots[i] = newcomer.member_id
        members = slots
    else:
        kept = survivors[:world]
        members = kept + [n.member_id for n in fill[: world - len(kept)]]
        if not old and view.leader not in members:  # the first generation's leader is one of its members
            members[-1] = view.leader
            order = {n.member_id: n.order for n in view.newcomers}
            members.sort(key=lambda m: order[m])
    chosen = set(members)
    return Form(
        members=tuple(members),
        promoted=tuple(n.member_id for n in view.newcomers if n.member_id in chosen),
        lost=tuple(m for m in old if m not in view.checked_in),
        leaving=tuple(m for m in survivors if m not in chosen),
        reason="",
    )


def decide(view: View, policy: Policy, now: float) -> Decision:
    """The next step of a re-formation (see the module docstring). Pure. The first generation
    waits for its full size until the deadline (processes start seconds apart); a re-formation
    shrinks at once when the policy allows it."""
    old = view.old
    pending = [m for m in old if m not in view.checked_in and m not in view.dead]
    window_end = view.since + policy.join_window_s
    deadline = view.since + policy.replacement_timeout_s
    if pending and now < window_end:
        return Wait(window_end, f"waiting for {len(pending)} member(s) to check in")
    if old and not has_quorum(old, view.checked_in, view.dead):
        if now < deadline:
            return Wait(deadline, "fewer than half of the living members checked in (split-brain rule)")
        return Fallback("no majority of the group's living members checked in before the deadline")
    survivors = [m for m in old if m in view.checked_in]
    fill = _fill_order(view)
    target = policy.fit(view.desired_world or len(old) or policy.max_world)
    target = max(target, policy.min_world)
    available = len(survivors) + len(fill)
    smaller = policy.fit(available)
    if available >= target:
        form = _members(view, survivors, fill, target)
        why = "same size" if target == len(old) else f"world size {len(old)} -> {target}"
    elif smaller >= policy.min_world and ((policy.shrinks() and old) or now >= deadline):
        form = _members(view, survivors, fill, smaller)
        why = f"shrink: {target} wanted, {available} available"
    elif now < deadline:
        return Wait(deadline, f"waiting for {target - available} replacement(s) to reach world size {target}")
    else:
        return Fallback(
            f"{available} process(es) available, at least {policy.min_world} needed; no replacement "
            f"within {policy.replacement_timeout_s:g} s"
        )
    return Form(form.members, form.promoted, form.lost, form.leaving, why)


# ------------------------------------------------------------------------ state agreement

DIGEST_WORDS = 2  # a 128-bit digest as two int64
SUMMARY_LEN = 4 + 3 * DIGEST_WORDS


@dataclass(frozen=True, slots=True)
class Summary:
    """One member's state as the agreement all-gathers it (fixed size, no pickle)."""

    rank: int
    has_state: bool
    version: int
    last_generation: int
    in_window: bool
    spec: bytes  # 16 bytes each
    state_digest: bytes
    progress_digest: bytes


def _words(digest: bytes) -> list[int]:
    if len(digest) != 8 * DIGEST_WORDS:
        raise ValueError(f"a digest of {len(digest)} bytes; 16 expected")
    return [int.from_bytes(digest[i : i + 8], "little", signed=True) for i in range(0, len(digest), 8)]


def _bytes(words: list[int]) -> bytes:
    return b"".join(w.to_bytes(8, "little", signed=True) for w in words)


def encode_summary(s: Summary) -> list[int]:
    head = [int(s.has_state), s.version, s.last_generation, int(s.in_window)]
    return head + _words(s.spec) + _words(s.state_digest) + _words(s.progress_digest)


def decode_summary(rank: int, values: list[int]) -> Summary:
    if len(values) != SUMMARY_LEN:
        raise ValueError(f"a summary of {len(values)} words; {SUMMARY_LEN} expected")
    d = DIGEST_WORDS
    return Summary(
        rank=rank, has_state=bool(values[0]), version=values[1], last_generation=values[2],
        in_window=bool(values[3]), spec=_bytes(values[4 : 4 + d]),
        state_digest=_bytes(values[4 + d : 4 + 2 * d]), progress_digest=_bytes(values[4 + 2 * d : 4 + 3 * d]),
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Source:
    """``rank`` sends version ``version`` to ``receivers``; ``holders`` already hold it.
    ``voided``: windows started from ``version`` that no living member committed (0 or 1)."""

    rank: int
    version: int
    receivers: tuple[int, ...]
    holders: tuple[int, ...]
    voided: int


@dataclass(frozen=True, slots=True)
class Diverged:
    """Members that must agree do not: the storage checkpoint decides (event names the ranks)."""

    ranks: tuple[int, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class NoState:
    reason: str


def choose_source(summaries: list[Summary]) -> Source | Diverged | NoState:
    """The newest version among members with valid state, sent by the lowest rank holding it;
    every member at that version must hold the same state (else :class:`Diverged`); nobody with
    state means the storage checkpoint (:class:`NoState`). Pure; the same on every member."""
    ordered = sorted(summaries, key=lambda s: s.rank)
    specs = Counter(s.spec for s in ordered)
    if len(specs) > 1:
        common = specs.most_common(1)[0][0]
        odd = tuple(s.rank for s in ordered if s.spec != common)
        return Diverged(odd, f"ranks {list(odd)} were built from another training configuration (spec hash)")
    holders = [s for s in ordered if s.has_state]
    if not holders:
        return NoState("no member holds a valid state")
    top = max(s.version for s in holders)
    at_top = [s for s in holders if s.version == top]
    ref = at_top[0]
    if any((s.state_digest, s.progress_digest) != (ref.state_digest, ref.progress_digest) for s in at_top):
        ranks = tuple(s.rank for s in at_top)
        return Diverged(ranks, f"ranks {list(ranks)} are all at version {top} but hold different states")
    receivers = tuple(s.rank for s in ordered if not (s.has_state and s.version == top))
    voided = int(any(s.has_state and s.in_window and s.version == top for s in ordered))
    return Source(ref.rank, top, receivers, tuple(s.rank for s in at_top), voided)


# ------------------------------------------------------------------------ sample traces


def committed_records(records: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The records of the committed history: for each ``version``, those of the highest
    ``generation`` that wrote it (a window committed only by members that then died is written
    again by the generation that retrained it)."""
    rows = list(records)
    newest: dict[int, int] = {}
    for row in rows:
        newest[row["version"]] = max(newest.get(row["version"], -1), row["generation"])
    return [row for row in rows if row["generation"] == newest[row["version"]]]


def superseded_versions(records: Iterable[Mapping[str, Any]]) -> set[int]:
    """Versions written by more than one generation (each must be a voided window)."""
    seen: dict[int, set[int]] = {}
    for row in records:
        seen.setdefault(row["version"], set()).add(row["generation"])
    return {v for v, gens in seen.items() if len(gens) > 1}


def sample_counts(records: Iterable[Mapping[str, Any]]) -> Counter[tuple[int, int]]:
    """How often each ``(epoch, index)`` was trained in the committed history."""
    counts: Counter[tuple[int, int]] = Counter()
    for row in committed_records(records):
        counts.update((row["epoch"], int(i)) for i in row["indices"])
    return counts
