from __future__ import annotations

import errno

import pytest

from worker import failpoints
from worker.failpoints import FailpointError, Rule, failpoint, parse


def test_parse_all_modifiers() -> None:
    rules = parse("before_publish_rename=kill@0#2^1, after_grad_sync=nonfinite,x=sleep:0.5@3")
    assert rules["before_publish_rename"] == (Rule("before_publish_rename", "kill", 0, 2, 1),)
    assert rules["after_grad_sync"] == (Rule("after_grad_sync", "nonfinite"),)
    assert rules["x"] == (Rule("x", "sleep:0.5", 3),)


def test_modifiers_in_any_order_and_several_rules_per_name() -> None:
    rules = parse("a=raise^2@1,a=enospc#3")
    assert rules["a"] == (Rule("a", "raise", 1, None, 2), Rule("a", "enospc", None, 3, None))


@pytest.mark.parametrize(
    "text",
    [
        "oops",
        "a=",
        "=kill",
        "a=kill@",
        "a=kill@x",
        "a=kill#0",
        "a=kill@1@2",
        "a=sleep",
        "a=sleep:x",
        "a b=kill",
    ],
)
def test_malformed_is_a_clear_error(text: str) -> None:
    with pytest.raises(FailpointError, match="ELASTRAIN_FAILPOINTS"):
        parse(text)


def test_empty_and_blank_items() -> None:
    assert parse("") == {}
    assert parse(" , ") == {}


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    failpoints.reset_hits()
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    yield monkeypatch
    failpoints.reset_hits()


def test_unset_is_none(env: pytest.MonkeyPatch) -> None:
    env.delenv(failpoints.ENV, raising=False)
    assert failpoint("before_report") is None


def test_actions(env: pytest.MonkeyPatch) -> None:
    env.setenv(failpoints.ENV, "a=raise,b=enospc,c=nonfinite,d=sleep:0")
    with pytest.raises(OSError) as err:
        failpoint("a")
    assert err.value.errno == errno.EIO
    with pytest.raises(OSError) as err:
        failpoint("b")
    assert err.value.errno == errno.ENOSPC
    assert failpoint("c") == "nonfinite"
    assert failpoint("d") is None
    assert failpoint("unarmed") is None


def test_nth_rank_and_attempt(env: pytest.MonkeyPatch) -> None:
    env.setenv(failpoints.ENV, "a=x#2,b=y@1,c=z^3")
    assert [failpoint("a") for _ in range(3)] == [None, "x", None]
    env.setenv("RANK", "0")
    assert failpoint("b") is None
    env.setenv("RANK", "1")
    assert failpoint("b") == "y"
    env.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert failpoint("c") is None
    env.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    assert failpoint("c") == "z"


def test_malformed_env_raises_at_first_use(env: pytest.MonkeyPatch) -> None:
    env.setenv(failpoints.ENV, "nonsense")
    with pytest.raises(FailpointError):
        failpoint("a")
