"""Re-formation decisions (plan.decide), table-driven: who is kept at which rank, who fills the
holes, when the group waits, shrinks or gives up, and the split-brain rule."""

from __future__ import annotations

import pytest

from worker.recovery.plan import Fallback, Form, Newcomer, Policy, View, Wait, decide, has_quorum

FIXED3 = Policy(min_world=3, max_world=3, join_window_s=1.0, replacement_timeout_s=30.0)
ELASTIC = Policy(min_world=1, max_world=3, join_window_s=1.0, replacement_timeout_s=30.0)


def spare(name: str, node: int = 9) -> Newcomer:
    return Newcomer(name, "spare", (node, 0, name))


def joiner(name: str, node: int = 9) -> Newcomer:
    return Newcomer(name, "joiner", (node, 0, name))


def view(
    old: str = "abc",
    checked: str = "ab",
    dead: str = "",
    newcomers: tuple[Newcomer, ...] = (),
    desired: int | None = None,
) -> View:
    return View(
        old=tuple(old), checked_in=frozenset(checked), dead=frozenset(dead), newcomers=newcomers,
        leader=checked[0] if checked else newcomers[0].member_id, since=100.0, desired_world=desired,
    )  # fmt: skip


CASES = [
    # name, view, policy, now, expected type, members (rank order) or None
    ("crash of the last rank, spare fills its slot", view(dead="c", newcomers=(spare("s"),)), FIXED3, 100.0,
     Form, "abs"),
    ("crash of the leader's rank 0, spare takes rank 0",
     view(checked="bc", dead="a", newcomers=(spare("s"),)), FIXED3, 100.0, Form, "sbc"),
    ("crash of rank 1 with a spare", view(checked="ac", dead="b", newcomers=(spare("s"),)), FIXED3, 100.0,
     Form, "asc"),
    ("spares before joiners, lowest first", view(checked="a", dead="bc",
     newcomers=(joiner("j", 0), spare("t", 5), spare("s", 4))), FIXED3, 100.0, Form, "ast"),
    ("fixed size and no newcomer: wait for a replacement", view(dead="c"), FIXED3, 100.0, Wait, None),
    ("fixed size, the replacement arrives", view(dead="c", newcomers=(joiner("j"),)), FIXED3, 105.0,
     Form, "abj"),
    ("fixed size, no replacement by the deadline", view(dead="c"), FIXED3, 130.0, Fallback, None),
    ("elastic: shrink at once", view(dead="c"), ELASTIC, 100.0, Form, "ab"),
    ("two killed at W=3, elastic: shrink to 1", view(checked="a", dead="bc"), ELASTIC, 100.0, Form, "a"),
    ("two killed at W=3, fixed: wait", view(checked="a", dead="bc"), FIXED3, 100.0, Wait, None),
    ("a member neither dead nor checked in: wait for the window", view(), ELASTIC, 100.5, Wait, None),
    ("a stalled member past the window is left out", view(newcomers=(spare("s"),)), FIXED3, 101.0,
     Form, "abs"),
    ("a stalled member past the window, elastic: shrink", view(), ELASTIC, 101.0, Form, "ab"),
    ("scale-up: joiners appended", view(old="ab", checked="ab", newcomers=(joiner("j"),), desired=3),
     ELASTIC, 100.0, Form, "abj"),
    ("scale-down: the lowest ranks stay", view(checked="abc", desired=2), ELASTIC, 100.0, Form, "ab"),
    ("first generation: joiners in node order, leader included", View((), frozenset(), frozenset(),
     (joiner("z", 2), joiner("y", 0), joiner("x", 1)), "z", 100.0, 3), FIXED3, 100.0, Form, "yxz"),
    ("first generation: the leader is kept when there are more joiners", View((), frozenset(), frozenset(),
     (joiner("w", 3), joiner("z", 4), joiner("y", 0), joiner("x", 1)), "z", 100.0, 3), FIXED3, 100.0,
     Form, "yxz"),
    ("first generation: a spare is not a member", View((), frozenset(), frozenset(),
     (joiner("y", 0), spare("s", 1), joiner("x", 2)), "y", 100.0, 3), FIXED3, 100.0, Wait, None),
    ("first generation of an elastic job waits for its size", View((), frozenset(), frozenset(),
     (joiner("y", 0),), "y", 100.0, 3), ELASTIC, 100.0, Wait, None),
    ("first generation of an elastic job: smaller at the deadline", View((), frozenset(), frozenset(),
     (joiner("y", 0), joiner("x", 1)), "y", 100.0, 3), ELASTIC, 130.0, Form, "yx"),
    ("first generation: too few yet", View((), frozenset(), frozenset(), (joiner("y", 0),), "y", 100.0, 3),
     FIXED3, 100.0, Wait, None),
    ("split brain: minority waits", view(checked="a", dead=""), ELASTIC, 101.0, Wait, None),
    ("split brain: minority gives up at the deadline", view(checked="a", dead=""), ELASTIC, 131.0,
     Fallback, None),
]  # fmt: skip


