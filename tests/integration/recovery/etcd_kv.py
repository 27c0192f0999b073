"""worker.recovery.membership.KeyValue on a real etcd, through the project's one etcd client
(service.etcd.kv.EtcdStore over worker.etcdclient). Test code: the worker's own adapter comes
when that client moves to a torch-free worker module (issue 15); until then the tests reach etcd
this way and the package itself imports no service code."""

from __future__ import annotations

from service.etcd.kv import EtcdStore, Write
from worker.etcdclient import EtcdRefusedError, EtcdUnavailableError, is_lease_not_found
from worker.recovery.membership import KeyValueUnavailable, Stamped


class EtcdKeyValue:
    def __init__(self, endpoints: str) -> None:
        self.store = EtcdStore(endpoints, timeout_s=5.0)

    def get(self, key: str) -> Stamped | None:
        try:
            found = self.store.get(key)
        except EtcdUnavailableError as exc:
            raise KeyValueUnavailable(str(exc)) from None
        return Stamped(found.value, found.mod_revision) if found is not None else None

    def compare_and_set(self, key: str, value: bytes, *, revision: int, lease: int = 0) -> bool:
        try:
            return self.store.commit([Write(key, value, revision, lease)])
        except EtcdUnavailableError as exc:
            raise KeyValueUnavailable(str(exc)) from None

    def put(self, key: str, value: bytes, *, lease: int = 0) -> None:
        try:
            self.store.put(key, value, lease_id=lease)
        except EtcdUnavailableError as exc:
            raise KeyValueUnavailable(str(exc)) from None

    def list_prefix(self, prefix: str) -> list[tuple[str, Stamped]]:
        try:
            return [(e.key, Stamped(e.value, e.mod_revision)) for e in self.store.list_prefix(prefix)]
        except EtcdUnavailableError as exc:
            raise KeyValueUnavailable(str(exc)) from None

    def delete(self, key: str) -> None:
        try:
            self.store.commit([Write(key, None, None)])
        except EtcdUnavailableError as exc:
            raise KeyValueUnavailable(str(exc)) from None

    def lease_grant(self, ttl_s: int) -> int:
        try:
            return self.store.lease_grant(ttl_s)
        except EtcdUnavailableError as exc:
            raise KeyValueUnavailable(str(exc)) from None

    def lease_keepalive(self, lease: int) -> bool:
        try:
            return self.store.lease_refresh(lease)
        except EtcdRefusedError as exc:
            if is_lease_not_found(exc):
                return False
            raise KeyValueUnavailable(str(exc)) from None
        except EtcdUnavailableError as exc:
            raise KeyValueUnavailable(str(exc)) from None

    def lease_revoke(self, lease: int) -> None:
        try:
            self.store.lease_revoke(lease)
        except EtcdUnavailableError as exc:
            raise KeyValueUnavailable(str(exc)) from None
