"""A model factory of the hostile-job row: job code that, from inside its worker, tries to reach
beyond its job with whatever its process was given, writes what it saw to ``report`` (JSON), then
returns the built-in MLP so that the job trains like any other. Rank 0 attacks; the others build
the model only. Every attack is recorded as what the service answered."""

from __future__ import annotations

import json
import os
from typing import Any

from worker.etcdclient import EtcdClient, EtcdEndpoint, EtcdRefusedError, EtcdUnavailableError, b64, range_end
from worker.start.models import BUILTIN

FILL_VALUE = 200 * 1024


def hostile(meta: dict[str, Any], *, report: str, victim: str, **kwargs: Any) -> Any:
    if os.environ.get("RANK", "0") == "0":
        seen = attack(dict(os.environ), victim)
        tmp = f"{report}.tmp"
        with open(tmp, "w", encoding="utf-8") as out:
            json.dump(seen, out)
        os.replace(tmp, report)
    return BUILTIN["mlp"](meta, **kwargs)


def attack(env: dict[str, str], victim: str) -> dict[str, Any]:
    """Every attack, as ``{name: the service's answer}`` plus what the environment held."""
    seen: dict[str, Any] = {"env": env}
    gateway, token = env.get("ELASTRAIN_KV_GATEWAY", ""), env.get("ELASTRAIN_WORKER_TOKEN", "")
    if not gateway:
        return seen
    client = EtcdClient([EtcdEndpoint.from_url(gateway)], bearer=token)
    job = env.get("ELASTRAIN_JOB_ID", "")
    own = f"/elastrain/rdzv/{job}/"
    theirs = f"/elastrain/rdzv/{victim}/"
    attempts: dict[str, tuple[str, dict[str, Any]]] = {
        "alarm": ("maintenance/alarm", {"action": "ACTIVATE", "memberID": "0", "alarm": "NOSPACE"}),
        "auth_disable": ("auth/disable", {}),
        "grant_root": ("auth/user/grant", {"user": "x", "role": "root"}),
        "lease_list": ("lease/leases", {}),
        "lease_keys": ("lease/timetolive", {"ID": "1", "keys": True}),
        "worker_secret": ("kv/range", {"key": b64("/elastrain/config/worker-secret")}),
        "everything": ("kv/range", {"key": b64("\0"), "range_end": b64("\0")}),
        "from_own_to_end": ("kv/range", {"key": b64(own), "range_end": b64("\0")}),
        "camel_case": ("kv/range", {"key": b64(own), "rangeEnd": b64("\0")}),
        "victim_keys": ("kv/range", {"key": b64(theirs), "range_end": b64(range_end(theirs))}),
        "victim_delete": ("kv/deleterange", {"key": b64(theirs), "range_end": b64(range_end(theirs))}),
        "nested_txn": (
            "kv/txn",
            {
                "success": [
                    {
                        "request_txn": {
                            "success": [
                                {
                                    "request_delete_range": {
                                        "key": b64(theirs),
                                        "range_end": b64(range_end(theirs)),
                                    }
                                }
                            ]
                        }
                    }
                ]
            },
        ),
        "foreign_lease": ("lease/keepalive", {"ID": "7587000000000000001"}),
        "lease_with_id": ("lease/grant", {"TTL": 60, "ID": "7587000000000000002"}),
    }
    for name, (path, body) in attempts.items():
        seen[name] = _answer(client, path, body)
    elsewhere = EtcdClient(
        [EtcdEndpoint.from_url(gateway.replace(f"/jobs/{job}/", f"/jobs/{victim}/"))], bearer=token
    )
    seen["victim_gateway"] = _answer(elsewhere, "kv/range", {"key": b64(theirs)})
    seen["fill"] = _fill(client, own)
    return seen


def _answer(client: EtcdClient, path: str, body: dict[str, Any]) -> str:
    try:
        answer = client.post(path, body)
    except EtcdRefusedError as exc:
        return f"refused: {exc.detail}"
    except EtcdUnavailableError as exc:
        return f"unavailable: {exc}"
    return "ALLOWED: " + json.dumps(answer)[:300]


def _fill(client: EtcdClient, own: str) -> dict[str, Any]:
    """Write 200 KiB values under the job's own keys until refused (at most 64 MiB), then delete them."""
    written, refusal = 0, ""
    for i in range(320):
        body = {"key": b64(f"{own}fill/{i:04d}"), "value": b64(b"x" * FILL_VALUE)}
        answer = _answer(client, "kv/put", body)
        if not answer.startswith("ALLOWED"):
            refusal = answer
            break
        written += FILL_VALUE
    fill = f"{own}fill/"
    _answer(client, "kv/deleterange", {"key": b64(fill), "range_end": b64(range_end(fill))})
    return {"written": written, "refusal": refusal}
