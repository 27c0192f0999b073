"""The hand-over's last all-gather, read: every member agrees on the state, and every member may
keep its DDP wrapper only when all report the same real bucket layout."""

from __future__ import annotations

from worker.recovery.agree import read_agreement

STATE = (7, -3)
LAYOUT = (11, 12)
NONE = (0, 0)


def row(ok: int = 1, state: tuple[int, int] = STATE, layout: tuple[int, int] = LAYOUT) -> tuple[int, ...]:
    return (ok, *state, *layout)


def test_same_state_and_layout_keeps_the_wrappers() -> None:
    assert read_agreement([row(), row(), row()]) == (True, True)


def test_a_member_that_is_not_ok_or_holds_other_bits_agrees_on_nothing() -> None:
    assert read_agreement([row(), row(ok=0), row()]) == (False, False)
    assert read_agreement([row(), row(state=(7, -4)), row()]) == (False, False)


def test_another_layout_or_none_at_all_means_every_member_wraps_afresh() -> None:
    assert read_agreement([row(), row(layout=(11, 13)), row()]) == (True, False)
    assert read_agreement([row(), row(layout=NONE), row()]) == (True, False)
    assert read_agreement([row(layout=NONE), row(layout=NONE)]) == (True, False)  # nobody holds one
