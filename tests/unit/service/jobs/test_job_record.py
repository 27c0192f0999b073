"""A job record carries its spec as a JobSpec value, and its stored form is the one records
already in etcd have: the spec's JSON with its aliases, as submitted."""

from __future__ import annotations

import json

from service.jobs.model import JobRecord
from tests.specs import raw_spec
from worker.jobspec.spec import JobSpec, parse_spec

SPEC = parse_spec(  # as JSON text: the API parses the body's JSON once, into the spec
    json.dumps(
        raw_spec(
            "rec",
            micro_batch_size=4,
            optimizer={"betas": [0.9, 0.99]},
            checkpoint={"dir": "/ck/rec-1", "async": True},
        )
    )
)


def stored_before(spec: JobSpec) -> bytes:
    """A record as the service wrote it when the record kept the spec as a dict."""
    record = {
        "id": "rec-1",
        "name": "rec",
        "spec": spec.model_dump(mode="json", by_alias=True),
        "spec_hash": "h",
        "state": "RUNNING",
        "state_since": 5.0,
        "desired_nodes": 1,
        "min_nodes": 1,
        "max_nodes": 1,
        "nproc_per_node": 1,
        "max_restarts": 3,
        "checkpoint_dir": "/ck/rec-1",
        "worker_token_hash": "x",
        "nodes": [],
        "next_attempt": {},
        "restarts": 0,
        "cancel_requested": False,
        "world_size": None,
        "last_step": None,
        "last_published_step": None,
        "last_group_id": None,
        "groups_formed": 0,
        "reason": None,
        "events": [],
        "recoveries": [],
        "created_at": 1.0,
        "updated_at": 1.0,
        "finished_at": None,
    }
    return json.dumps(record, separators=(",", ":")).encode()


def test_a_record_stored_before_loads_with_its_spec_as_a_value_and_is_written_back_the_same() -> None:
    raw = stored_before(SPEC)
    record = JobRecord.from_json(raw)
    assert record.spec == SPEC and record.spec.checkpoint.async_save is True
    assert record.spec.optimizer.betas == (0.9, 0.99)
    before, written = json.loads(raw), json.loads(record.to_json())
    assert {key: written[key] for key in before} == before  # written back as it was stored
    added = {key: written[key] for key in written.keys() - before.keys()}
    assert added == {  # a record written without these fields runs in restart mode, no spares
        "recovery_mode": "restart",
        "spares": 0,
        "max_incidents": None,
        "desired_epoch": 0,
        "peer_incidents": 0,
        "spare_failures": 0,
        "reached_step": None,
        "queue_position": None,  # and waits for no slots
        "waiting": None,
        "preemptions": 0,  # a record from before was never preempted
        "preempted_step": None,
        "waited_for": [],
    }
    assert json.loads(record.to_json())["spec"]["checkpoint"]["async"] is True  # the alias
