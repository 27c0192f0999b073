"""Bad-input rows (what tests/integration/service does not already cover).

* Hypothesis over ``checkpoint.dir`` / ``checkpoint.resume`` built from traversal pieces (``..``,
  encoded dots, absolute paths, a symlink out of the storage root, NUL): every form that would
  leave the root is a 422; anything accepted resolves inside the root.
* A 10 MB body (declared and chunked) is a 413 and the service's memory stays bounded; a deeply
  nested document and huge lists are a 4xx, never a 5xx.
* A crafted checkpoint whose manifest or shard is a pickle payload (``__reduce__`` calling
  ``os.system``) or whose manifest names a factory is refused by ``checkpoint verify``/``inspect``
  and by the worker's resume, which falls back to the previous checkpoint -- and the payload's
  marker file is never created.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from svc_process import ServiceProcess, job_spec

from service.etcd.server import EtcdServer
from tests.faults.conftest import Reference
from tests.integration.launch import REPO, run_worker, write_spec
from tests.integration.worker.test_resume import spec
from tests.seeds import seeded

pytestmark = [pytest.mark.faults, pytest.mark.integration]
SPEC: dict[str, Any] = job_spec("badinput", "1")
PIECES = ["..", ".", "%2e%2e", "%2E.", ".%2e", "..%2f", "a", "b", "~", "out-link", "..\\..", "\x00", "a\x00b"]


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    workdir = tmp_path_factory.mktemp("svc")
    with EtcdServer(workdir / "etcd") as etcd:
        proc = ServiceProcess(workdir, etcd=etcd.endpoint).start()
        root = proc.data_dir / "checkpoints"
        root.mkdir(exist_ok=True)
        (root / "out-link").symlink_to(workdir)  # a symlink inside the root that leads out of it
        try:
            yield proc
        finally:
            proc.stop()


def must_refuse(given: str, root: Path, base: Path) -> bool:
    """The oracle: NUL, a '..' component, or a real path outside the root."""
    if "\x00" in given or ".." in given.split("/"):
        return True
    real = os.path.realpath(given if given.startswith("/") else base / given)
    real_root = os.path.realpath(root)
    return os.path.commonpath([real, real_root]) != real_root or real == real_root


paths = st.builds(
    lambda absolute, parts: ("/" if absolute else "") + "/".join(parts),
    st.booleans(),
    st.lists(st.sampled_from(PIECES), min_size=1, max_size=5),
)


@seeded
def test_traversal_paths_are_422(svc: ServiceProcess, seed: int) -> None:
    root = svc.data_dir / "checkpoints"
    auth = {"Authorization": f"Bearer {svc.token}"}

    @given(path=paths, field=st.sampled_from(["dir", "resume"]), prefix_root=st.booleans())
    @settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def check(path: str, field: str, prefix_root: bool) -> None:
        given_path = (str(root) + "/" + path.lstrip("/")) if prefix_root else path
        body = SPEC | {"checkpoint": {field: given_path}}
        resp = httpx.post(f"{svc.url}/v1/jobs", json=body, headers=auth, timeout=30)
        base = root / "JOB" if field == "resume" else root
        what = f"seed={seed} {field}={given_path!r}: {resp.status_code} {resp.text[:200]}"
        if must_refuse(given_path, root, base):
            assert resp.status_code == 422, what
        else:
            assert resp.status_code in (201, 422), what
            if resp.status_code == 201 and field == "dir":
                where = os.path.realpath(resp.json()["checkpoint_dir"])
                assert where.startswith(os.path.realpath(root) + "/"), what

    hypothesis_seed(seed)(check)()


def rss_kib(pid: int) -> int:
    for line in (Path("/proc") / str(pid) / "status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def send_chunked(base: str, path: str, data: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    """POST ``data`` with ``Transfer-Encoding: chunked`` (no length: the server must count) on a
    raw socket, stop sending when the server closes its side (it may answer before the body
    ends), then read what it answered: (status, body). A reset with no answer fails the test."""
    url = urlsplit(base)
    with socket.create_connection((url.hostname, url.port), timeout=60) as sock:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\n{head}".encode())
        sock.sendall(b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
        try:
            for i in range(0, len(data), 65536):
                piece = data[i : i + 65536]
                sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before the body ended: read its answer
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except ConnectionResetError:
            pass
    assert answer.startswith(b"HTTP/1.1 "), f"no HTTP answer to a chunked 10 MB body: {answer[:200]!r}"
    status = int(answer.split(b" ", 2)[1])
    return status, answer.split(b"\r\n\r\n", 1)[-1]


@seeded
def test_large_and_deep_bodies_are_refused(svc: ServiceProcess, seed: int) -> None:
    assert svc.proc is not None
    auth = {"Authorization": f"Bearer {svc.token}", "Content-Type": "application/json"}
    url = f"{svc.url}/v1/jobs"
    ten_mb = b'{"name": "' + b"x" * (10 << 20) + b'"}'
    before = rss_kib(svc.proc.pid)
    for _ in range(3):
        assert httpx.post(url, content=ten_mb, headers=auth, timeout=60).status_code == 413
        status, body = send_chunked(svc.url, "/v1/jobs", ten_mb, auth)
        assert status == 413 and json.loads(body)["error"]["code"] == "body_too_large", (status, body[:300])
    grown = rss_kib(svc.proc.pid) - before
    assert grown < 64 << 10, f"seed={seed}: the service grew by {grown} KiB on refused bodies"
    depth = random.Random(seed).randrange(5_000, 200_000)
    cases = {
        "nested list": b"[" * depth + b"]" * depth,
        "nested object": b'{"a":' * depth + b"1" + b"}" * depth,
        "nested in spec": json.dumps(SPEC)[:-1].encode()
        + b', "model": '
        + b'{"a":' * depth
        + b"1"
        + b"}" * depth
        + b"}",
        "huge list": json.dumps(SPEC | {"optimizer": {"betas": [0.9] * 100_000}}).encode(),
        "huge top list": json.dumps(list(range(100_000))).encode(),
    }
    answers = {name: httpx.post(url, content=body, headers=auth, timeout=60) for name, body in cases.items()}
    wrong = {
        n: f"{r.status_code} {r.text[:120]}"
        for n, r in answers.items()
        if r.status_code not in (400, 413, 422)
    }
    assert not wrong, f"seed={seed} depth={depth}: {wrong}"
    assert httpx.get(f"{svc.url}/readyz", timeout=10).status_code == 200


class Payload:
    """Unpickling this runs ``touch MARKER``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def craft(step_dir: Path, how: str, marker: Path) -> None:
    manifest = step_dir / "manifest.json"
    bomb = pickle.dumps(Payload(marker))
    if how == "pickle-manifest":
        manifest.write_bytes(bomb)
    elif how == "factory-manifest":
        data = json.loads(manifest.read_text())
        data["py/reduce"] = [{"py/function": "os.system"}, {"py/tuple": [f"touch {marker}"]}]
        data["__class__"] = "subprocess.Popen"
        data["!!python/object/apply:os.system"] = [f"touch {marker}"]
        manifest.write_text(json.dumps(data))
    elif how == "pickle-shard":
        shard = sorted(step_dir.glob("*.bin"))[0]
        shard.write_bytes(bomb + b"\0" * max(0, shard.stat().st_size - len(bomb)))
    else:  # torch-save-shard: a torch.save zip whose data.pkl is the payload
        import torch

        shard = sorted(step_dir.glob("*.bin"))[0]
        torch.save(Payload(marker), shard, _use_new_zipfile_serialization=True)


