"""Phase 2's decision: publish, wait or abort, from the ranks' reports (pure, torch-free).

Both coordinators (rank 0 inside the job, and the control plane) run :func:`decide` on the same
:class:`Report` values and, on ``publish``, build the manifest with :func:`build_manifest`. A
step is published only when every rank ``0..W-1`` of the same step, rendezvous generation and
world size reported success, the ranks agree on the tensor table and the global progress, and
the pieces tile every tensor exactly.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from worker.checkpoint.manifest import FileEntry, Manifest, Piece, TensorEntry, validate
from worker.errors import CorruptCheckpointError
from worker.jobspec.jsonlimits import finite

Action = Literal["publish", "wait", "abort"]


@dataclass(frozen=True)
class Report:
    """One rank's phase-1 result: the files it staged, its pieces as (tensor name, piece), and
    the whole tensor table (entries without pieces; every rank sends the same table).
    ``context`` (from rank 0) carries what the manifest needs besides the pieces: job,
    parallelism, block_size, meta, metrics, run_record, parent_step, spec_hash, data_version,
    aliases."""

    step: int
    generation: int
    rank: int
    world_size: int
    ok: bool
    error: str = ""
    files: dict[str, FileEntry] = field(default_factory=dict)
    pieces: tuple[tuple[str, Piece], ...] = ()
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    meta_digest: str = ""
    rank_meta: dict[str, Any] = field(default_factory=dict)
    context: dict[str, Any] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files.values())


@dataclass(frozen=True, slots=True)
class Expected:
    step: int
    generation: int
    world_size: int


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    reason: str


def decide(
    expected: Expected,
    reports: Sequence[Report],
    *,
    deadline_passed: bool,
    observed_sizes: Mapping[str, int] | None = None,
) -> Decision:
    """Publish only a complete, consistent step; wait while reports are missing before the
    deadline; otherwise abort with a reason a person can act on. ``observed_sizes`` are the
    staged files' sizes on disk, when the coordinator can see them."""
    for r in reports:
        if (r.step, r.generation, r.world_size) != (expected.step, expected.generation, expected.world_size):
            return Decision(
                "abort",
                f"rank {r.rank} reported step {r.step} generation {r.generation} world size "
                f"{r.world_size}, expected step {expected.step} generation {expected.generation} "
                f"world size {expected.world_size}",
            )
    for r in sorted(reports, key=lambda r: r.rank):
        if not r.ok:
            return Decision(
                "abort", f"rank {r.rank} failed to stage step {r.step}: {r.error or 'no reason given'}"
            )
    ranks = [r.rank for r in reports]
    bad = sorted({k for k in ranks if not 0 <= k < expected.world_size or ranks.count(k) > 1})
    if bad:
        return Decision("abort", f"duplicate or out-of-range reports from ranks {bad}")
    if len(ranks) < expected.world_size:  # ranks are distinct and in range (checked above)
        present = set(ranks)
        # The first few missing ranks lie within the first len(ranks) + 10: bounded for any world size.
        first = list(itertools.islice((k for k in range(expected.world_size) if k not in present), 10))
        more = expected.world_size - len(ranks) - len(first)
        missing = f"{first}{f' and {more} more' if more else ''}"
        if deadline_passed:
            return Decision("abort", f"no report from ranks {missing} before the deadline")
        return Decision("wait", f"waiting for ranks {missing}")
    reason = _consistency(sorted(reports, key=lambda r: r.rank), observed_sizes)
    if reason:
        return Decision("abort", reason)
    return Decision("publish", f"all {expected.world_size} ranks staged step {expected.step}")


def _consistency(reports: Sequence[Report], observed: Mapping[str, int] | None) -> str:
    first = reports[0]
    for r in reports[1:]:
        if r.tensors != first.tensors:
            names = sorted(set(r.tensors) ^ set(first.tensors)) or sorted(
                n for n in r.tensors if r.tensors[n] != first.tensors.get(n)
            )
            return f"ranks 0 and {r.rank} disagree on the tensor table (e.g. {names[:3]})"
        if r.meta_digest != first.meta_digest:
            return f"ranks 0 and {r.rank} disagree on the global progress (meta digest differs)"
    owners: dict[str, int] = {}
    for r in reports:
        for fname, f in r.files.items():
            if fname in owners:
                return f"file {fname} reported by ranks {owners[fname]} and {r.rank}"
            owners[fname] = r.rank
            if observed is not None and observed.get(fname) != f.size:
                return (
                    f"file {fname} is {observed.get(fname)} bytes on disk but rank {r.rank} reported {f.size}"
                )
    try:
        validate(_manifest(reports, Expected(first.step, first.generation, first.world_size)))
    except CorruptCheckpointError as exc:
        return str(exc)
    return ""


