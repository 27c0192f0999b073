"""Job code reaches nothing in etcd outside its own job's rendezvous keys. Against a real etcd:
etcd's own auth with the service as root and the only user; and a real torchrun job under
`elastrain serve` (embedded etcd, auth on) whose rendezvous goes through the service's key-value
gateway: its processes hold no etcd endpoint or credential, and with what they hold (the gateway
and the worker token) they reach their own keys and nothing else."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.demo import process_env, worker_pids
from service.etcd.access import EtcdAuth, rendezvous_prefix
from service.etcd.server import EtcdServer
from service.jobs import keys
from service.rendezvous.kv import EtcdKV
from tests.integration.worker.test_service_e2e import Service, job_spec, until
from worker.etcdclient import (
    GATEWAY_ENV,
    TOKEN_ENV,
    Credentials,
    EtcdClient,
    EtcdEndpoint,
    EtcdRefusedError,
    b64,
    range_end,
)

pytestmark = pytest.mark.integration
ROOT = Credentials("root", "root-password-for-the-test")


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[list[EtcdEndpoint]]:
    with EtcdServer(tmp_path / "etcd") as server:
        members = [EtcdEndpoint.from_url(server.endpoint)]
        EtcdAuth(EtcdClient(members)).enable(ROOT.password)
        yield members


def refused(call: object, *args: object) -> str:
    """The refusal of ``call(*args)`` (fails when it is allowed)."""
    with pytest.raises(EtcdRefusedError) as err:
        call(*args)  # type: ignore[operator]
    return err.value.detail


def test_enabling_auth_is_idempotent_and_keeps_roots_password(etcd: list[EtcdEndpoint]) -> None:
    EtcdAuth(EtcdClient(etcd)).enable(ROOT.password)  # on already: nothing changes
    root = EtcdAuth(EtcdClient(etcd, credentials=ROOT))
    assert root.enabled()
    anonymous = EtcdKV(etcd, lease_ttl=30, read_timeout=5)
    assert "user name is empty" in refused(anonymous.get, keys.WORKER_SECRET)
    wrong = EtcdClient(etcd, credentials=Credentials("root", "guess"))
    with pytest.raises(EtcdRefusedError) as err:
        wrong.range({"key": "L2E="})
    assert "guess" not in str(err.value) and "check the etcd user and password" in str(err.value)


def test_a_restart_mode_job_rendezvous_through_the_gateway_and_reaches_nothing_else(tmp_path: Path) -> None:
    svc = Service(tmp_path / "svc", {"ELASTRAIN_FAILPOINTS": "after_grad_sync=sleep:0.05"})
    svc.data_dir.mkdir()
    svc.start()
    try:
        root_password = (svc.data_dir / "etcd-root-password").read_text().strip()
        etcd_port = str(json.loads((svc.data_dir / "etcd" / "ports.json").read_text())["client_port"])
        spec = job_spec(name="gw", nproc_per_node=1, max_steps=400, log_every_steps=20)
        spec["recovery"] = {"mode": "restart"}
        job_id = svc.submit(spec)
        until(lambda: (svc.job(job_id)["step"] or 0) >= 5, "the job to train", 180)
        env = process_env(worker_pids(job_id)[0])
        assert not [k for k in env if k.startswith("ELASTRAIN_ETCD")] and "ELASTRAIN_API_TOKEN" not in env
        assert root_password not in "\n".join(env.values()) and etcd_port not in "\n".join(env.values())
        gateway = EtcdEndpoint.from_url(env[GATEWAY_ENV])
        kv = EtcdKV([gateway], lease_ttl=30, read_timeout=5, bearer=env[TOKEN_ENV])  # as torchrun's agent
        own = rendezvous_prefix(job_id)
        assert kv.count(own) >= 1  # its rendezvous, as torchrun wrote it through the gateway
        written, _ = kv.cas(own + "probe", b"mine", None)
        assert written and kv.get(own + "probe") is not None
        for key in (keys.WORKER_SECRET, keys.job(job_id), rendezvous_prefix("other-job") + "state"):
            assert "outside this job's keys" in refused(kv.get, key), key
            assert "outside this job's keys" in refused(kv.put, key, b"x"), key
        client = EtcdClient([gateway], bearer=env[TOKEN_ENV])
        for path in ("maintenance/alarm", "auth/enable", "lease/leases", "lease/timetolive"):
            assert "not an operation a job may use" in refused(client.post, path, {}), path
        whole = {"key": b64(own), "range_end": b64("\0")}
        assert "reaches outside" in refused(client.post, "kv/range", whole)
        elsewhere = EtcdEndpoint.from_url(env[GATEWAY_ENV].replace(job_id, "other-job"))
        other = EtcdClient([elsewhere], bearer=env[TOKEN_ENV])
        theirs = rendezvous_prefix("other-job")
        body = {"key": b64(theirs), "range_end": b64(range_end(theirs))}
        assert f"belongs to job {job_id!r}" in refused(other.post, "kv/range", body)
        assert svc.http.delete(f"/v1/jobs/{job_id}").status_code == 202
        until(lambda: svc.job(job_id)["state"] == "CANCELLED", "the cancel", 60)
        until(lambda: "no longer work" in _refusal(kv, own), "the worker token to stop working", 30)
    finally:
        svc.stop()


def _refusal(kv: EtcdKV, prefix: str) -> str:
    try:
        kv.count(prefix)
    except EtcdRefusedError as exc:
        return exc.detail
    return ""
