"""After a generation formed: agree on the newest state and hand it to whoever lacks it
(:func:`worker.recovery.plan.choose_source` decides). Every member calls :func:`hand_over`; the
collectives run in the same order on all of them whatever each one holds.

1. one all_gather of the fixed-size summaries; :func:`worker.recovery.plan.choose_source` picks
   the newest version and its lowest-ranked holder (or says: storage);
2. the source broadcasts to the receivers (a sub-group when other members already hold the state);
3. one all_gather of ``(ok, digest of state and progress, DDP layout)``: the state is valid on
   every member only when all agree — a member never trains on a half-received state; and the
   members keep their DDP wrappers (:func:`worker.recovery.rewrap.carry_over`) only when all
   hold a settled one with the same bucket layout (``Handed.keep_ddp``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import xxhash

from worker.recovery import agree
from worker.recovery.group import GroupInfo, destroy_subgroup, subgroup
from worker.recovery.plan import Source, Summary, choose_source
from worker.recovery.rewrap import NO_LAYOUT
from worker.recovery.seam import RecoverableState
from worker.recovery.transfer import transfer

NO_DIGEST = bytes(16)


@dataclass(frozen=True, slots=True)
class Handed:
    """``kind``: ``peer`` (every member holds the agreed state) or ``storage`` (nobody may use
    what it holds: restore from the checkpoint). ``bytes``: sent or received by this member."""

    kind: str
    reason: str = ""
    source: int | None = None
    bytes: int = 0
    voided: int = 0
    version: int = 0
    keep_ddp: bool = False


@dataclass(frozen=True, slots=True)
class Holding:
    """What this member brings: whether its state is valid, about its last window, and the
    digest of its settled DDP's bucket layout (:func:`worker.recovery.rewrap.layout_digest`;
    zeros: none to keep)."""

    valid: bool
    in_window: bool
    last_generation: int
    spec_hash: str
    layout: bytes = NO_LAYOUT


def _summary(state: RecoverableState, info: GroupInfo, mine: Holding) -> tuple[Summary, dict[str, Any]]:
    progress = state.progress() if mine.valid else {}
    summary = Summary(
        rank=info.rank, has_state=mine.valid, version=state.version() if mine.valid else 0,
        last_generation=mine.last_generation, in_window=mine.in_window,
        spec=agree.spec_digest(mine.spec_hash),
        state_digest=agree.state_digest(state.model, state.optimizer) if mine.valid else NO_DIGEST,
        progress_digest=agree.progress_digest(progress) if mine.valid else NO_DIGEST,
    )  # fmt: skip
    return summary, progress


def _digest(state: RecoverableState) -> bytes:
    both = agree.state_digest(state.model, state.optimizer) + agree.progress_digest(state.progress())
    return xxhash.xxh3_128(both).digest()


def hand_over(
    state: RecoverableState,
    info: GroupInfo,
    mine: Holding,
    *,
    chunk_bytes: int,
    device: str,
    emit: Callable[[str, dict[str, Any]], None],
    invalidate: Callable[[], None],
    before_agree: Callable[[], None] | None = None,
) -> Handed:
    """Agree, transfer, verify (see the module docstring). ``invalidate`` is called before this
    member's live state starts being overwritten (a receiver). ``before_agree`` is called right
    before the final digest all-gather, where a sender waits for its receivers' last chunks and
    digests without this process's interpreter (the leader of a join sends its etcd write there).
    A collective error propagates: the caller re-forms, and a receiver's half-received state
    stays invalid."""
    summary, progress = _summary(state, info, mine)
    choice = choose_source(agree.gather_summaries(summary, device=device))
    if not isinstance(choice, Source):
        emit("peer_recovery_unavailable", {"reason": choice.reason, "generation": info.generation})
        return Handed("storage", choice.reason)
    if not choice.receivers:
        return Handed("peer", "", choice.rank, 0, choice.voided, choice.version)
    ranks = [choice.rank, *choice.receivers]
    sub = subgroup(ranks) if len(choice.holders) > 1 else None
    moved, ok, received = 0, True, False
    if info.rank in ranks:
        receiving = info.rank in choice.receivers
        if receiving:
            invalidate()
        result = transfer(
            state.model, state.optimizer, src=choice.rank, rank=info.rank, receive=receiving,
            progress=progress if info.rank == choice.rank else None, group=sub, chunk_bytes=chunk_bytes,
            device=device,
        )  # fmt: skip
        moved, ok = result.bytes, result.ok
        if ok and receiving:
            state.load_progress(result.progress)
            received = True
    destroy_subgroup(sub)
    digest = _digest(state)
    if before_agree is not None:
        before_agree()
    agreed, keep_ddp = agree.agree_digests(ok, digest, layout=mine.layout, device=device)
    if not agreed:
        emit("peer_transfer_refused", {"generation": info.generation, "source_rank": choice.rank})
        return Handed("storage", "the transferred state could not be verified on every member")
    emit("state_transferred", {"generation": info.generation, "source_rank": choice.rank, "bytes": moved,
                               "received": received, "receivers": list(choice.receivers),
                               "ddp_carried_over": keep_ddp, "at": time.time()})  # fmt: skip
    return Handed("peer", "", choice.rank, moved, choice.voided, choice.version, keep_ddp)
