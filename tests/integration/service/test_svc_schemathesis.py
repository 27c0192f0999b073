"""A schemathesis run over the service's OpenAPI schema (real uvicorn, real etcd): whatever
the generated requests hold, the answer is never a 5xx."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from svc_process import ServiceProcess

from service.etcd_server import EtcdServer

pytestmark = pytest.mark.integration


def test_no_server_errors_for_any_generated_request(tmp_path: Path) -> None:
    with EtcdServer(tmp_path / "etcd") as etcd:
        svc = ServiceProcess(tmp_path, etcd=etcd.endpoint).start()
        try:
            schema = schemathesis.openapi.from_url(f"{svc.url}/openapi.json")
            auth = {"Authorization": f"Bearer {svc.token}"}
            seen, calls = [], [0]
            for result in schema.get_all_operations():
                operation: Any = result.ok()  # type: ignore[union-attr]  # a schema error raises here
                seen.append(f"{operation.method.upper()} {operation.path}")

                @given(case=operation.as_strategy())
                @settings(
                    max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None
                )
                def check(case: Any) -> None:
                    response = case.call(headers=auth)
                    calls[0] += 1
                    assert response.status_code < 500, (
                        f"{case.method} {case.formatted_path}: {response.text[:300]}"
                    )

                check()
            assert "POST /v1/jobs" in seen and "GET /v1/jobs/{job_id}/resume" in seen
            assert calls[0] >= 5 * len(seen)  # the run really sent requests
        finally:
            svc.stop()
