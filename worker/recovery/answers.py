"""What a member of the group is told when it checks in or waits to be called, and how it waits
for that answer on its control link.

The leader answers ``form`` (the new generation: an :class:`Order`), ``fenced``, ``fallback``,
``leave`` (a :class:`Refused`) or ``not_leader`` (it found a living candidate before it). A
member that hears nothing pings the leader after ``PING_AFTER_S`` of silence; a leader that does
not answer within ``ACK_TIMEOUT_S`` (SIGSTOPped, hung) counts as gone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from worker.recovery.control import Link
from worker.recovery.group import StoreHost
from worker.recovery.hub import message_record
from worker.recovery.records import GenRecord, RecordError

ANSWERS = ("form", "fenced", "fallback", "leave", "not_leader")
ACK_TIMEOUT_S = 5.0  # a living process's connection thread answers a check-in or a ping at once
PING_AFTER_S = 2.0  # silence on a leader's connection after which it is asked whether it still runs
TIMEOUT = "no answer from the leader before the deadline"


@dataclass(frozen=True, slots=True)
class Order:
    """Form ``record``; ``host``: this process hosts its store (the leader); ``link``: the
    connection to the leader (None on the leader)."""

    record: GenRecord
    host: StoreHost | None
    link: Link | None


@dataclass(frozen=True, slots=True)
class Refused:
    """No generation for this process: ``kind`` is ``fallback``, ``fenced`` or ``leave``."""

    kind: str
    reason: str


def fallback(reason: str) -> dict[str, Any]:
    """The ``fallback`` message: no generation can form, fall back to a restart."""
    return {"t": "fallback", "reason": reason}


def await_answer(
    link: Link, deadline: float | None, kinds: tuple[str, ...] = ANSWERS
) -> dict[str, Any] | None:
    """The leader's next answer on ``link`` (one of ``kinds``); None when it is gone, or stopped:
    after ``PING_AFTER_S`` of silence it is pinged, and a process that does not answer within
    ``ACK_TIMEOUT_S`` (SIGSTOPped, hung) counts as gone."""
    pinged: float | None = None
    while True:
        now = time.time()
        if deadline is not None and now >= deadline:
            return fallback(TIMEOUT)
        if pinged is not None and now - pinged >= ACK_TIMEOUT_S:
            link.close()
            return None
        wait = PING_AFTER_S if pinged is None else ACK_TIMEOUT_S - (now - pinged)
        if deadline is not None:
            wait = min(wait, deadline - now)
        try:
            msg = link.recv(max(wait, 0.0))
        except TimeoutError:
            if pinged is None:
                pinged = time.time()
                link.send({"t": "ping"})
            continue
        if msg is None or msg["t"] in kinds:
            return msg
        pinged = None  # any line (a pong) says the leader runs


def order_from(answer: dict[str, Any], link: Link) -> Order | Refused:
    """The leader's answer as an order to form a generation, or a refusal."""
    kind = answer["t"]
    if kind == "form":
        try:
            return Order(message_record(answer), None, link)
        except RecordError as exc:
            return Refused("fallback", f"the leader sent a bad record: {exc}")
    reason = str(answer.get("reason", kind))
    return Refused(kind if kind in ("fenced", "leave") else "fallback", reason)
