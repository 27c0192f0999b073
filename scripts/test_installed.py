"""Run part of the test suite against the installed distribution (``make test-installed``).

``python -m scripts.test_installed [pytest args]``; ``python -m scripts.test_installed --rest``
prints the pytest arguments of everything else (``make test`` runs that from the tree, then this:
each test runs once).

What users install is a wheel, not this checkout: a module missing from the wheel, a broken
``[project.scripts]`` or ``torchrun.handlers`` entry point, or code that finds its files
relative to the checkout would pass every test run from the tree. So:

1. build a wheel of this tree (``pip wheel --no-deps .``, in pip's build isolation, as
   ``pip install .`` does);
2. make a venv (``build/installed/venv``) that reuses ``.venv``'s packages through one ``.pth``
   line per site directory of ``.venv``. A ``.pth`` file inside a directory that a ``.pth``
   added is not processed, so ``.venv``'s editable finder (which maps ``service`` and
   ``worker`` onto this tree) is not active there: ``import service`` finds the installed copy;
3. install the wheel there (``--no-deps``, not editable) and check that ``service``, ``worker``,
   the ``elastrain`` console script and the ``etcd-v3`` entry point come from it;
4. copy ``tests/`` (with ``scripts/``, ``benchmarks/``, ``deploy/``, ``docs/``, ``README.md`` and
   ``pyproject.toml``, which tests read) into a temporary directory with no ``service/`` or
   ``worker/`` beside it, and run :data:`SUBSET` there with the venv's interpreter and no
   ``PYTHONPATH``.

The subset is what depends on packaging: every unit test but those that read the source tree
itself (:data:`SOURCE_TESTS`), the rendezvous through the entry point the wheel declares, TorchX
launching nodes from the installed package, one torchrun worker run, and one job under the
installed ``elastrain serve``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "build" / "installed"
COPIED = ("tests", "scripts", "benchmarks", "deploy", "docs", "README.md", "pyproject.toml")
# Unit tests whose subject is the source tree (they read service/ and worker/ as files).
SOURCE_TESTS = (
    "tests/unit/test_house_rules.py",
    "tests/unit/checkpoint/test_structure.py",
    "tests/unit/test_shipped_words.py",
)
SUBSET = (
    "tests/unit",
    "tests/integration/rendezvous/test_etcd_v3_rendezvous.py::"
    "test_two_agents_form_a_world_and_a_killed_worker_restarts_the_group_once",
    "tests/integration/rendezvous/test_scheduler_local.py",
    "tests/integration/worker/test_worker_runs.py::test_fp16_non_finite_on_one_rank_skips_the_step_on_all_ranks",
    "tests/integration/worker/test_service_e2e.py::test_cli_talks_to_the_service",
)


def rest(tests: Path) -> list[str]:
    """pytest arguments for the suite minus :data:`SUBSET` (which runs installed): every top-level
    directory of ``tests`` but ``unit`` and ``gpu`` (``make test-gpu``, on a machine with a GPU),
    the unit tests that read the source tree, and the integration tests of the subset
    deselected. Reads only the directory listing."""
    tops = sorted(
        f"tests/{d.name}"
        for d in tests.iterdir()
        if d.is_dir() and d.name not in ("unit", "gpu", "__pycache__")
    )
    integration = [f"--deselect={node}" for node in SUBSET if not node.startswith("tests/unit")]
    return [*tops, *SOURCE_TESTS, *integration]


CHECK = """
import json, sys, sysconfig
from importlib.metadata import distribution, entry_points
import service, worker
dist = distribution("elastrain")
print(json.dumps({
    "purelib": sysconfig.get_paths()["purelib"],
    "service": service.__file__,
    "worker": worker.__file__,
    "dist": str(dist.locate_file("")),
    "editable": dist.read_text("direct_url.json"),
    "handlers": [ep.value for ep in entry_points(group="torchrun.handlers") if ep.name == "etcd-v3"],
    "scripts": [ep.value for ep in entry_points(group="console_scripts") if ep.name == "elastrain"],
}))
"""


class InstallError(RuntimeError):
    """The distribution could not be built or installed, or is not what was installed."""


def run(cmd: list[str], *, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    print("+ " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, text=True, capture_output=True, check=False, cwd=cwd)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-4000:]
        raise InstallError(f"{' '.join(cmd)}: exit {proc.returncode}\n{tail}")
    return proc


def site_dirs() -> list[str]:
    """This interpreter's site directories, as its own ``.pth`` files left them."""
    return [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]


def build_wheel() -> Path:
    # setuptools builds in build/lib (and build/bdist.*) of the tree and never empties them: a
    # module deleted from the tree would still ship from there.
    for scratch in [REPO / "build" / "lib", *(REPO / "build").glob("bdist.*")]:
        shutil.rmtree(scratch, ignore_errors=True)
    run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(OUT / "wheel"), str(REPO)])
    (wheel,) = (OUT / "wheel").glob("elastrain-*.whl")
    return wheel


def make_venv() -> Path:
    venv = OUT / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    purelib = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    (Path(purelib.stdout.strip()) / "zz-dot-venv.pth").write_text("\n".join(site_dirs()) + "\n")
    return python


def install(python: Path, wheel: Path) -> dict[str, object]:
    run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--ignore-installed",
         str(wheel)])  # fmt: skip
    checked = run([str(python), "-c", CHECK], cwd=Path(tempfile.gettempdir()))
    found: dict[str, object] = json.loads(checked.stdout)
    purelib = str(found["purelib"])
    for key in ("service", "worker", "dist"):
        if not str(found[key]).startswith(purelib):
            raise InstallError(f"{key} comes from {found[key]}, not from the installed wheel in {purelib}")
    if found["editable"] is not None and '"editable": true' in str(found["editable"]):
        raise InstallError(f"the elastrain found is an editable install: {found['editable']}")
    if found["handlers"] != ["service.rendezvous:create_handler"]:
        raise InstallError(f"the wheel declares torchrun.handlers etcd-v3 = {found['handlers']}")
    if not (python.parent / "elastrain").exists() or not found["scripts"]:
        raise InstallError("the wheel installed no elastrain console script")
    return found


def copy_tree(into: Path) -> None:
    for name in COPIED:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, into / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, into / name)
    for name in ("service", "worker"):
        assert not (into / name).exists()


def main(argv: list[str]) -> int:
    if argv == ["--rest"]:
        print(" ".join(rest(REPO / "tests")))
        return 0
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    try:
        python = make_venv()
        found = install(python, build_wheel())
    except InstallError as exc:
        print(f"test-installed: {exc}", file=sys.stderr)
        return 1
    print(f"installed: service from {found['service']}", flush=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{python.parent}{os.pathsep}{env.get('PATH', '')}"
    with tempfile.TemporaryDirectory(prefix="elastrain-installed-") as tmp:
        tree = Path(tmp)
        copy_tree(tree)
        ignore = [f"--ignore={path}" for path in SOURCE_TESTS]
        cmd = [str(python), "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *ignore, *SUBSET, *argv]
        print("+ (in a copy of tests/) " + " ".join(cmd), flush=True)
        return subprocess.run(cmd, cwd=tree, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
