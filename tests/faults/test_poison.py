"""The "poison" row: one tenant's bad input stops nothing for the others. A real
service (embedded etcd, local TorchX scheduler, real torchrun workers) runs a healthy job (W=2,
30 steps) while, in an order the seed draws:

* malformed specs are submitted (non-finite numbers, a key twice, an integer of 5,000 digits,
  200,000 levels of nesting, sizes no run can use): every one is a 4xx, none stored;
* malformed job records are written straight into etcd (not JSON, the wrong shape, a spec that
  no longer validates, a state this version does not know): each becomes a FAILED job, listed;
* a bomb manifest (nested 200,000 deep) lands in a live job's and in a finished job's
  checkpoint directory, and the service is killed (-9) and restarted;
* a flooding worker (the live job's own token) sends checkpoint reports of 0.9 MB for distinct
  steps (rank 0 of 2: each opens a save) and heartbeats for made-up nodes: 429 and 422, etcd
  grows far less than the 46 MB of the unbounded flood (under 16 MB, counting the history etcd keeps);
* the live job is cancelled: it goes CANCELLED.

The healthy job must finish SUCCEEDED with the digest of the same job run alone (bare torchrun).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from scripts.demo import worker_pids
from service.etcd.kv import EtcdStore
from service.jobs import keys
from tests.integration.worker.test_service_e2e import Service, digest, job_spec, until
from tests.seeds import seeded
from worker.etcdclient import Credentials

pytestmark = [pytest.mark.faults, pytest.mark.integration]
STEPS = 30
BOMB = b"[" * 200_000 + b"]" * 200_000


def small(name: str, **over: Any) -> dict[str, Any]:
    """A one-process job of the same model (cheap next to the healthy one)."""
    return job_spec(name=name, nproc_per_node=1, **over)


def bad_specs() -> dict[str, bytes]:
    text = json.dumps(small("bad"))[:-1]
    return {
        "lr Infinity": (text + ', "optimizer": {"lr": Infinity}}').encode(),
        "betas NaN": (text + ', "optimizer": {"betas": [0.9, NaN]}}').encode(),
        "1e999": (text + ', "loss_scale": {"init_scale": 1e999}}').encode(),
        "a key twice": (text + ', "max_steps": 7}').encode(),
        "5000 digits": (text + ', "seed": ' + "9" * 5000 + "}").encode(),
        "deep": b"[" * 200_000 + b"]" * 200_000,
        "max_steps 1e30": json.dumps(small("bad", max_steps=10**30)).encode(),
        "micro_batch 1e12": json.dumps(small("bad", micro_batch_size=10**12)).encode(),
        "resources": json.dumps(small("bad", resources={"cpu": "x"})).encode(),
    }


def bad_records(template: dict[str, Any]) -> dict[str, bytes]:
    """Records for made-up job ids, as hand edits or other versions leave them (no nodes: a
    stand-in stops the nodes its record names)."""
    base = template | {"nodes": [], "state": "RUNNING"}
    spec = json.loads(json.dumps(base))
    spec["spec"]["optimizer"] = {"lr": None}
    return {
        "poison-notjson-000001": b"\x00\xff not a record",
        "poison-shape-000002": b'[{"id": 5}]',
        "poison-spec-000003": json.dumps(spec | {"id": "poison-spec-000003"}).encode(),
        "poison-state-000004": json.dumps(base | {"id": "poison-state-000004", "state": "PAUSED"}).encode(),
    }


class Row:
    def __init__(self, svc: Service, rng: random.Random) -> None:
        self.svc, self.rng = svc, rng
        ports = json.loads((svc.data_dir / "etcd" / "ports.json").read_text())
        self.etcd = f"http://127.0.0.1:{ports['client_port']}"
        # The embedded etcd has auth on: writing records by hand takes its root (an operator).
        self.root = Credentials("root", (svc.data_dir / "etcd-root-password").read_text().strip())

    def state(self, job_id: str) -> str:
        return str(self.svc.job(job_id)["state"])

    def poison_specs(self) -> None:
        for what, body in self.rng.sample(sorted(bad_specs().items()), k=len(bad_specs())):
            resp = self.svc.http.post("/v1/jobs", content=body, headers={"Content-Type": "application/json"})
            assert 400 <= resp.status_code < 500, f"{what}: {resp.status_code} {resp.text[:300]}"

    def poison_records(self, template_id: str) -> list[str]:
        store = EtcdStore(self.etcd, credentials=self.root)
        try:
            found = store.get(keys.job(template_id))
            assert found is not None
            records = bad_records(json.loads(found.value))
            chosen = self.rng.sample(sorted(records), k=self.rng.randint(2, len(records)))
            for job_id in chosen:
                store.put(keys.job(job_id), records[job_id])
        finally:
            store.client.close()
        return chosen

    def bomb(self, job_id: str) -> None:
        job_dir = Path(self.svc.job(job_id)["checkpoint_dir"])
        step = job_dir / f"step-{self.rng.randrange(11, 99):08d}"
        step.mkdir(parents=True, exist_ok=True)
        (step / "manifest.json").write_bytes(BOMB)

    def db_in_use(self) -> int:
        store = EtcdStore(self.etcd, credentials=self.root)
        try:
            status = store.client.post("maintenance/status", {})
        finally:
            store.client.close()
        return int(status.get("dbSizeInUse", status["dbSize"]))

    def flood(self, job_id: str) -> None:
        token = worker_token(job_id)
        worker = httpx.Client(base_url=f"{self.svc.url}/v1/jobs/{job_id}/workers", timeout=30,
                              headers={"Authorization": f"Bearer {token}"})  # fmt: skip
        before = self.db_in_use()
        pad = "x" * 900_000
        reports = []
        # steps the live job (max_steps 100,000) does not reach while the row runs: a round older
        # than its newest published step is dropped when the next report comes (it can no longer
        # publish), which frees a slot, so a flood with steps below that one opened more than 4
        for step in self.rng.sample(range(90_000, 100_000), k=20):
            body = {"step": step, "generation": 0, "rank": 0, "world_size": 2, "ok": True, "error": "",
                    "files": {}, "pieces": [], "tensors": {}, "meta_digest": "", "rank_meta": {"pad": pad},
                    "context": {}}  # fmt: skip
            reports.append(worker.post("/checkpoints", json=body).status_code)
        beats = {worker.post("/heartbeat", json={"launch_id": f"made-up-{i}", "local_rank": 0}).status_code
                 for i in range(20)}  # fmt: skip
        grown = self.db_in_use() - before
        worker.close()
        assert reports.count(200) <= 4 and set(reports) <= {200, 429}, reports  # 4 saves open at most
        assert beats == {422} and grown < 16e6, f"etcd grew {grown / 1e6:.1f} MB; heartbeats {beats}"

    def restart(self) -> None:
        self.svc.kill9()
        self.svc.start()


def worker_token(job_id: str) -> str:
    """The job's worker token, as its own worker processes hold it (their environment)."""
    pid = until(lambda: worker_pids(job_id), f"a worker of {job_id}", 120)[0]
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    token = next(v for v in env if v.startswith(b"ELASTRAIN_WORKER_TOKEN="))
    return token.split(b"=", 1)[1].decode()