def build_manifest(expected: Expected, reports: Sequence[Report]) -> Manifest:
    """The manifest for a step that :func:`decide` said to publish (validated)."""
    m = _manifest(sorted(reports, key=lambda r: r.rank), expected)
    validate(m)
    return m


def _manifest(reports: Sequence[Report], expected: Expected) -> Manifest:
    ctx = reports[0].context
    pieces: dict[str, list[Piece]] = {name: [] for name in reports[0].tensors}
    for r in reports:
        for name, piece in r.pieces:
            pieces.setdefault(name, []).append(piece)
    tensors = {
        name: dataclasses.replace(header, pieces=tuple(sorted(pieces[name], key=lambda p: p.rows)))
        for name, header in reports[0].tensors.items()
    }
    for name in set(pieces) - set(tensors):
        tensors[name] = TensorEntry("uint8", (0,), "replicated", tuple(pieces[name]))  # flagged by validate
    files = {n: f for r in reports for n, f in r.files.items()}
    return Manifest(
        job=str(ctx.get("job", "")),
        step=expected.step,
        generation=expected.generation,
        world_size=expected.world_size,
        parallelism=str(ctx.get("parallelism", "ddp")),
        block_size=int(ctx.get("block_size", 0)),
        tensors=tensors,
        files=files,
        meta=dict(ctx.get("meta", {})),
        rank_meta={str(r.rank): r.rank_meta for r in reports if r.rank_meta},
        metrics={k: float(v) for k, v in dict(ctx.get("metrics", {})).items()},
        run_record=dict(ctx.get("run_record", {})),
        parent_step=ctx.get("parent_step"),
        spec_hash=str(ctx.get("spec_hash", "")),
        data_version=str(ctx.get("data_version", "")),
        aliases=dict(ctx.get("aliases", {})),
    )


# ---------------------------------------------------------------- JSON for the wire


def report_to_json(r: Report) -> str:
    """The report as JSON any reader accepts: a non-finite number in the JSON parts (a diverged
    loss in the progress or the metrics) is written as ``null`` (the service refuses NaN)."""
    return json.dumps(
        {
            "step": r.step,
            "generation": r.generation,
            "rank": r.rank,
            "world_size": r.world_size,
            "ok": r.ok,
            "error": r.error,
            "files": {n: [f.size, f.digest] for n, f in r.files.items()},
            "pieces": [[n, p.file, p.offset, p.nbytes, list(p.rows), list(p.digests)] for n, p in r.pieces],
            "tensors": {n: [h.dtype, list(h.shape), h.kind, h.owner] for n, h in r.tensors.items()},
            "meta_digest": r.meta_digest,
            "rank_meta": finite(r.rank_meta),
            "context": finite(r.context),
        },
        separators=(",", ":"),
    )


def report_from_json(text: str | bytes) -> Report:
    """Parse a report; raises ValueError on anything malformed."""
    try:
        raw = json.loads(text)
        return Report(
            step=int(raw["step"]),
            generation=int(raw["generation"]),
            rank=int(raw["rank"]),
            world_size=int(raw["world_size"]),
            ok=bool(raw["ok"]),
            error=str(raw.get("error", "")),
            files={n: FileEntry(int(s), str(d)) for n, (s, d) in raw["files"].items()},
            pieces=tuple(
                (str(n), Piece(str(f), int(o), int(b), (int(r[0]), int(r[1])), tuple(str(x) for x in d)))
                for n, f, o, b, r, d in raw["pieces"]
            ),
            tensors={
                n: TensorEntry(
                    str(dt),
                    tuple(int(s) for s in sh),
                    str(k),  # type: ignore[arg-type]  # validated
                    owner=None if ow is None else int(ow),
                )
                for n, (dt, sh, k, ow) in raw["tensors"].items()
            },
            meta_digest=str(raw.get("meta_digest", "")),
            rank_meta=dict(raw.get("rank_meta", {})),
            context=dict(raw.get("context", {})),
        )
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError) as exc:
        raise ValueError(f"malformed checkpoint report: {exc!r}") from None
