"""The REST API in process for the unit tests (no sockets): the app on a memory store, its API
token, and the smallest valid JobSpec. One place, instead of a copy in every test module."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from tests.specs import raw_spec

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from service.api.app import create_app
from service.etcd.memory import MemoryStore
from service.settings import load_settings

TOKEN = "t" * 32
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SPEC: dict[str, Any] = raw_spec("demo", max_steps=20)


def api(data_dir: Path, store: MemoryStore | None = None, **settings: Any) -> TestClient:
    """A client of a fresh app (use it as a context manager: that runs the app's lifespan). Its
    local scheduler has 64 slots unless ``local_slots`` says otherwise (not this host's cores)."""
    settings.setdefault("local_slots", 64)
    app = create_app(load_settings(data_dir=data_dir, **settings), store or MemoryStore(), api_token=TOKEN)
    return TestClient(app, raise_server_exceptions=False)
