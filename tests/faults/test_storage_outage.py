"""The object store dies during a save and comes back: a service job on ``s3://`` (the
``elastrain serve`` console script, real torchrun workers) against a real SeaweedFS that the test
SIGKILLs while a rank uploads its shard of step 20 (a ``sleep`` failpoint holds that rank inside
the upload; its marker in the node's log says when), then starts again on the same ports and
data after an outage the seed draws.

Invariants: the save of step 20 either retried through the outage and published, or failed
cleanly (aborted, its shards never read and removed by the end of the job) while step 10 stayed
the newest; training went on without a restart; the job finished, its newest checkpoint is step
30, and its final state equals the same job's on a local directory under bare torchrun.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.launch import REPO
from tests.integration.worker.test_service_e2e import Service, job_spec, until
from tests.integration.worker.test_service_s3 import _digest
from tests.s3server import SeaweedServer
from tests.seeds import seeded
from tests.waiting import eventually
from worker.checkpoint import storage
from worker.checkpoint.remote import list_published, read_latest
from worker.checkpoint.storage import storage_for
from worker.jobspec.location import S3Location

pytestmark = [pytest.mark.faults, pytest.mark.integration]
STEPS = 30
HELD_S = 6.0
"""How long the failpoint holds the rank inside its upload (the outage starts within it)."""


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SeaweedServer]:
    with SeaweedServer(tmp_path / "seaweed") as server, pytest.MonkeyPatch.context() as mp:
        for k, v in server.env().items():
            mp.setenv(k, v)  # this process reads the bucket with the service's variables
        mp.setattr(storage, "_stores", {})  # this process's clients: made anew for this server
        yield server


@seeded
def test_storage_server_killed_during_a_save(
    store: SeaweedServer, tmp_path: Path, service_job_digest: str, seed: int
) -> None:
    rng = random.Random(seed)
    rank, down_s = rng.choice([0, 1]), round(rng.uniform(0.0, 4.0), 2)
    arm = f"during_shard_write=sleep:{HELD_S}@{rank}#2^0"  # the second save (step 20), first attempt
    what = f"seed={seed} {arm} down {down_s}s"
    loc = S3Location("ckpt", f"outage/{uuid.uuid4().hex[:12]}")
    env = store.env() | {"PYTHONPATH": str(REPO), "ELASTRAIN_FAILPOINTS": arm}
    svc = Service(tmp_path / "svc", env)
    svc.data_dir.mkdir()
    svc.start()
    try:
        spec = job_spec(max_steps=STEPS) | {"checkpoint": {"dir": str(loc), "interval_steps": 10}}
        job_id = svc.submit(spec)
        marker = f"elastrain failpoint during_shard_write: sleep:{HELD_S}"
        until(lambda: marker in svc.node_logs(job_id), f"{what}: rank {rank} inside its upload", 240)
        store.kill()
        time.sleep(down_s)
        store.start()
        final = svc.finished(job_id, timeout=240)
        events = [e["message"] for e in final["events"]]
    finally:
        svc.stop()
    assert final["state"] == "SUCCEEDED", f"{what}: {final}\n{svc.node_logs(job_id)[-3000:]}"
    assert final["restarts"] == 0, f"{what}: training was interrupted: {final['recoveries']}"
    alive = store.proc is not None and store.proc.poll() is None
    assert alive, f"{what}: the store exited:\n{(store.directory / 'weed.log').read_text()[-3000:]}"
    published = [s for s, _ in list_published(loc)]
    print(f"{what}: published {published}")  # which way the save went, in the row's output
    aborted = [m for m in events if "step 20 aborted" in m]
    assert published in ([10, 20, 30], [10, 30]), f"{what}: {published}"
    if published == [10, 30]:  # failed cleanly: said so, and its shards do not outlive the job
        assert aborted, f"{what}: step 20 is missing without an abort: {events}"
        eventually(
            f"{what}: the shards of the aborted step 20 removed",
            lambda: storage_for(loc).listing(loc.key("step-00000020"))[1] == [],
            20,
        )
    else:
        assert not aborted, f"{what}: step 20 was published and aborted: {events}"
    assert read_latest(loc)[0] == "step-00000030", what
    assert _digest(str(loc)) == service_job_digest, what
