"""The Dockerfiles, checked statically (no Docker engine runs here): pinned bases, a non-root user,
the service's health check and command, torch only in the worker image, and the service's
dependency list in step with pyproject.toml."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from scripts.deploy_tools import REPO_ROOT

DOCKER_DIR = REPO_ROOT / "deploy" / "docker"
# In the service image but not (yet) in pyproject's dependencies, with the reason.
SERVICE_ONLY = {
    "kubernetes": "TorchX's kubernetes scheduler imports it (torchx[kubernetes]); the lead is asked "
    "to pin it in pyproject.toml too",
}


@dataclass
class Dockerfile:
    args: dict[str, str] = field(default_factory=dict)
    stages: list[list[tuple[str, str]]] = field(default_factory=list)

    @property
    def final(self) -> list[tuple[str, str]]:
        return self.stages[-1]

    def bases(self) -> list[str]:
        return [self.expand(body.split()[0]) for stage in self.stages for op, body in stage if op == "FROM"]

    def expand(self, text: str) -> str:
        return re.sub(
            r"\$\{(\w+)\}|\$(\w+)", lambda m: self.args.get(m.group(1) or m.group(2), m.group(0)), text
        )

    def last(self, op: str) -> str | None:
        bodies = [body for o, body in self.final if o == op]
        return bodies[-1] if bodies else None


def parse_dockerfile(path: Path) -> Dockerfile:
    """Instructions with continuation lines joined; ARG defaults collected (global and per stage)."""
    text = re.sub(r"\\\n", " ", path.read_text())
    parsed = Dockerfile()
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        op, _, body = line.partition(" ")
        op = op.upper()
        if op == "ARG" and "=" in body:
            name, _, default = body.strip().partition("=")
            parsed.args.setdefault(name, default)
        if op == "FROM":
            parsed.stages.append([])
        if parsed.stages:
            parsed.stages[-1].append((op, body.strip()))
    return parsed


SERVICE = parse_dockerfile(DOCKER_DIR / "service.Dockerfile")
WORKER = parse_dockerfile(DOCKER_DIR / "worker.Dockerfile")


def _pyproject_deps() -> dict[str, Requirement]:
    data = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    return {
        Requirement(r).name.lower().replace("_", "-"): Requirement(r) for r in data["project"]["dependencies"]
    }


def _service_requirements() -> dict[str, Requirement]:
    lines = (DOCKER_DIR / "service-requirements.txt").read_text().splitlines()
    reqs = [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]
    return {r.name.lower().replace("_", "-"): r for r in reqs}


@pytest.mark.parametrize("dockerfile", [SERVICE, WORKER], ids=["service", "worker"])
def test_bases_are_pinned(dockerfile: Dockerfile) -> None:
    internal = {
        body.split()[-1]
        for stage in dockerfile.stages
        for op, body in stage
        if op == "FROM" and " AS " in body.upper()
    }
    for base in dockerfile.bases():
        if base in internal:
            continue
        assert "$" not in base, f"{base}: unresolved build argument"
        image, _, digest = base.partition("@")
        tag = image.rsplit(":", 1)[1] if ":" in image.rsplit("/", 1)[-1] else ""
        pinned = re.fullmatch(r"sha256:[0-9a-f]{64}", digest) or re.match(r"\d+\.\d+\.\d+", tag)
        assert pinned, f"{base}: pin a full version tag (x.y.z...) or a digest, not {tag or 'latest'}"


@pytest.mark.parametrize("dockerfile", [SERVICE, WORKER], ids=["service", "worker"])
def test_runs_as_a_non_root_user(dockerfile: Dockerfile) -> None:
    user = dockerfile.last("USER")
    assert user is not None, "the final stage sets no USER"
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) > 0, f"USER {user}: use a numeric non-zero uid (runAsNonRoot checks it)"
    assert uid == "10001"  # the chart's securityContext.runAsUser; both images share checkpoint files


def test_service_image_health_check_and_command() -> None:
    health = SERVICE.last("HEALTHCHECK")
    assert health is not None and "http://127.0.0.1:8080/healthz" in health
    assert SERVICE.last("ENTRYPOINT") == '["elastrain"]'
    assert SERVICE.last("CMD") == '["serve", "--host", "0.0.0.0", "--port", "8080"]'
    assert any(op == "EXPOSE" and body == "8080" for op, body in SERVICE.final)


def test_service_image_has_no_torch() -> None:
    reqs = _service_requirements()
    assert "torch" not in reqs
    installs = " ".join(body for stage in SERVICE.stages for op, body in stage if op == "RUN")
    assert "pip install --no-deps ." in installs, "the package must not pull torch in through its deps"
    assert "import torch" in installs  # the build fails if torch slipped in anyway


def test_service_requirements_follow_pyproject() -> None:
    project, service = _pyproject_deps(), _service_requirements()
    for name, req in project.items():
        if name == "torch":
            continue
        assert name in service, f"add '{req}' to deploy/docker/service-requirements.txt"
        assert service[name].specifier == req.specifier, (
            f"service-requirements.txt: {service[name]} but pyproject: {req}"
        )
    for name, req in service.items():
        assert name in project or name in SERVICE_ONLY, (
            f"{req} is in the service image but not in pyproject.toml"
        )
        assert str(req.specifier).startswith("=="), f"pin {req} exactly"
    assert "kubernetes" in service["torchx"].extras or "kubernetes" in service


def test_worker_image_torch_matches_pyproject() -> None:
    torch = _pyproject_deps()["torch"]
    assert f"=={WORKER.args['TORCH_VERSION']}" == str(torch.specifier)
    assert WORKER.args["TORCH_INDEX_URL"].endswith("/whl/cpu"), "CPU torch by default"
    assert "BASE_IMAGE" in WORKER.args, "a CUDA base is chosen with --build-arg BASE_IMAGE=..."
    assert WORKER.stages[0][0] == ("FROM", "${BASE_IMAGE}")


@pytest.mark.parametrize("name", ["service", "worker"])
def test_build_context_is_whitelisted(name: str) -> None:
    """BuildKit's per-Dockerfile ignore file keeps .venv, .git and runs out of the context."""
    ignore = (DOCKER_DIR / f"{name}.Dockerfile.dockerignore").read_text().splitlines()
    rules = [line.strip() for line in ignore if line.strip() and not line.startswith("#")]
    assert rules[0] == "*"
    dockerfile = SERVICE if name == "service" else WORKER
    for stage in dockerfile.stages:
        for op, body in stage:
            if op == "COPY" and not body.startswith("--from"):
                for src in body.split()[:-1]:
                    assert f"!{src.rstrip('/').removeprefix('./')}" in {r.rstrip("/") for r in rules}, src


def test_service_modules_import_without_torch() -> None:
    """What the service image runs must import with torch absent. The torchrun rendezvous
    plugin (service.rendezvous.handler and .store) runs inside workers and is exempt; the package
    itself and its config, which the service imports, are not."""
    exempt = ("service.rendezvous.handler", "service.rendezvous.store")
    code = f"""
import importlib, pkgutil, sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is not in the service image")
sys.meta_path.insert(0, NoTorch())
import service
failed = []
for mod in pkgutil.walk_packages(service.__path__, "service."):
    if mod.name.startswith({exempt!r}):
        continue
    try:
        importlib.import_module(mod.name)
    except ImportError as exc:
        failed.append(f"{{mod.name}}: {{exc}}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
