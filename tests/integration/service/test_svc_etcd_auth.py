"""Job code reaches nothing in etcd outside its own job's rendezvous keys: the
worker-token secret must not be readable at /elastrain/config/worker-secret from inside any job,
nor another job's token derivable from it. Against a real etcd: etcd's own auth, the service
as root, one user and role per job limited to /elastrain/rdzv/<job id>/, its password handed to
that job's nodes only; and a real torchrun job under `elastrain serve` (embedded etcd, auth on)
that forms its group and trains with those credentials."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.demo import worker_pids
from service.etcd.access import EtcdAuth, credentials_from_env, job_user, rendezvous_prefix
from service.etcd.kv import EtcdStore
from service.etcd.server import EtcdServer
from service.jobs import keys
from service.rendezvous.kv import EtcdKV
from tests.integration.worker.test_service_e2e import Service, job_spec, until
from worker.etcdclient import Credentials, EtcdClient, EtcdEndpoint, EtcdRefusedError

pytestmark = pytest.mark.integration
ROOT = Credentials("root", "root-password-for-the-test")


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[list[EtcdEndpoint]]:
    with EtcdServer(tmp_path / "etcd") as server:
        members = [EtcdEndpoint.from_url(server.endpoint)]
        EtcdAuth(EtcdClient(members)).enable(ROOT.password)
        yield members


def refused(call: object, *args: object) -> str:
    """etcd's refusal of ``call(*args)`` (fails when etcd allows it)."""
    with pytest.raises(EtcdRefusedError) as err:
        call(*args)  # type: ignore[operator]
    return err.value.detail


def test_a_jobs_user_reaches_its_own_rendezvous_and_nothing_else(etcd: list[EtcdEndpoint]) -> None:
    root = EtcdClient(etcd, credentials=ROOT)
    admin, store = EtcdAuth(root), EtcdStore([m.url for m in etcd], credentials=ROOT)
    assert store.commit([])  # the service, as root, reads and writes everything
    store.put(keys.WORKER_SECRET, b"00" * 32)
    store.put(keys.job("job-b"), b"{}")
    mine = admin.grant_job("job-a", "password-of-job-a")
    admin.grant_job("job-b", "password-of-job-b")
    kv = EtcdKV(etcd, lease_ttl=30, read_timeout=5, credentials=mine)  # what torchrun's agent uses
    own = rendezvous_prefix("job-a")
    written, _ = kv.cas(own + "state", b"round 1", None)
    assert written and kv.get(own + "state") is not None and kv.count(own) == 1
    kv.put(own + "store/MASTER_ADDR", b"10.0.0.1")
    assert kv.all_exist([own + "state", own + "store/MASTER_ADDR"]) and kv.delete_prefix(own + "store/") == 1
    for key in (
        keys.WORKER_SECRET,
        keys.job("job-b"),
        rendezvous_prefix("job-b") + "state",
        "/elastrain/leader",
    ):
        assert "permission denied" in refused(kv.get, key), key
        assert "permission denied" in refused(kv.put, key, b"x"), key
    assert "permission denied" in refused(kv.count, "/elastrain/")
    admin.grant_job("job-c", "password-of-job-c")  # the auth store changed: tokens are renewed
    assert kv.get(own + "state") is not None
    admin.revoke_job("job-a")  # the job ended
    detail = refused(kv.get, own + "state")
    assert "invalid user ID or password" in detail or "invalid auth token" in detail
    anonymous = EtcdKV(etcd, lease_ttl=30, read_timeout=5)
    assert "user name is empty" in refused(anonymous.get, keys.WORKER_SECRET)
    wrong = EtcdClient(etcd, credentials=Credentials("root", "guess"))
    with pytest.raises(EtcdRefusedError) as err:
        wrong.range({"key": "L2E="})
    assert "guess" not in str(err.value) and "check the etcd user and password" in str(err.value)


def test_enabling_auth_is_idempotent_and_keeps_roots_password(etcd: list[EtcdEndpoint]) -> None:
    EtcdAuth(EtcdClient(etcd)).enable(ROOT.password)  # on already: nothing changes
    root = EtcdAuth(EtcdClient(etcd, credentials=ROOT))
    assert root.enabled()
    assert root.grant_job("job-a", "p") == root.grant_job("job-a", "p")
    root.revoke_job("job-a")
    root.revoke_job("job-a")


def _env(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(p.decode().split("=", 1) for p in pairs if b"=" in p)


def test_a_job_under_the_service_trains_with_its_own_etcd_user_and_reaches_nothing_else(
    tmp_path: Path,
) -> None:
    svc = Service(tmp_path / "svc", {"ELASTRAIN_FAILPOINTS": "after_grad_sync=sleep:0.05"})
    svc.data_dir.mkdir()
    svc.start()
    try:
        root_password = (svc.data_dir / "etcd-root-password").read_text().strip()
        endpoint = "http://127.0.0.1:" + str(
            json.loads((svc.data_dir / "etcd" / "ports.json").read_text())["client_port"]
        )
        job_id = svc.submit(job_spec(name="authjob", nproc_per_node=1, max_steps=400, log_every_steps=20))
        until(lambda: (svc.job(job_id)["step"] or 0) >= 5, "the job to train", 180)
        env = _env(worker_pids(job_id)[0])
        credentials = credentials_from_env(env)
        assert credentials is not None and credentials.user == job_user(job_id)
        assert root_password not in "\n".join(env.values())
        kv = EtcdKV([EtcdEndpoint.from_url(endpoint)], lease_ttl=30, read_timeout=5, credentials=credentials)
        assert kv.count(rendezvous_prefix(job_id)) >= 1  # its rendezvous, as torchrun wrote it
        for key in (keys.WORKER_SECRET, keys.job(job_id), rendezvous_prefix("other-job") + "state"):
            assert "permission denied" in refused(kv.get, key), key
        log = "".join(p.read_text(errors="replace") for p in svc.data_dir.glob("service-*.log"))
        assert credentials.password not in log and root_password not in log
        public = json.dumps(svc.job(job_id))
        assert credentials.password not in public and "ELASTRAIN_ETCD_PASSWORD" not in public
        assert svc.http.delete(f"/v1/jobs/{job_id}").status_code == 202
        until(lambda: svc.job(job_id)["state"] == "CANCELLED", "the cancel", 60)
        until(lambda: _refused_login(kv, job_id), "the job's etcd user removed", 60)
    finally:
        svc.stop()


def _refused_login(kv: EtcdKV, job_id: str) -> bool:
    try:
        kv.get(rendezvous_prefix(job_id) + "state")
    except EtcdRefusedError:
        return True
    return False