@seeded
def test_crafted_checkpoint_never_executes_code(tmp_path: Path, reference: Reference, seed: int) -> None:
    how = random.Random(seed).choice(
        ["pickle-manifest", "factory-manifest", "pickle-shard", "torch-save-shard"]
    )
    marker = tmp_path / "PWNED"
    ck = tmp_path / "ck"
    shutil.copytree(Path(reference.run.last("checkpoint_published")["path"]).parent, ck)
    craft(ck / "step-00000030", how, marker)
    what = f"seed={seed} {how}"
    for command in ("verify", "inspect", "digest"):
        cli = subprocess.run(
            [sys.executable, "-m", "service", "checkpoint", command, str(ck / "step-00000030")],
            capture_output=True, text=True, cwd=REPO,
        )  # fmt: skip
        assert (cli.returncode != 0 or command != "verify") and "Traceback" not in cli.stderr, (
            f"{what} {command}: {cli.stderr[-1500:]}"
        )
        assert not marker.exists(), f"{what}: checkpoint {command} executed the payload"
    run = run_worker(write_spec(tmp_path, spec(ck)), nproc=2)
    assert run.code == 0, f"{what}: {run.stderr[-3000:]}"
    assert not marker.exists(), f"{what}: resume executed the payload"
    refused = run.all("checkpoint_refused")
    assert refused and "step-00000030" in refused[0]["path"], what
    assert run.last("resumed")["step"] == 20, what
    assert run.last("finished")["params_digest"] == reference.digest, what


def test_a_dataset_too_large_for_memory_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """data.samples 5e7 with the default MLP must not die in numpy's _ArrayMemoryError (a
    traceback, exit 1). The largest size the spec allows never fits in memory here. (The same
    check refuses ``data.eval_samples``: tests/unit/worker/test_sizing.py.)"""
    body = spec(tmp_path / "ck") | {"data": {"name": "synthetic", "samples": 10**10}}
    run = run_worker(write_spec(tmp_path, body), timeout=120)
    assert run.code == 2, run.stderr[-3000:]
    assert "field 'data.samples'" in run.stderr and "GiB" in run.stderr, run.stderr[-3000:]
    assert "Traceback" not in run.stderr
