"""A join's generation, announced first and written second: the leader announces the
generation, forms the group, moves the state, and sends the compare-and-set on a thread
(:class:`PendingCommit`) where it waits for the receivers' last chunks and digests (the
hand-over's final all-gather); it waits for etcd's answer before it gives its part of the new
generation's first commit vote (:meth:`worker.recovery.leader.Leader.settle`, called by
``GroupMember.ballot``).

No member applies a window without the leader's part of that vote, so no window is applied in a
generation that etcd does not hold; a lost compare-and-set (another leader wrote ``gen``) or an
unknown answer (etcd away) makes the leader raise :class:`~worker.recovery.vote.NotCommitted`
instead, and the group re-forms from what etcd holds. Where the write is sent matters: its
thread holds this process's interpreter for part of its time, and the training thread waits
for it whenever it needs the interpreter; sent before the final all-gather, it ends while the
leader waits for the receivers there anyway.

Two rules keep a generation that was announced and never written harmless: the next one is
numbered past both the record in etcd and the one this member held (:func:`next_generation`),
and a record in etcd of the same number as the held one but not identical to it is newer
(:func:`supersedes`). A failure-driven recovery still writes before it announces: its members
may hold different generations, and its decision is an incident's record. Failpoint:
``before_join_commit`` (on the compare-and-set's thread).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from worker.failpoints import failpoint
from worker.recovery.membership import KeyValueUnavailable, Membership
from worker.recovery.records import GenRecord


class PendingCommit:
    """A join's compare-and-set of ``record``, on a thread that :meth:`start` starts (see the
    module docstring)."""

    def __init__(self, membership: Membership, record: GenRecord, revision: int) -> None:
        self.record = record
        self._failure: str | None = "the group did not form: the compare-and-set was not sent"
        self._thread = threading.Thread(
            target=self._write, args=(membership, revision), name="elastrain-commit", daemon=True
        )

    def start(self) -> None:
        """Send the compare-and-set (once)."""
        if self._thread.ident is None:
            self._failure = "the compare-and-set did not answer"
            self._thread.start()

    def _write(self, membership: Membership, revision: int) -> None:
        try:
            failpoint("before_join_commit")  # raise: etcd's answer lost (tests)
            won = membership.commit_generation(self.record, revision=revision)
        except (KeyValueUnavailable, OSError) as exc:
            self._failure = f"etcd did not answer the compare-and-set ({exc}); it may or may not hold it"
            return
        self._failure = None if won else "another leader wrote the group's generation first"

    def result(self, timeout_s: float) -> str | None:
        """None once the record is in etcd; else why not (or not yet within ``timeout_s``)."""
        if self._thread.ident is None:
            return self._failure
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            return f"the compare-and-set did not answer within {timeout_s:.0f} s"
        return self._failure


def announced_first(
    *, planned: bool, old: GenRecord | None, lost: Sequence[str], leaving: Sequence[str]
) -> bool:
    """Whether a re-formation is a join, whose generation is announced first and written second:
    a planned re-formation (joiners waiting) of a held generation that loses no member and lets
    none leave. Whether the leader read the record ahead or just now does not matter (on a loaded
    machine a slow window outlasts the read-ahead). Pure."""
    return planned and old is not None and not lost and not leaving


def supersedes(current: GenRecord | None, held: GenRecord | None) -> bool:
    """Whether etcd's ``current`` record is newer than the generation this member ``held``: a
    higher number, or the same number and not the same record (another leader's, written where
    this member's leader announced one that it never wrote). Pure."""
    if current is None or held is None:
        return False
    return current.generation > held.generation or (current.generation == held.generation and current != held)


def next_generation(current: GenRecord | None, held: GenRecord | None) -> int:
    """The number of the generation to write: past etcd's record and the one this member held
    (which may have been announced and never written). Pure."""
    numbers = [r.generation for r in (current, held) if r is not None]
    return max(numbers, default=-1) + 1
