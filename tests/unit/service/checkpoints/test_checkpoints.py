"""The service's checkpoint duties on the in-memory store and a real directory: publishes a
complete round once, aborts a bad one, keeps the registry and retention, answers /resume, adopts
what storage holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.checkpoints import resume as resume_module
from service.checkpoints.publish import STALE_CLAIM_S
from service.checkpoints.results import CheckpointOutcome
from service.checkpoints.service import Checkpoints
from service.etcd.kv import Write
from service.etcd.memory import MemoryStore
from service.jobs import keys
from service.jobs.errors import InvalidRequestError
from service.jobs.model import JobRecord
from service.jobs.parts import JobParts
from service.metrics import Metrics
from tests.specs import raw_spec
from tests.unit.service.svc_fakes import Clock, stage_rank
from worker.checkpoint.commit import report_to_json
from worker.checkpoint.layout import read_latest
from worker.checkpoint.storage import StorageError
from worker.checkpoint.verify import verify_checkpoint
from worker.jobspec.spec import parse_spec

SPEC = raw_spec("ck", micro_batch_size=4, nodes="2", checkpoint={"retention": {"keep_latest": 2}})


class World:
    def __init__(self, root: Path) -> None:
        self.clock = Clock()
        store = MemoryStore(clock=self.clock)
        self.jobs = JobParts.build(store, storage_root=root, secret=b"k" * 32, clock=self.clock).records
        self.metrics = Metrics()
        self.ck = Checkpoints.build(self.jobs, metrics=self.metrics, clock=self.clock)
        record, _ = self.jobs.create(parse_spec(SPEC))
        self.job_id = record.id
        self.job_dir = Path(record.checkpoint_dir)

    @property
    def record(self) -> JobRecord:
        return self.jobs.get(self.job_id)

    def save(self, step: int, *, world_size: int = 2, generation: int = 0) -> list[CheckpointOutcome]:
        reports = [
            stage_rank(
                self.job_dir, job=self.job_id, step=step, generation=generation, rank=r, world_size=world_size
            )
            for r in range(world_size)
        ]
        return [self.ck.publisher.report(self.record, report_to_json(r).encode()) for r in reports]


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


def test_complete_round_is_published_once(world: World) -> None:
    first, second = world.save(10)
    assert first.status == "pending"
    assert second.status == "published" and second.path == str(world.job_dir / "step-00000010")
    assert read_latest(world.job_dir) == "step-00000010"
    _, problems = verify_checkpoint(world.job_dir / "step-00000010")
    assert problems == []
    assert world.record.last_published_step == 10
    again = stage_rank(world.job_dir, job=world.job_id, step=10, generation=0, rank=0, world_size=2)
    assert world.ck.publisher.report(world.record, report_to_json(again).encode()).status == "published"
    assert [c.step for c in world.ck.registry.published(world.record)] == [10]
    assert world.ck.publisher.outcome(world.record, 10, 0).published is True


def test_mismatching_shard_aborts_and_collects_staging(world: World) -> None:
    r0 = stage_rank(world.job_dir, job=world.job_id, step=5, generation=0, rank=0, world_size=2)
    r1 = stage_rank(world.job_dir, job=world.job_id, step=5, generation=0, rank=1, world_size=2)
    with (world.job_dir / ".staging-00000005-0" / "rank-00001.bin").open("ab") as f:
        f.write(b"x")  # a shard that does not match its report
    world.ck.publisher.report(world.record, report_to_json(r0).encode())
    outcome = world.ck.publisher.report(world.record, report_to_json(r1).encode())
    assert outcome.status == "aborted" and "on disk" in outcome.reason
    assert not (world.job_dir / ".staging-00000005-0").exists()
    assert not (world.job_dir / "step-00000005").exists()
    assert world.record.last_published_step is None


def test_failed_rank_aborts_at_once(world: World) -> None:
    r0 = stage_rank(world.job_dir, job=world.job_id, step=5, generation=0, rank=0, world_size=2)
    failed = json.loads(report_to_json(r0))
    failed.update(ok=False, error="ENOSPC", files={}, pieces=[])
    outcome = world.ck.publisher.report(world.record, json.dumps(failed).encode())
    assert outcome.status == "aborted" and "ENOSPC" in outcome.reason


def test_a_full_volume_is_counted_and_said_in_the_jobs_events(world: World) -> None:
    def no_space() -> float | None:
        return world.metrics.registry.get_sample_value(
            "elastrain_checkpoints_no_space_aborts_total", {"job_id": world.job_id}
        )

    r0 = stage_rank(world.job_dir, job=world.job_id, step=5, generation=0, rank=0, world_size=2)
    failed = json.loads(report_to_json(r0))
    error = f"OSError: [Errno 28] No space left on device (writing {world.job_dir}/.staging-00000005-0)"
    failed.update(ok=False, error=error, files={}, pieces=[])
    assert world.ck.publisher.report(world.record, json.dumps(failed).encode()).status == "aborted"
    assert no_space() == 1.0
    said = [e.message for e in world.record.events if e.kind == "checkpoint_aborted"]
    assert len(said) == 1 and "step 5" in said[0] and "No space left on device" in said[0], said
    assert str(world.job_dir) in said[0]
    r1 = stage_rank(world.job_dir, job=world.job_id, step=6, generation=0, rank=0, world_size=2)
    other = json.loads(report_to_json(r1))
    other.update(ok=False, error="OSError: [Errno 5] Input/output error", files={}, pieces=[])
    world.ck.publisher.report(world.record, json.dumps(other).encode())
    assert no_space() == 1.0, "another error is an abort, not a full volume"


def test_stale_step_is_refused(world: World) -> None:
    world.save(20)
    outcome = world.save(10)[0]
    assert outcome.status == "aborted" and "older than the published step 20" in outcome.reason


@pytest.mark.parametrize("body", [b"{}", b"not json", b'{"step": 1}'])
def test_malformed_reports_are_invalid_requests(world: World, body: bytes) -> None:
    with pytest.raises(InvalidRequestError, match="report"):
        world.ck.publisher.report(world.record, body)


def test_retention_keeps_the_latest_two(world: World) -> None:
    for step in (10, 20, 30):
        world.save(step)
    assert [c.step for c in world.ck.registry.published(world.record)] == [20, 30]
    assert not (world.job_dir / "step-00000010").exists()


def test_resume_answers_newest_and_a_load_plan_for_a_new_world_size(world: World) -> None:
    assert world.ck.resumes.resume(world.record, world_size=None, rank=None).checkpoint is None
    world.save(10)
    world.save(20)
    answer = world.ck.resumes.resume(world.record, world_size=1, rank=None).model_dump()
    assert answer["checkpoint"]["step"] == 20 and answer["checkpoint"]["reshard"] is True
    plan = answer["load_plan"]["0"]
    assert plan["bytes"] == 16 and plan["files"] == ["rank-00000.bin", "rank-00001.bin"]
    assert "ops" not in plan  # every read is listed only for one rank
    one = world.ck.resumes.resume(world.record, world_size=2, rank=1).model_dump()
    assert one["load_plan"]["1"]["ops"] and one["checkpoint"]["reshard"] is False
    with pytest.raises(InvalidRequestError):
        world.ck.resumes.resume(world.record, world_size=2, rank=2)
    with pytest.raises(InvalidRequestError, match="ask per rank with rank="):
        world.ck.resumes.resume(world.record, world_size=100_000, rank=None)  # not 100,000 plans
    assert world.ck.resumes.resume(world.record, world_size=100_000, rank=99_999).load_plan["99999"]


def test_resume_skips_a_checkpoint_whose_shard_was_truncated(world: World) -> None:
    world.save(10)
    world.save(20)
    with (world.job_dir / "step-00000020" / "rank-00000.bin").open("r+b") as f:
        f.truncate(4)
    found = world.ck.resumes.resume(world.record, world_size=None, rank=None).checkpoint
    assert found is not None and found.step == 10


def test_a_store_that_does_not_answer_is_not_a_missing_checkpoint(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step the store could not be asked about is not set aside: the resume fails (503 at the
    API) instead of answering an older step or none. (The store is stood in for: no sockets.)"""
    world.save(10)

    def unreachable(step_dir: object, **_: object) -> None:
        raise StorageError("s3://ckpt: error sending request")

    monkeypatch.setattr(resume_module, "load_manifest", unreachable)
    with pytest.raises(StorageError):
        world.ck.resumes.resume(world.record, world_size=None, rank=None)


