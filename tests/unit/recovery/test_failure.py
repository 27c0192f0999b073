"""Which errors mean "the group broke" (recover) and which mean "this process is wrong" (exit)."""

from __future__ import annotations

import pytest

from worker.errors import ReplicaMismatchError
from worker.recovery.failure import Failure, classify, is_incident


class DistBackendError(RuntimeError):
    """Stands in for torch.distributed.DistBackendError (same name, what classify looks at)."""


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [::1]:3447"), "crash"),
        (RuntimeError("[gloo/transport/tcp/pair.cc:534] Read error: Connection reset by peer"), "crash"),
        (RuntimeError("[unbound_buffer.cc:78] Timed out waiting 2000ms for recv operation"), "crash"),
        (DistBackendError("NCCL communicator was aborted"), "crash"),
        (ConnectionResetError("Connection reset by peer"), "crash"),
        (ValueError("shapes (3, 4) and (5,) not aligned"), "fatal"),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), "fatal"),
        (KeyError("weight"), "fatal"),
        (ReplicaMismatchError("data-parallel replicas disagree after step 16: ranks 1", (1,)), "mismatch"),
    ],
)  # fmt: skip
def test_classify(exc: BaseException, kind: str) -> None:
    failure = classify(exc, at=12.5)
    assert failure.kind == kind
    assert failure.at == 12.5
    assert failure.recoverable == (kind != "fatal")
    assert type(exc).__name__ in failure.message


def test_the_value_keeps_no_traceback() -> None:
    try:
        raise RuntimeError("Connection closed by peer\nsecond line")
    except RuntimeError as exc:
        failure = classify(exc, in_window=False)
    assert failure.message == "RuntimeError: Connection closed by peer"
    assert not failure.in_window
    assert all(not isinstance(v, BaseException) for v in (failure.kind, failure.at, failure.message))


def test_planned() -> None:
    failure = Failure.planned(at=3.0)
    assert (failure.kind, failure.at, failure.in_window, failure.recoverable) == ("planned", 3.0, False, True)


def test_a_join_that_lost_nobody_is_no_incident() -> None:
    """The one rule for what the leader records and reports: any failure is an incident; a
    planned re-formation (a join) is one only when a member was lost in it too."""
    crash = Failure("crash", 1.0, "RuntimeError: Connection closed by peer")
    assert is_incident(crash, ()) and is_incident(crash, ("b",))
    assert not is_incident(Failure.planned(at=2.0), ())
    assert is_incident(Failure.planned(at=2.0), ("b",))
    assert Failure.planned(at=2.0).is_planned and not crash.is_planned
