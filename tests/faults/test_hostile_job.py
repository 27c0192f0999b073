"""The hostile-job row: job code is untrusted. A real service (embedded etcd with auth on, the
local TorchX scheduler, real torchrun workers) runs a victim job (W=2, 30 steps) and, started at
a point the seed draws, a hostile job whose model factory (:mod:`tests.faults.hostile_job`)
attacks from inside its worker with whatever its process holds: it looks for etcd credentials,
an etcd endpoint and the API token in its environment, asks the key-value gateway for alarms,
auth changes, lease listings, the worker-token secret, the victim's keys (directly, through a
nested txn, through the victim's gateway route) and a foreign lease, and fills its own keys.

It must find none of the service's secrets and be refused every time (the fill at its budget,
with the budget named); the victim finishes SUCCEEDED with the digest of the same job run alone
(bare torchrun), the service still leads, etcd's auth is still on and no alarm is active.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from service.etcd.access import EtcdAuth
from tests.integration.worker.test_service_e2e import Service, digest, job_spec, until
from tests.seeds import seeded
from worker.etcdclient import Credentials, EtcdClient, EtcdEndpoint

pytestmark = [pytest.mark.faults, pytest.mark.integration]
STEPS = 30
FACTORY = "tests.faults.hostile_job:hostile"


def _etcd(svc: Service) -> tuple[EtcdEndpoint, str]:
    port = json.loads((svc.data_dir / "etcd" / "ports.json").read_text())["client_port"]
    return EtcdEndpoint.from_url(f"http://127.0.0.1:{port}"), (
        svc.data_dir / "etcd-root-password"
    ).read_text().strip()


def _check_report(seen: dict[str, object], *, api_token: str, root_password: str, etcd_port: int) -> None:
    env = seen["env"]
    assert isinstance(env, dict)
    assert not [name for name in env if "ETCD" in name], sorted(env)
    assert "ELASTRAIN_API_TOKEN" not in env
    values = "\n".join(env.values())
    assert api_token not in values and root_password not in values and f":{etcd_port}" not in values
    for name in ("alarm", "auth_disable", "grant_root", "lease_list", "lease_keys"):
        assert "not an operation a job may use" in str(seen[name]), (name, seen[name])
    for name in (
        "worker_secret",
        "everything",
        "from_own_to_end",
        "victim_keys",
        "victim_delete",
        "nested_txn",
    ):
        assert "outside this job's keys" in str(seen[name]) or "reaches outside" in str(seen[name]), (
            name,
            seen[name],
        )
    assert "unknown field(s) rangeEnd" in str(seen["camel_case"])
    assert "was not granted to job" in str(seen["foreign_lease"])
    assert "leave ID out" in str(seen["lease_with_id"])
    assert "this worker token belongs to job" in str(seen["victim_gateway"])
    fill = seen["fill"]
    assert isinstance(fill, dict) and "kv budget job_bytes" in fill["refusal"], fill
    assert 0 < fill["written"] <= 4 << 20, fill


@seeded
def test_a_hostile_job_reaches_nothing_beside_a_victim(
    tmp_path: Path, service_job_digest: str, seed: int
) -> None:
    rng = random.Random(seed)
    svc = Service(tmp_path / "svc", {"ELASTRAIN_FAILPOINTS": "after_grad_sync=sleep:0.05"})
    svc.data_dir.mkdir()
    svc.start()
    report = tmp_path / "hostile.json"
    try:
        victim = svc.submit(job_spec(name="victim", max_steps=STEPS))
        until(lambda: svc.job(victim)["state"] == "RUNNING", "the victim to run", 180)
        time.sleep(rng.uniform(0.0, 3.0))
        model = {"factory": FACTORY, "kwargs": {"report": str(report), "victim": victim, "hidden": 32}}
        hostile = svc.submit(job_spec(name="hostile", nproc_per_node=1, max_steps=5, model=model))
        until(report.exists, "the hostile job's report", 300)
        final = svc.finished(victim, timeout=600)
        svc.finished(hostile, timeout=300)
        endpoint, root_password = _etcd(svc)
        assert svc.http.get("/readyz").json().get("leader") is True
        assert EtcdAuth(EtcdClient([endpoint])).enabled()  # auth still on
        root = EtcdClient([endpoint], credentials=Credentials("root", root_password))
        assert not root.post("maintenance/alarm", {"action": "GET"}).get("alarms")
    finally:
        svc.stop()
    seen = json.loads(report.read_text())
    _check_report(seen, api_token=svc.token, root_password=root_password, etcd_port=endpoint.port)
    assert final["state"] == "SUCCEEDED", f"seed={seed}: {final}"
    assert digest(Path(final["checkpoint_dir"])) == service_job_digest, f"seed={seed}"