def test_adopt_records_a_renamed_step_and_collects_dead_staging(world: World, tmp_path: Path) -> None:
    world.save(10)
    other = World(tmp_path / "other")  # same storage, a registry that never saw step 10
    other.job_dir = world.job_dir
    record = other.record.model_copy(update={"checkpoint_dir": str(world.job_dir)})
    stage_rank(world.job_dir, job=world.job_id, step=5, generation=0, rank=0, world_size=2)
    stage_rank(world.job_dir, job=world.job_id, step=15, generation=0, rank=0, world_size=2)
    other.ck.storage.adopt(record)
    assert [c.step for c in other.ck.registry.published(record)] == [10]
    assert other.jobs.get(other.job_id).last_published_step == 10
    assert not (world.job_dir / ".staging-00000005-0").exists()
    assert (world.job_dir / ".staging-00000015-0").exists()  # may still be published


def test_a_publish_left_by_a_dead_service_is_finished_by_the_next(world: World) -> None:
    """A service killed between its publish claim and the outcome leaves 'publishing' behind;
    the next instance finishes the round from the stored reports once the claim is stale."""

    r0 = stage_rank(world.job_dir, job=world.job_id, step=10, generation=0, rank=0, world_size=2)
    r1 = stage_rank(world.job_dir, job=world.job_id, step=10, generation=0, rank=1, world_size=2)
    for r in (r0, r1):
        world.jobs.store.put(keys.report(world.job_id, 10, 0, r.rank, 0), report_to_json(r).encode())
    claim = {"status": "publishing", "by": "a-dead-instance", "at": world.clock()}
    assert world.jobs.store.commit(
        [Write(keys.outcome(world.job_id, 10, 0, 0), json.dumps(claim).encode(), 0)]
    )
    assert world.ck.publisher.outcome(world.record, 10, 0).status == "pending"  # not stale yet
    world.clock.advance(STALE_CLAIM_S + 1)
    finished = world.ck.publisher.outcome(world.record, 10, 0)
    assert finished.status == "published", finished
    assert read_latest(world.job_dir) == "step-00000010" and world.record.last_published_step == 10


def test_a_dead_publisher_with_an_incomplete_round_is_aborted(world: World) -> None:

    r0 = stage_rank(world.job_dir, job=world.job_id, step=10, generation=0, rank=0, world_size=2)
    world.jobs.store.put(keys.report(world.job_id, 10, 0, 0, 0), report_to_json(r0).encode())
    claim = {"status": "publishing", "by": "a-dead-instance", "at": world.clock()}
    world.jobs.store.commit([Write(keys.outcome(world.job_id, 10, 0, 0), json.dumps(claim).encode(), 0)])
    world.clock.advance(STALE_CLAIM_S + 1)
    assert world.ck.publisher.outcome(world.record, 10, 0).status == "aborted"
    assert not (world.job_dir / ".staging-00000010-0").exists()
