"""Who may touch what in etcd (torch-free).

With auth on, the service is ``root`` and the only etcd user: jobs hold no etcd credential and
no etcd endpoint. A job's rendezvous keys, ``/elastrain/rdzv/<job id>/``, are reached through
the service's key-value gateway (:mod:`service.etcd.gateway`), which confines each job to its
prefix, its own leases and a budget (etcd's own per-prefix roles do not contain a hostile user:
etcd 3.5 lets any user raise the NOSPACE alarm and skips permission checks while it is active).

:meth:`EtcdAuth.enable` turns auth on where it is off (the embedded etcd at its first start, the
chart's etcd at the service's first start): the ``root`` role, the ``root`` user with the given
password, then ``/v3/auth/enable``. Every call is idempotent.
"""

from __future__ import annotations

from worker.etcdclient import EtcdClient, EtcdRefusedError

ROOT_USER = "root"
RENDEZVOUS_ROOT = "/elastrain/rdzv"
"""Where torchrun's etcd-v3 rendezvous keeps each run's keys (``<root>/<run id>/...``)."""
_EXISTS = ("already exists", "already has role")


def rendezvous_prefix(job_id: str, root: str = RENDEZVOUS_ROOT) -> str:
    """Every rendezvous key of ``job_id`` (its run id) starts with this."""
    return f"{root}/{job_id}/"


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

    def _idempotent(self, path: str, body: dict[str, str], harmless: tuple[str, ...]) -> None:
        try:
            self.client.post(path, body)
        except EtcdRefusedError as exc:
            if not any(text in exc.detail for text in harmless):
                raise
