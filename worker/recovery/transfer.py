"""Moving the replicated state from one member to those without it, over the process group.

What moves: :func:`worker.checkpoint.state.capture`'s tensors (parameters, persistent buffers,
optimizer moments and steps) and JSON extras (parameter-group settings), plus the caller's JSON
progress blob (step, samples, sampler cursor, loss scaler...). No pickle anywhere:

1. the source broadcasts a JSON manifest (length, then bytes), read by receivers with size and
   depth limits; each receiver checks it against its own live tensors (names, dtypes, shapes:
   every member built the same model), and one ``all_reduce(MIN)`` agrees that all can take it;
2. the tensors go as chunks of one flat byte stream, each broadcast with its xxh3-128 appended;
   a receiver verifies a chunk before copying it into its live tensors, and keeps receiving after
   a bad one (the collectives stay in step) but is then invalid;
3. the caller marks the state valid only after a final digest all-gather agrees
   (:func:`worker.recovery.agree.agree_digests`); a member never trains on a half-received state.

Failpoints: ``peer_send_chunk`` (the source, before each chunk) and ``peer_receive_chunk``
(a receiver, after each chunk arrived; the action ``corrupt`` flips a byte of it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import xxhash
from torch import nn

from worker.checkpoint.state import LiveState, apply, capture
from worker.errors import ElastrainError
from worker.failpoints import failpoint
from worker.jobspec.jsonlimits import JSONRefused, loads

CHUNK_BYTES = 64 << 20
MAX_CHUNK_BYTES = 1 << 30
MAX_MANIFEST_BYTES = 64 << 20
MAX_MANIFEST_DEPTH = 16
DIGEST = 16


class TransferError(ElastrainError):
    """The state could not be moved; the caller falls back (next source, or storage)."""


@dataclass(frozen=True, slots=True)
class Result:
    """``progress``: the source's blob (on every member); ``ok``: this member holds every byte
    it was sent, verified; ``bytes``: the stream's size; ``reason``: why not ``ok``."""

    progress: dict[str, Any]
    ok: bool
    bytes: int
    chunks: int
    reason: str = ""


def segments(sizes: list[int], chunk: int) -> list[list[tuple[int, int, int, int]]]:
    """The flat stream of tensors of ``sizes`` bytes cut into chunks of ``chunk`` bytes: per
    chunk, ``(tensor index, start in tensor, end in tensor, start in chunk)``. Pure."""
    out: list[list[tuple[int, int, int, int]]] = []
    current: list[tuple[int, int, int, int]] = []
    room = chunk
    for index, size in enumerate(sizes):
        start = 0
        while start < size:
            take = min(room, size - start)
            current.append((index, start, start + take, chunk - room))
            start += take
            room -= take
            if room == 0:
                out.append(current)
                current, room = [], chunk
    if current:
        out.append(current)
    return out


def seal(chunk: bytes) -> bytes:
    """The chunk with its xxh3-128 appended (what goes on the wire). Pure."""
    return chunk + xxhash.xxh3_128(chunk).digest()


def intact(sealed: bytes | memoryview) -> bool:
    """Whether a sealed chunk's bytes match its digest (no copy of the chunk). Pure."""
    view = memoryview(sealed)
    return len(view) >= DIGEST and xxhash.xxh3_128(view[:-DIGEST]).digest() == bytes(view[-DIGEST:])


def _flat(t: torch.Tensor, name: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise TransferError(f"{name}: a non-contiguous state tensor cannot be sent in place")
    return t.reshape(-1).view(torch.uint8)


def _manifest(
    live: LiveState, names: list[str], progress: dict[str, Any], *, had_state: bool, chunk: int
) -> bytes:
    tensors = [
        {"name": n, "dtype": live.tensors[n].info.dtype, "shape": list(live.tensors[n].local.shape)}
        for n in names
    ]
    raw = {"tensors": tensors, "extras": live.extra, "progress": progress,
           "optimizer_state": had_state, "chunk_bytes": chunk}  # fmt: skip
    return json.dumps(raw, separators=(",", ":")).encode()


def _check_manifest(raw: Any, live: LiveState, names: list[str]) -> str:
    """'' when this member can take the manifest, else why not."""
    if not isinstance(raw, dict) or not isinstance(raw.get("tensors"), list):
        return "the manifest is not an object with a tensor list"
    ours = [
        {"name": n, "dtype": live.tensors[n].info.dtype, "shape": list(live.tensors[n].local.shape)}
        for n in names
    ]
    if raw["tensors"] != ours:
        theirs = {str(t.get("name")) for t in raw["tensors"] if isinstance(t, dict)}
        odd = sorted(theirs ^ set(names))[:5] or ["(same names, other dtypes or shapes)"]
        return f"the source's tensors differ from this member's model: {odd}"
    chunk = raw.get("chunk_bytes")
    if not isinstance(chunk, int) or isinstance(chunk, bool) or not 0 < chunk <= MAX_CHUNK_BYTES:
        return f"chunk_bytes {chunk!r} is outside 1 .. {MAX_CHUNK_BYTES}"
    if not isinstance(raw.get("extras"), dict) or not isinstance(raw.get("progress"), dict):
        return "the manifest's extras or progress is not an object"
    return ""


def _broadcast_bytes(data: bytes | None, *, src: int, group: Any, device: str) -> bytes:
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    n = int(size.item())
    if not 0 < n <= MAX_MANIFEST_BYTES:
        raise TransferError(f"a manifest of {n} bytes is outside 1 .. {MAX_MANIFEST_BYTES}")
    buf = torch.empty(n, dtype=torch.uint8, device=device)
    if data is not None:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, src=src, group=group)
    return bytes(buf.cpu().numpy().tobytes())


