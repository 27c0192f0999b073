"""One job's record never stops the reconciler or the API for the others:
records written straight into the store -- not JSON, JSON of the wrong shape, a valid record
whose spec no longer validates, a state the code does not know -- next to a healthy job. The
healthy job is reconciled as before; each bad one is failed with the reason, counted, and
answered by GET /v1/jobs and GET /v1/jobs/{id}. (tests/integration/service/test_svc_poison.py
does the same against a real etcd and a real service.)"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest

from tests.specs import raw_spec
from tests.unit.service.svc_fakes import Clock, FakeScheduler

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from service.api.app import create_app
from service.etcd.election import LeaderElection
from service.etcd.memory import MemoryStore
from service.jobs import keys
from service.jobs.model import JobRecord, JobState, NodePhase
from service.jobs.parts import JobParts
from service.metrics import Metrics
from service.reconciler import LaunchContext, Reconciler
from service.settings import load_settings
from worker.jobspec.spec import parse_spec

SPEC = raw_spec("demo", micro_batch_size=4, nodes="1")
TOKEN = "t" * 32


class World:
    def __init__(self, tmp_path: Path) -> None:
        self.clock = Clock()
        self.store = MemoryStore(clock=self.clock)
        self.parts = JobParts.build(self.store, storage_root=tmp_path, secret=b"k" * 32, clock=self.clock)
        self.jobs = self.parts.records
        self.scheduler = FakeScheduler()
        self.metrics = Metrics()
        election = LeaderElection(self.store, "a", ttl_s=10, clock=self.clock)
        ctx = LaunchContext(service_url="http://svc:8080")
        self.reconciler = Reconciler(
            self.parts, self.scheduler, election, launch=ctx, metrics=self.metrics, clock=self.clock
        )
        app = create_app(
            load_settings(data_dir=tmp_path),
            self.store,
            api_token=TOKEN,
            parts=self.parts,
            metrics=self.metrics,
            leader=lambda: self.reconciler.is_leader,
            stalled=self.reconciler.stalled,
        )
        self.api = TestClient(app, raise_server_exceptions=False)

    def submit(self, **change: Any) -> str:
        record, _ = self.jobs.create(parse_spec(SPEC | change))
        return record.id

    def running(self, **change: Any) -> JobRecord:
        """A job launched and running (one node with a handle)."""
        job_id = self.submit(**change)
        self.reconciler.run_once()
        self.reconciler.run_once()
        record = self.jobs.get(job_id)
        assert record.state == JobState.RUNNING
        return record

    def poison(self, job_id: str, raw: bytes) -> None:
        self.store.put(keys.job(job_id), raw)

    def errors(self, job_id: str) -> float:
        total = 0.0
        for family in self.metrics.registry.collect():
            for sample in family.samples:
                if (
                    sample.name == "elastrain_reconciler_job_errors_total"
                    and sample.labels["job_id"] == job_id
                ):
                    total += sample.value
        return total


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


def _bad_spec(record: JobRecord) -> bytes:
    raw = json.loads(record.to_json())
    raw["spec"]["optimizer"] = {"lr": None}  # written by a hand edit, or a version that allowed it
    return json.dumps(raw).encode()


def _unknown_state(record: JobRecord) -> bytes:
    raw = json.loads(record.to_json())
    raw["state"] = "PAUSED"
    return json.dumps(raw).encode()


POISONS = {
    "not-json": lambda record: b"\x00\xffnot json at all",
    "wrong-shape": lambda record: b'[1, "two", {"three": 3}]',
    "wrong-field-types": lambda record: json.dumps({"id": 5, "nodes": "many", "state": 7}).encode(),
    "invalid-spec": _bad_spec,
    "unknown-state": _unknown_state,
}


@pytest.mark.parametrize("kind", sorted(POISONS))
def test_a_record_that_cannot_be_read_fails_its_job_and_no_other(world: World, kind: str) -> None:
    bad = world.running(name="bad")
    world.poison(bad.id, POISONS[kind](bad))
    healthy = world.submit(name="healthy")
    assert world.reconciler.run_once()
    assert world.reconciler.run_once()
    assert world.jobs.get(healthy).state == JobState.RUNNING
    assert [n.launch_id for n in world.scheduler.launches] == [f"{bad.id}-n0-a0", f"{healthy}-n0-a0"]
    failed = world.jobs.get(bad.id)
    assert failed.state == JobState.FAILED and "cannot read" in (failed.reason or "")
    assert world.errors(bad.id) == 1 and world.errors(healthy) == 0
    # The bytes as found are kept for the operator; the job key holds a record that reads.
    kept = world.store.get(keys.quarantine(bad.id))
    assert kept is not None and kept.value == POISONS[kind](bad)
    assert JobRecord.from_json(world.store.get(keys.job(bad.id)).value).state == JobState.FAILED  # type: ignore[union-attr]
    if kind in ("invalid-spec", "unknown-state"):  # its nodes were readable: the running one is stopped
        assert f"fake://{bad.id}-n0-a0" in world.scheduler.cancelled
        world.reconciler.run_once()
        assert [n.phase for n in world.jobs.get(bad.id).nodes] == [NodePhase.STOPPED]
    for _ in range(3):  # later passes leave it alone
        world.reconciler.run_once()
    assert world.errors(bad.id) == 1


@pytest.mark.parametrize("kind", sorted(POISONS))
def test_the_api_answers_for_every_job_while_a_record_cannot_be_read(world: World, kind: str) -> None:
    """Before the reconciler gets to it (a standby, no leader yet), reads still answer: the bad
    job shows as FAILED with the reason; nothing is written by a read."""
    bad = world.submit(name="bad")
    healthy = world.submit(name="healthy")
    world.poison(bad, POISONS[kind](world.jobs.get(bad)))
    auth = {"Authorization": f"Bearer {TOKEN}"}
    listed = world.api.get("/v1/jobs", headers=auth)
    assert listed.status_code == 200, listed.text
    states = {j["id"]: j["state"] for j in listed.json()["jobs"]}
    assert states == {bad: "FAILED", healthy: "PENDING"}
    one = world.api.get(f"/v1/jobs/{bad}", headers=auth)
    assert one.status_code == 200 and "cannot read" in one.json()["reason"], one.text
    assert world.api.get("/v1/jobs?state=FAILED", headers=auth).json()["jobs"][0]["id"] == bad
    assert world.api.delete(f"/v1/jobs/{bad}", headers=auth).status_code == 202
    assert world.store.get(keys.quarantine(bad)) is None


def test_a_job_the_reconciler_keeps_failing_on_is_failed_and_the_others_go_on(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug (here: any exception while one job is reconciled) fails that job after three passes
    in a row, with the error in its reason; every other job is reconciled in each of them."""
    bad, healthy = world.submit(name="bad"), world.submit(name="healthy")
    statuses = world.reconciler._statuses

    def broken(record: JobRecord) -> Any:
        if record.id == bad:
            raise TypeError("unsupported operand type(s) for -: 'NoneType' and 'float'")
        return statuses(record)

    monkeypatch.setattr(world.reconciler, "_statuses", broken)
    for _ in range(2):
        assert world.reconciler.run_once()
        assert world.jobs.get(bad).state == JobState.PENDING
    assert world.jobs.get(healthy).state == JobState.RUNNING
    assert world.reconciler.run_once()
    record = world.jobs.get(bad)
    assert record.state == JobState.FAILED and "TypeError" in (record.reason or "")
    assert world.errors(bad) == 3 and world.errors(healthy) == 0


def test_readyz_says_not_ready_while_the_leaders_passes_do_not_complete(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/readyz must not stay 200 while every pass fails. A leader whose reconciler
    has not completed a pass for 3 idle intervals (15 s by default) is not ready, with why."""
    r = world.reconciler
    assert r.stalled() is None  # nothing expected yet: it has only just started
    assert r.run_once() and r.stalled() is None
    world.clock.advance(14)
    assert r.stalled() is None and world.api.get("/readyz").status_code == 200

    def broken() -> Any:
        raise TypeError("boom")

    monkeypatch.setattr(world.jobs, "scan", broken)
    with pytest.raises(TypeError):
        r.run_once()
    world.clock.advance(2)
    reason = r.stalled()
    assert reason is not None and "16 s" in reason and "every 5 s" in reason
    resp = world.api.get("/readyz")
    assert resp.status_code == 503 and "reconciler" in resp.json()["error"]["message"], resp.text
    monkeypatch.undo()
    assert r.run_once() and r.stalled() is None
    assert world.api.get("/readyz").status_code == 200
    # A standby runs no passes and is not judged by them.
    world.clock.advance(60)
    r.election.resign()
    assert r.stalled() is None
