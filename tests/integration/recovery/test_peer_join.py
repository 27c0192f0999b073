"""A join whose generation was announced but never written to etcd (worker.recovery.joincommit: a
join's compare-and-set runs while the group forms), end to end with real processes (see
test_peer_recovery.py).

Two members train; a third process joins; the leader's compare-and-set of the join's generation
is made to fail (failpoint ``before_join_commit=raise``: etcd's answer lost). The group had
already formed with the newcomer and moved the state to it, but no member may apply a window in a
generation that etcd does not hold: the leader refuses its part of the first vote, the group
re-forms from what etcd holds (the next number), and the job finishes at three members with every
sample of the epoch trained exactly once. The successful join (the compare-and-set answered) is
test_service_e2e's scale test and ``benchmarks/peer_join.py``.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tests.integration.recovery.harness import Job
from worker.recovery.etcdkv import connect
from worker.recovery.membership import Membership
from worker.recovery.plan import sample_counts, superseded_versions

pytestmark = pytest.mark.integration


def test_a_join_etcd_did_not_record_applies_no_window(tmp_path: Path, etcd: str) -> None:
    job = Job(
        tmp_path / "job", etcd, world=2, min_world=2, max_world=3, epochs=1, dataset=480, seed=17,
        joiners_by=[3, 1],
    )  # fmt: skip
    # Whichever member leads writes the join's generation: both are armed (a first hit only).
    armed = {"ELASTRAIN_FAILPOINTS": "before_join_commit=raise#1"}
    members = Membership(connect(etcd), job.args["job"])
    try:
        job.start("rank0", node=0, env=armed)
        job.start("rank1", node=1, env=armed)
        job.wait_for("the first generation's first step", lambda: len(job.events("first_step")) == 2)
        members.kv.put(members.keys.desired, json.dumps({"nodes": 3, "spares": 0, "epoch": 1}).encode())
        job.start("joiner", node=2)  # the scale-up, as the service does it: the wish, then the node
        codes = job.wait_exit()
    finally:
        job.kill_all()
    assert codes == {"rank0": 0, "rank1": 0, "joiner": 0}, f"{codes}\n{job.logs()}"
    rows = job.trace()
    assert 1 not in {r["generation"] for r in rows}, "a window was applied in a generation etcd never held"
    refused = job.events("generation_not_committed")
    decided = [
        (e.get("generation"), e.get("members"), e.get("reason")) for e in job.events("recovery_decided")
    ]
    assert [e["generation"] for e in refused] == [1], (
        f"refused {refused}; decided {decided}\n{job.logs()[-6000:]}"
    )
    assert {(r["generation"], r["world_size"]) for r in rows} == {(0, 2), (2, 3)}
    assert {r["rank"] for r in rows if r["generation"] == 2} == {0, 1, 2}
    assert sample_counts(rows) == Counter({(0, i): 1 for i in range(480)}), "a sample trained twice or never"
    voided = max(e["voided"] for e in job.events("outcome"))
    assert len(superseded_versions(rows)) <= voided, "only a voided window is ever trained twice"
    record, _ = members.generation()
    assert record is not None and record.generation == 2 and len(record.members) == 3, record
    # The newcomer took its state from a member both times, and finished with the others' bits.
    assert len(set(job.finished_digests().values())) == 1, job.finished_digests()
