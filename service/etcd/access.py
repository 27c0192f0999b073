"""Who may touch what in etcd: etcd's own users and roles (torch-free).

With auth on, the service is ``root`` and each job has a user and a role of its own,
``elastrain-job-<job id>``, whose one permission is read-write on that job's rendezvous keys,
``/elastrain/rdzv/<job id>/``. The job's nodes get that user's password in their environment
(``ELASTRAIN_ETCD_USER``, ``ELASTRAIN_ETCD_PASSWORD``): job code can then read and write its own
rendezvous and nothing else (not the worker-token secret, not another job's rendezvous, not
the job records). The service removes the user and the role when the job ends.

:meth:`EtcdAuth.enable` turns auth on where it is off (the embedded etcd at its first start, the
chart's etcd at the service's first start): the ``root`` role, the ``root`` user with the given
password, then ``/v3/auth/enable``. Every call is idempotent.
"""

from __future__ import annotations

from collections.abc import Callable

from worker.etcdclient import Credentials, EtcdClient, EtcdRefusedError, b64, range_end

ROOT_USER = "root"
RENDEZVOUS_ROOT = "/elastrain/rdzv"
"""Where torchrun's etcd-v3 rendezvous keeps each run's keys (``<root>/<run id>/...``)."""
USER_ENV, PASSWORD_ENV = "ELASTRAIN_ETCD_USER", "ELASTRAIN_ETCD_PASSWORD"
_EXISTS = ("already exists", "already has role")
_GONE = ("not found", "does not exist")


def job_user(job_id: str) -> str:
    """The etcd user and role of one job."""
    return f"elastrain-job-{job_id}"


def rendezvous_prefix(job_id: str, root: str = RENDEZVOUS_ROOT) -> str:
    """Every rendezvous key of ``job_id`` (its run id) starts with this."""
    return f"{root}/{job_id}/"


def job_permission(job_id: str) -> dict[str, str]:
    """The one permission of a job's role: read-write on its rendezvous keys. Pure."""
    prefix = rendezvous_prefix(job_id)
    return {"permType": "READWRITE", "key": b64(prefix), "range_end": b64(range_end(prefix))}


def credentials_from_env(env: dict[str, str]) -> Credentials | None:
    """The credentials the service gave a node (None: etcd without auth)."""
    user, password = env.get(USER_ENV), env.get(PASSWORD_ENV)
    return Credentials(user, password) if user and password else None


def node_env(credentials: Credentials) -> dict[str, str]:
    return {USER_ENV: credentials.user, PASSWORD_ENV: credentials.password}


class EtcdAuth:
    """etcd's users and roles through ``client`` (root's credentials, or none before
    :meth:`enable`)."""

    def __init__(self, client: EtcdClient) -> None:
        self.client = client

    def enabled(self) -> bool:
        try:
            answer = self.client.post("auth/status", {})
        except EtcdRefusedError as exc:
            if "user name is empty" in exc.detail or "permission denied" in exc.detail:
                return True  # on, and this client may not ask
            raise
        return bool(answer.get("enabled", False))

    def enable(self, root_password: str) -> None:
        """Create ``root`` (role and user, with ``root_password``) and turn auth on; a no-op
        when it is on. Call with a client without credentials."""
        if self.enabled():
            return
        self._idempotent("auth/role/add", {"name": ROOT_USER}, _EXISTS)
        self._idempotent("auth/user/add", {"name": ROOT_USER, "password": root_password}, _EXISTS)
        # A root left by an earlier attempt gets this password (auth is still off: anyone may).
        self.client.post("auth/user/changepw", {"name": ROOT_USER, "password": root_password})
        self._idempotent("auth/user/grant", {"user": ROOT_USER, "role": ROOT_USER}, _EXISTS)
        self.client.post("auth/enable", {})

    def grant_job(self, job_id: str, password: str) -> Credentials:
        """The job's user and role (created if missing) and its credentials. Idempotent."""
        name = job_user(job_id)
        self._idempotent("auth/role/add", {"name": name}, _EXISTS)
        self.client.post("auth/role/grant", {"name": name, "perm": job_permission(job_id)})
        self._idempotent("auth/user/add", {"name": name, "password": password}, _EXISTS)
        self._idempotent("auth/user/grant", {"user": name, "role": name}, _EXISTS)
        return Credentials(name, password)

    def revoke_job(self, job_id: str) -> None:
        """Delete the job's user and role (its nodes' tokens stop working). Idempotent."""
        name = job_user(job_id)
        self._idempotent("auth/user/delete", {"name": name}, _GONE)
        self._idempotent("auth/role/delete", {"role": name}, _GONE)

    def _idempotent(self, path: str, body: dict[str, str], harmless: tuple[str, ...]) -> None:
        try:
            self.client.post(path, body)
        except EtcdRefusedError as exc:
            if not any(text in exc.detail for text in harmless):
                raise


class JobUsers:
    """Each job's etcd user as the reconciler hands it out: made sure of once per job and
    instance (:meth:`EtcdAuth.grant_job`), removed when the job ends. ``password(job_id)`` derives
    the job's password (the same after a restart)."""

    def __init__(self, auth: EtcdAuth, password: Callable[[str], str]) -> None:
        self.auth = auth
        self._password = password
        self._granted: set[str] = set()

    def credentials(self, job_id: str) -> Credentials:
        if job_id not in self._granted:
            self.auth.grant_job(job_id, self._password(job_id))
            self._granted.add(job_id)
        return Credentials(job_user(job_id), self._password(job_id))

    def remove(self, job_id: str) -> None:
        self.auth.revoke_job(job_id)
        self._granted.discard(job_id)