@seeded
def test_poison_next_to_a_healthy_job(tmp_path: Path, service_job_digest: str, seed: int) -> None:
    rng = random.Random(seed)
    svc = Service(tmp_path / "svc", {"ELASTRAIN_FAILPOINTS": "after_grad_sync=sleep:0.05"})
    svc.data_dir.mkdir()
    svc.start()
    try:
        row = Row(svc, rng)
        finished = svc.submit(small("finished", max_steps=5))
        until(lambda: row.state(finished) == "SUCCEEDED", "the small job to finish", 300)
        healthy = svc.submit(job_spec(name="healthy", max_steps=STEPS))
        live = svc.submit(small("live", max_steps=100_000, log_every_steps=50, nodes="1:2", initial_nodes=1))
        until(lambda: row.state(live) == "RUNNING" and row.state(healthy) == "RUNNING", "both RUNNING", 120)
        # Live: its worker trains (a step reported), so its start, and its look for a checkpoint
        # to resume from, are behind it. A worker still starting when the bomb lands finds a
        # step that does not verify and nothing older, and refuses to start over (by design:
        # "repair or remove them, or set checkpoint.resume: never"), so the job FAILs.
        until(lambda: (svc.job(live)["step"] or 0) >= 1, "the live job to train", 120)
        poisoned: list[str] = []
        steps: list[Callable[[], None]] = [
            row.poison_specs,
            lambda: poisoned.extend(row.poison_records(healthy)),
            lambda: (row.bomb(live), row.bomb(finished), row.restart()),
            lambda: row.flood(live),
        ]
        rng.shuffle(steps)
        for step in steps:
            step()
            time.sleep(rng.uniform(0.0, 2.0))
        for job_id in poisoned:
            until(lambda j=job_id: row.state(j) == "FAILED", f"{job_id} FAILED", 60)
        listed = svc.http.get("/v1/jobs?limit=500")
        assert listed.status_code == 200, listed.text
        assert {j["id"] for j in listed.json()["jobs"]} >= {healthy, live, finished, *poisoned}
        assert svc.http.get(f"/v1/jobs/{live}/resume").status_code == 200
        assert svc.http.delete(f"/v1/jobs/{live}").status_code == 202
        until(lambda: row.state(live) == "CANCELLED", "the live job CANCELLED", 60)
        final = svc.finished(healthy, timeout=600)
    finally:
        svc.stop()
    assert final["state"] == "SUCCEEDED", f"seed={seed}: {final}"
    assert digest(Path(final["checkpoint_dir"])) == service_job_digest, f"seed={seed}"
