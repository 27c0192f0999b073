"""TLS to etcd for the service and every node it launches: ELASTRAIN_ETCD_CA_CERT,
ELASTRAIN_ETCD_CERT and ELASTRAIN_ETCD_KEY (worker/etcdclient.py's EtcdTLS, the service's
Settings, the nodes' environment).

* End to end: a real etcd that speaks only TLS and asks every client for a certificate of its CA
  (``--client-cert-auth``); the ``elastrain serve`` console script given the CA and a client
  certificate keeps its state there and runs a peer-mode job of 2 nodes (local TorchX, real
  torchrun, gloo) in each recovery mode: the jobs' checkpoints are published through the
  service's records, the peer-mode workers form their group through their etcd membership and
  the restart-mode agents meet through the etcd-v3 rendezvous, all over TLS.
* A torchrun agent's rendezvous takes the files from its environment, unless its ``--rdzv-conf``
  names its own.
* A setting that cannot work is refused at start, naming the variable and the file; nothing is
  sent to etcd to find out.

Certificates made with the openssl command (tests/tls_certs.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters

from service.jobs.model import JobRecord
from service.launch.apps import SchedulerSettings
from service.launch.dryrun import kubernetes_dryrun, worker_pod
from service.launch.protocol import NodeLaunch
from service.reconciler import LaunchContext, service_env
from service.rendezvous.handler import EtcdV3RendezvousBackend, create_backend
from service.settings import SettingsError, load_settings
from tests.integration.worker.test_service_e2e import Service, job_spec
from tests.tls_certs import make_certs
from worker.etcdclient import TLS_ENV, EtcdTLS
from worker.jobspec.spec import parse_spec

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs"))


def tls_env(certs: Path) -> dict[str, str]:
    return dict(zip(TLS_ENV, (str(certs / n) for n in ("ca.crt", "client.crt", "client.key")), strict=True))


def test_the_files_read_from_the_environment_come_back_the_same(certs: Path) -> None:
    tls = EtcdTLS.from_env(tls_env(certs))
    assert tls == EtcdTLS(str(certs / "ca.crt"), (str(certs / "client.crt"), str(certs / "client.key")))
    assert EtcdTLS.from_env(tls.env()) == tls
    tls.check()  # loads as a connection would
    assert EtcdTLS.from_env({}) == EtcdTLS() and EtcdTLS().env() == {}
    assert EtcdTLS.from_env({TLS_ENV[0]: str(certs / "ca.crt")}).env() == {TLS_ENV[0]: str(certs / "ca.crt")}


@pytest.mark.parametrize("given", [1, 2], ids=["certificate-only", "key-only"])
def test_a_certificate_without_its_key_is_refused_naming_both(certs: Path, given: int) -> None:
    with pytest.raises(
        ValueError, match=r"ELASTRAIN_ETCD_(CERT|KEY) is set but ELASTRAIN_ETCD_(KEY|CERT) is not"
    ):
        EtcdTLS.from_env({TLS_ENV[given]: str(certs / "client.crt")})


def test_the_service_takes_the_files_as_absolute_paths_and_gives_no_node_any_of_them(
    certs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(certs)  # relative paths: the service may run from another directory later
    relative = dict(zip(TLS_ENV, ("ca.crt", "client.crt", "client.key"), strict=True))
    for name, value in relative.items():
        monkeypatch.setenv(name, value)
    settings = load_settings(etcd="https://127.0.0.1:2379")
    assert settings.etcd_tls == EtcdTLS.from_env(tls_env(certs))
    env = service_env(
        JobRecord.model_construct(id="j", checkpoint_dir="/ck", spec=None), LaunchContext("http://svc"), "t"
    )
    assert not set(TLS_ENV) & set(env)  # a job reaches etcd through the service's gateway only


def _files(certs: Path, **names: str) -> dict[str, object]:
    return {f"etcd_{k}": str(certs / v) if v else v for k, v in names.items()}


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"etcd": ""}, "ELASTRAIN_ETCD_CA_CERT set without ELASTRAIN_ETCD"),
        ({"etcd": "http://127.0.0.1:2379"}, "has no https:// endpoint"),
        ({"ca_cert": "missing.crt"}, "ELASTRAIN_ETCD_CA_CERT: .*missing.crt: .*No such file"),
        ({"ca_cert": "client.key"}, "ELASTRAIN_ETCD_CA_CERT: .*client.key"),  # a key, not a certificate
        ({"cert": "client.crt", "key": ""}, "ELASTRAIN_ETCD_CERT is set but ELASTRAIN_ETCD_KEY is not"),
        (
            {"cert": "client.crt", "key": "other-ca.key"},
            "ELASTRAIN_ETCD_CERT/ELASTRAIN_ETCD_KEY",
        ),  # not its key
    ],
    ids=["embedded-etcd", "plain-http", "missing-file", "not-a-certificate", "no-key", "another-key"],
)
def test_a_tls_setting_that_cannot_work_is_refused_at_start(
    certs: Path, overrides: dict[str, str], says: str
) -> None:
    given: dict[str, object] = {"etcd": overrides.pop("etcd", "https://127.0.0.1:2379")}
    given |= _files(certs, **({"ca_cert": "ca.crt"} | overrides))
    with pytest.raises(SettingsError, match=says):
        load_settings(**given)


def test_no_worker_pod_mounts_the_etcd_tls_files(certs: Path) -> None:
    """The service's etcd client certificate stays in the service's pod: a worker pod gets no
    Secret, no TLS variable and no etcd endpoint."""
    given: dict[str, object] = {"etcd": "https://etcd:2379", "scheduler": "kubernetes", "worker_image": "w"}
    given |= _files(certs, ca_cert="ca.crt", cert="client.crt", key="client.key")
    settings = load_settings(**given)
    record = JobRecord.model_construct(id="job-7", checkpoint_dir="/ck", spec=None)
    env = service_env(record, LaunchContext("http://svc"), "token")
    node = NodeLaunch("job-7", parse_spec(job_spec()), 0, "job-7-n0-a0", env)
    pod = worker_pod(kubernetes_dryrun(node, SchedulerSettings.from_settings(settings)))["spec"]
    (container,) = pod["containers"]
    assert not [v for v in pod["volumes"] if "secret" in v]
    names = {e["name"] for e in container["env"]}
    assert not set(TLS_ENV) & names and "etcd:2379" not in repr(pod)


def test_jobs_run_on_an_etcd_that_asks_for_a_client_certificate(
    tls_etcd: tuple[str, Path], tmp_path: Path
) -> None:
    """Both recovery modes, side by side under one service: in peer mode the workers meet as a
    group through their membership in etcd; in restart mode the two nodes' torchrun agents meet
    through the etcd-v3 rendezvous."""
    url, certs = tls_etcd
    svc = Service(tmp_path / "svc", tls_env(certs), etcd=url)
    svc.data_dir.mkdir()
    svc.start()
    try:
        modes = ("peer", "restart")
        jobs = {
            m: svc.submit(job_spec(nodes="2", nproc_per_node=1, max_steps=20, recovery={"mode": m}))
            for m in modes
        }
        for mode, job_id in jobs.items():
            job = svc.finished(job_id)
            assert job["state"] == "SUCCEEDED", (mode, job["events"][-10:])
            assert job["last_published_step"] == 20  # every save published through the service's records
            assert job["recovery_mode"] == mode and job["world_size"] == 2, job
    finally:
        svc.stop()


def test_the_rendezvous_takes_the_files_from_its_environment_unless_its_config_names_them(
    tls_etcd: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torchrun agent on a user's own etcd over TLS may have the files in its environment; a hand-typed
    ``--rdzv-conf`` ``ca_cert`` wins over them (here: a CA that did not sign etcd's certificate)."""
    url, certs = tls_etcd
    for name, value in tls_env(certs).items():
        monkeypatch.setenv(name, value)

    def backend(**config: str) -> EtcdV3RendezvousBackend:
        params = RendezvousParameters("etcd-v3", url, "tls-run", min_nodes=1, max_nodes=1, **config)
        return create_backend(params)[0]

    assert backend().get_state() is None  # reached etcd with the environment's CA and certificate
    with pytest.raises(RendezvousConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
        backend(ca_cert=str(certs / "other-ca.crt")).get_state()