@pytest.mark.parametrize(("name", "v", "policy", "now", "kind", "members"), CASES, ids=[c[0] for c in CASES])
def test_decide(name: str, v: View, policy: Policy, now: float, kind: type, members: str | None) -> None:
    decision = decide(v, policy, now)
    assert isinstance(decision, kind), decision
    if isinstance(decision, Form):
        assert decision.members == tuple(members or "")
        assert decision.world_size == len(members or "")
        assert set(decision.promoted) == {n.member_id for n in v.newcomers} & set(decision.members)
        assert v.leader in decision.members
    if isinstance(decision, Wait):
        assert decision.until > now and decision.reason


def test_lost_and_leaving_are_named() -> None:
    decision = decide(view(checked="ab", dead="c", newcomers=(spare("s"),)), FIXED3, 100.0)
    assert isinstance(decision, Form)
    assert decision.lost == ("c",) and decision.leaving == ()
    decision = decide(view(checked="abc", desired=1), ELASTIC, 100.0)
    assert isinstance(decision, Form)
    assert decision.members == ("a",) and decision.leaving == ("b", "c") and decision.lost == ()


def test_pause_explicit_on_an_elastic_job_waits_then_shrinks_at_the_deadline() -> None:
    policy = Policy(
        min_world=1, max_world=3, while_waiting="pause", join_window_s=1, replacement_timeout_s=30
    )
    assert isinstance(decide(view(dead="c"), policy, 100.0), Wait)
    late = decide(view(dead="c"), policy, 130.0)
    assert isinstance(late, Form) and late.members == ("a", "b")


@pytest.mark.parametrize(
    ("old", "checked", "dead", "quorum"),
    [
        ("abc", "ab", "", True),
        ("abc", "a", "", False),
        ("abc", "a", "c", True),  # a tie (1 of 2 living) goes to the lowest living rank: a
        ("abc", "b", "c", False),
        ("abc", "b", "a", True),  # 1 of 2 living (b, c), b is the lowest living rank
        ("abc", "c", "a", False),
        ("ab", "a", "", True),  # W=2, the rank-0 side of a tie
        ("ab", "b", "", False),
        ("abcd", "cd", "", False),
        ("abcd", "ab", "", True),
    ],
)
def test_split_brain_rule(old: str, checked: str, dead: str, quorum: bool) -> None:
    assert has_quorum(tuple(old), frozenset(checked), frozenset(dead)) is quorum


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_world": 0, "max_world": 2}, "min_world"),
        ({"min_world": 3, "max_world": 2}, "min_world"),
        ({"min_world": 2, "max_world": 5, "unit": 2}, "multiples"),
        ({"min_world": 1, "max_world": 2, "while_waiting": "sometimes"}, "while_waiting"),
    ],
)
def test_policy_refuses_nonsense(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Policy(**kwargs)  # type: ignore[arg-type]


def test_nodes_of_several_processes() -> None:
    policy = Policy(min_world=2, max_world=6, unit=2)
    assert [policy.fit(n) for n in range(8)] == [0, 0, 2, 2, 4, 4, 6, 6]
    decision = decide(view(old="abcdef", checked="abcd", dead="ef"), policy, 100.0)
    assert isinstance(decision, Form) and decision.members == tuple("abcd")
