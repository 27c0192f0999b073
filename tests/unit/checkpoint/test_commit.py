from __future__ import annotations

import dataclasses

from tests.unit.checkpoint.synth import TENSORS, reports_for
from worker.checkpoint.commit import (
    Expected,
    Report,
    build_manifest,
    decide,
    report_from_json,
    report_to_json,
)
from worker.checkpoint.manifest import TensorEntry

EXP = Expected(step=10, generation=0, world_size=3)


def _reports() -> list[Report]:
    return reports_for(TENSORS, 3, block_size=16)[0]


def test_all_ranks_consistent_publishes() -> None:
    d = decide(EXP, _reports(), deadline_passed=False)
    assert d.action == "publish"
    m = build_manifest(EXP, _reports())
    assert m.world_size == 3 and m.step == 10 and set(m.rank_meta) == {"0", "1", "2"}


def test_missing_rank_waits_then_aborts() -> None:
    some = _reports()[:2]
    assert decide(EXP, some, deadline_passed=False).action == "wait"
    d = decide(EXP, some, deadline_passed=True)
    assert d.action == "abort" and "ranks [2]" in d.reason


def test_failure_report_aborts_at_once_naming_the_rank() -> None:
    reps = [*_reports()[:2], Report(10, 0, 2, 3, ok=False, error="OSError: [Errno 28] No space left")]
    d = decide(EXP, reps, deadline_passed=False)
    assert d.action == "abort" and "rank 2" in d.reason and "No space" in d.reason


def test_other_generation_or_step_aborts() -> None:
    reps = _reports()
    stale = [*reps[:2], dataclasses.replace(reps[2], generation=1)]
    d = decide(EXP, stale, deadline_passed=False)
    assert d.action == "abort" and "generation 1" in d.reason
    other = [*reps[:2], dataclasses.replace(reps[2], step=12)]
    assert decide(EXP, other, deadline_passed=False).action == "abort"


def test_duplicate_rank_aborts() -> None:
    reps = _reports()
    d = decide(EXP, [reps[0], reps[1], reps[1]], deadline_passed=False)
    assert d.action == "abort" and "duplicate" in d.reason


def test_meta_digest_mismatch_aborts() -> None:
    reps = _reports()
    reps[1] = dataclasses.replace(reps[1], meta_digest="different")
    d = decide(EXP, reps, deadline_passed=False)
    assert d.action == "abort" and "global progress" in d.reason


def test_tensor_table_mismatch_aborts() -> None:
    reps = _reports()
    tensors = dict(reps[2].tensors)
    tensors["model.a.bias"] = TensorEntry("float32", (8,), "replicated")
    reps[2] = dataclasses.replace(reps[2], tensors=tensors)
    d = decide(EXP, reps, deadline_passed=False)
    assert d.action == "abort" and "tensor table" in d.reason


def test_piece_digest_that_does_not_match_its_size_aborts() -> None:
    reps = _reports()
    name, piece = reps[1].pieces[0]
    reps[1] = dataclasses.replace(
        reps[1], pieces=((name, dataclasses.replace(piece, digests=())), *reps[1].pieces[1:])
    )
    d = decide(EXP, reps, deadline_passed=False)
    assert d.action == "abort" and "block digests" in d.reason


def test_gap_in_coverage_aborts() -> None:
    reps = _reports()
    reps[1] = dataclasses.replace(reps[1], pieces=reps[1].pieces[1:])
    assert decide(EXP, reps, deadline_passed=False).action == "abort"


def test_size_on_disk_must_match_report() -> None:
    reps = _reports()
    sizes = {n: f.size for r in reps for n, f in r.files.items()}
    assert decide(EXP, reps, deadline_passed=False, observed_sizes=sizes).action == "publish"
    sizes["rank-00001.bin"] -= 1
    d = decide(EXP, reps, deadline_passed=False, observed_sizes=sizes)
    assert d.action == "abort" and "rank-00001.bin" in d.reason


def test_report_json_round_trip() -> None:
    for r in _reports():
        assert report_from_json(report_to_json(r)) == r


def test_a_huge_world_size_is_answered_without_enumerating_it() -> None:
    """A (forged) report claiming world size 10**18 names the first missing ranks and a count; it
    never builds the set of all ranks (that grew the service past 8 GB)."""
    reports = [dataclasses.replace(r, world_size=10**18) for r in _reports()]
    d = decide(Expected(step=10, generation=0, world_size=10**18), reports, deadline_passed=False)
    assert d.action == "wait" and "[3, 4, 5, 6, 7, 8, 9, 10, 11, 12] and 999999999999999987 more" in d.reason


def test_malformed_report_shapes_are_value_errors() -> None:
    import json

    good = json.loads(report_to_json(_reports()[0]))
    for bad in ({"files": ["x"]}, {"pieces": [["t", "f", 0, 4, [], []]]}, {"world_size": 1e999}):
        try:
            report_from_json(json.dumps(good | bad))
        except ValueError as exc:
            assert "malformed checkpoint report" in str(exc)
        else:
            raise AssertionError(f"{bad} was accepted")