def _all_can_take(ok: bool, *, group: Any, device: str) -> bool:
    flag = torch.tensor([int(ok)], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _move_chunks(flat: list[torch.Tensor], cuts: list[list[tuple[int, int, int, int]]], *, sending: bool,
                 receiving: bool, src: int, group: Any, chunk: int, device: str) -> bool:  # fmt: skip
    buf = torch.empty(chunk + DIGEST, dtype=torch.uint8, device=device)
    ok = True
    for pieces in cuts:
        n = pieces[-1][3] + pieces[-1][2] - pieces[-1][1]
        if sending:
            for index, a, b, at in pieces:
                buf[at : at + b - a].copy_(flat[index][a:b])
            digest = xxhash.xxh3_128(buf[:n].cpu().numpy().data).digest()
            buf[n : n + DIGEST].copy_(torch.frombuffer(bytearray(digest), dtype=torch.uint8))
            failpoint("peer_send_chunk")
        dist.broadcast(buf[: n + DIGEST], src=src, group=group)
        if not receiving:
            continue
        if failpoint("peer_receive_chunk") == "corrupt":  # a byte flipped on the way (tests)
            buf[0:1].bitwise_xor_(torch.full((1,), 0xFF, dtype=torch.uint8, device=buf.device))
        if not intact(buf[: n + DIGEST].cpu().numpy().data):
            ok = False
            continue
        if ok:
            for index, a, b, at in pieces:
                flat[index][a:b].copy_(buf[at : at + b - a])
    return ok


def _agree_manifest(
    manifest: bytes | None, live: LiveState, names: list[str], *, src: int, group: Any, device: str
) -> tuple[dict[str, Any] | None, str]:
    """The source's manifest on every participant, or why one of them cannot take it."""
    try:
        data = _broadcast_bytes(manifest, src=src, group=group, device=device)
    except TransferError as exc:  # the size was refused on every participant alike
        return None, str(exc)
    why = ""
    try:
        # NaN and infinities are allowed: a diverged run's last loss is state like any other.
        raw = loads(data, max_bytes=MAX_MANIFEST_BYTES, max_depth=MAX_MANIFEST_DEPTH, what="state manifest",
                    reject_duplicate_keys=True)  # fmt: skip
        why = _check_manifest(raw, live, names)
    except JSONRefused as exc:
        raw, why = None, str(exc)
    if not _all_can_take(not why, group=group, device=device):
        return None, f"a receiver cannot take the state: {why or 'another member refused the manifest'}"
    return raw, ""


def transfer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    src: int,
    rank: int,
    receive: bool,
    progress: dict[str, Any] | None,
    group: Any = None,
    chunk_bytes: int = CHUNK_BYTES,
    device: str = "cpu",
) -> Result:
    """Broadcast ``src``'s state to every member of ``group`` (None: the default group); every
    member of ``group`` calls this, and those with ``receive`` copy it into their live state
    (others, already holding it, only pass the chunks by). ``progress`` is the source's blob.
    When a receiver cannot take the manifest, nothing is copied and every participant returns
    ``ok=False`` (so that all go on to the same next collective)."""
    had_state = bool(optimizer.state)
    live = capture(model, optimizer)  # creates optimizer state by a zero step if there is none
    names = sorted(live.tensors)
    sending = rank == src
    receive = receive and not sending
    manifest = (
        _manifest(live, names, progress or {}, had_state=had_state, chunk=chunk_bytes) if sending else None
    )
    raw, why = _agree_manifest(manifest, live, names, src=src, group=group, device=device)
    if raw is None:
        if not had_state:
            optimizer.state.clear()  # as it was: capture's zero-step state is nobody's
        return Result(progress={}, ok=False, bytes=0, chunks=0, reason=why)
    chunk = int(raw["chunk_bytes"])
    flat = [_flat(live.tensors[n].local, n) for n in names]
    cuts = segments([t.numel() for t in flat], chunk)
    ok = _move_chunks(flat, cuts, sending=sending, receiving=receive, src=src, group=group, chunk=chunk,
                      device=device)  # fmt: skip
    if receive and ok:
        apply(model, optimizer, live, raw["extras"])
    if not raw["optimizer_state"]:
        optimizer.state.clear()  # the source had not stepped: nobody keeps capture's zero-step state
    reason = "" if ok else "a chunk did not match its digest"
    return Result(raw["progress"], ok, sum(t.numel() for t in flat), len(cuts), reason)
