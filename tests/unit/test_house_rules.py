"""The house rules that the code's shape must keep (ARCHITECTURE.md), checked on the source:
``worker`` never imports ``service``; each part of ``service`` imports only the parts below it,
and of ``worker`` only the torch-free modules listed; each part of ``worker`` imports only the
parts its row lists, and no module sits at ``worker``'s top level outside the entry point and
the shared modules; no module of the project imports itself through others (no import cycle);
the control plane reaches no torch when it is imported (only the rendezvous plugin, which runs
inside torchrun agents, does); and the guard of tests/unit (conftest.py) trips on a socket or a
process."""

from __future__ import annotations

import ast
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.conftest import HouseRuleViolation

ROOT = Path(__file__).resolve().parents[2]

# Which part of the control plane may import which (besides itself, ``worker``'s torch-free
# modules and the package root): ARCHITECTURE.md's table.
_STATE = {"service.etcd", "service.jobs"}
_API = _STATE | {"service.launch", "service.checkpoints", "service.metrics", "service.settings"}
MAY_IMPORT: dict[str, set[str]] = {
    "service.settings": set(),
    "service.ports": set(),
    "service.etcd": {"service.ports"},
    "service.rendezvous": {"service.etcd"},
    "service.jobs": {"service.etcd"},
    "service.launch": {"service.rendezvous", "service.jobs"},
    "service.metrics": _STATE,
    "service.report": {"service.jobs"},
    "service.checkpoints": _STATE | {"service.metrics"},
    "service.reconciler": _STATE | {"service.launch", "service.checkpoints", "service.metrics"},
    "service.api": _API,
    "service.server": _API | {"service.reconciler", "service.api"},
    "service.cli": {"service.jobs", "service.report", "service.settings", "service.server"},
    "service.__main__": {"service.cli"},
}
# The torch-free modules of ``worker`` that the control plane may import (ARCHITECTURE.md).
WORKER_FOR_SERVICE = {
    "worker.errors",
    "worker.etcdclient",
    "worker.failpoints",
    "worker.jobspec.jsonlimits",
    "worker.jobspec.spec",
    "worker.jobspec.recovery",
    "worker.jobspec.paths",
    "worker.jobspec.location",
    "worker.start.threads",
    "worker.report.bucket_events",
    "worker.checkpoint.commit",
    "worker.checkpoint.credentials",
    "worker.checkpoint.export",
    "worker.checkpoint.final",
    "worker.checkpoint.layout",
    "worker.checkpoint.loadplan",
    "worker.checkpoint.manifest",
    "worker.checkpoint.offline",
    "worker.checkpoint.owner",
    "worker.checkpoint.places",
    "worker.checkpoint.publish",
    "worker.checkpoint.remote",
    "worker.checkpoint.retention",
    "worker.checkpoint.storage",
    "worker.checkpoint.verify",
}
# worker's top level: the entry point, what both run modes share, and the torch-free modules the
# control plane shares; every other module lives in its part (ARCHITECTURE.md).
WORKER_TOP = {
    "worker.__main__",
    "worker.main",
    "worker.wiring",
    "worker.errors",
    "worker.failpoints",
    "worker.etcdclient",
}
# Which part of the worker imports which at run time (besides itself and ``worker.errors``; type
# hints aside): ARCHITECTURE.md's table. A module at worker/'s top level is a part of its own.
_BELOW = {"worker.jobspec", "worker.failpoints", "worker.checkpoint"}
WORKER_MAY_IMPORT: dict[str, set[str]] = {
    "worker.errors": set(),
    "worker.jobspec": set(),
    "worker.etcdclient": set(),
    "worker.metrics": set(),
    "worker.failpoints": {"worker.start"},  # the lifeline's nap in a sleeping failpoint
    "worker.checkpoint": {"worker.jobspec", "worker.failpoints"},
    "worker.report": {"worker.jobspec", "worker.checkpoint"},
    "worker.datapath": _BELOW | {"worker.start", "worker.train"},
    "worker.start": _BELOW | {"worker.datapath", "worker.train"},
    "worker.train": _BELOW | {"worker.datapath", "worker.start", "worker.metrics", "worker.report"},
    "worker.recovery": _BELOW | {"worker.start", "worker.etcdclient"},
    "worker.wiring": {"worker.checkpoint", "worker.report", "worker.start", "worker.train"},
    "worker.peer": _BELOW
    | {"worker.datapath", "worker.start", "worker.train", "worker.metrics", "worker.report"}
    | {"worker.recovery", "worker.wiring"},
    "worker.main": _BELOW
    | {"worker.start", "worker.train", "worker.metrics", "worker.report", "worker.peer", "worker.wiring"}
    | {"worker.recovery"},  # what a broken group's failure means (recovery.failure, pure)
    "worker.__main__": {"worker.main", "worker.start", "worker.wiring"},
}
# The project's code, whose modules may not import one another in a cycle.
PACKAGES = ("service", "worker", "scripts", "benchmarks")
# The torchrun rendezvous plugin: runs inside torchrun agents, imports torch.
TORCH_ALLOWED = {"service.rendezvous.handler", "service.rendezvous.store"}


def modules(package: str) -> Iterator[tuple[str, Path]]:
    for path in sorted((ROOT / package).rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        yield name.removesuffix(".__init__"), path


def imported(path: Path, *, top_level_only: bool = False, skip_type_checking: bool = False) -> set[str]:
    """The absolute module names ``path`` imports (at import time only, with
    ``top_level_only``: not inside functions, nor under ``if TYPE_CHECKING``; at run time, with
    ``skip_type_checking``: not under ``if TYPE_CHECKING``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    if top_level_only:
        nodes = _top_level(tree.body)
    elif skip_type_checking:
        nodes = list(ast.walk(_without_type_checking(tree)))
    else:
        nodes = list(ast.walk(tree))
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out |= {f"{node.module}.{alias.name}" for alias in node.names}
    return out


def _without_type_checking(tree: ast.Module) -> ast.AST:
    class Drop(ast.NodeTransformer):
        def visit_If(self, node: ast.If) -> ast.AST | list[ast.stmt]:
            if "TYPE_CHECKING" in ast.unparse(node.test):
                return node.orelse
            self.generic_visit(node)
            return node

    return Drop().visit(tree)


def _top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    out: list[ast.stmt] = []
    for stmt in body:
        if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test):
            continue
        if isinstance(stmt, (ast.If, ast.Try, ast.With)):
            inner = [*stmt.body, *getattr(stmt, "orelse", []), *getattr(stmt, "finalbody", [])]
            for handler in getattr(stmt, "handlers", []):
                inner += handler.body
            out += _top_level(inner)
        else:
            out.append(stmt)
    return out


def part(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def test_worker_never_imports_service() -> None:
    offenders = [
        f"{name} imports {target}"
        for name, path in modules("worker")
        for target in imported(path)
        if target == "service" or target.startswith("service.")
    ]
    assert not offenders, "worker must not import service:\n" + "\n".join(offenders)


def test_each_part_of_the_control_plane_imports_only_the_parts_below_it() -> None:
    offenders = []
    for name, path in modules("service"):
        mine = part(name)
        if mine == "service":
            continue
        assert mine in MAY_IMPORT, f"{mine} is a new part: add it to ARCHITECTURE.md and MAY_IMPORT"
        for target in imported(path):
            theirs = part(target)
            if theirs.startswith("service.") and theirs != mine and theirs not in MAY_IMPORT[mine]:
                offenders.append(f"{name} imports {target}")
    assert not offenders, "imports against ARCHITECTURE.md:\n" + "\n".join(offenders)


def test_each_part_of_the_worker_imports_only_what_its_row_says() -> None:
    known = {name for name, _ in modules("worker")}
    offenders = []
    for name, path in modules("worker"):
        mine = part(name)
        if mine == "worker":
            continue
        assert mine in WORKER_MAY_IMPORT, (
            f"{mine} is a new part: add it to ARCHITECTURE.md and WORKER_MAY_IMPORT"
        )
        for target in imported(path, skip_type_checking=True):
            theirs = part(_module_of(target, known))
            if (
                theirs.startswith("worker.")
                and theirs not in {mine, "worker.errors"} | WORKER_MAY_IMPORT[mine]
            ):
                offenders.append(f"{name} imports {target}")
    assert not offenders, "imports against ARCHITECTURE.md:\n" + "\n".join(sorted(set(offenders)))


def test_every_module_of_worker_lives_in_its_part() -> None:
    loose = sorted(
        name
        for name, path in modules("worker")
        if name.count(".") == 1 and path.name != "__init__.py" and name not in WORKER_TOP
    )
    assert not loose, f"modules at worker/'s top level: put each in its part (ARCHITECTURE.md): {loose}"


def test_the_control_plane_imports_only_the_listed_modules_of_worker() -> None:
    offenders = sorted(
        {
            f"{name} imports {_module_of(target, _WORKER)}"
            for name, path in modules("service")
            for target in imported(path)
            if target.startswith("worker") and _module_of(target, _WORKER) not in WORKER_FOR_SERVICE
        }
    )
    assert not offenders, (
        "the control plane imports a module of worker that ARCHITECTURE.md does not list "
        "(add it to WORKER_FOR_SERVICE and the text if it is torch-free):\n" + "\n".join(offenders)
    )


_WORKER = {name for name, _ in modules("worker")}


def _module_of(target: str, known: set[str]) -> str:
    """The module an import names: ``a.b.c`` for ``from a.b import c`` when ``a.b.c`` is a module,
    else ``a.b``."""
    return target if target in known else target.rpartition(".")[0]


def test_no_module_imports_itself_through_others() -> None:
    """Imports at run time (at the top or inside a function; not ``if TYPE_CHECKING``) form no
    cycle among the project's modules: a cycle makes the order of imports matter and ties the
    modules on it into one."""
    sources = {name: path for package in PACKAGES for name, path in modules(package)}
    graph = {
        name: {_module_of(t, set(sources)) for t in imported(path, skip_type_checking=True)} & set(sources)
        for name, path in sources.items()
    }
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of ``graph`` with more than one node
    (or a node that imports itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node] - {node}):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(_path_within(graph, sorted(component)))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _path_within(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A cycle from the component's first module back to it, for the message."""
    members, start = set(component), component[0]
    paths = {start: [start]}
    todo = [start]
    while todo:
        node = todo.pop(0)
        for nxt in sorted(graph[node] & members):
            if nxt == start:
                return [*paths[node], start]
            if nxt not in paths:
                paths[nxt] = [*paths[node], nxt]
                todo.append(nxt)
    return component


def test_the_control_plane_reaches_no_torch_when_imported() -> None:
    """Every service module but the rendezvous plugin, followed through the project's own
    modules it imports at import time: torch is never among them (the service image has none)."""
    sources = {name: path for package in ("service", "worker") for name, path in modules(package)}
    for start in sorted(n for n in sources if n.startswith("service") and n not in TORCH_ALLOWED):
        seen, todo = {start}, [start]
        while todo:
            current = todo.pop()
            for target in imported(sources[current], top_level_only=True):
                assert target.split(".")[0] != "torch", f"{start} imports torch (through {current})"
                for module in _self_and_parents(target):
                    if module in sources and module not in seen:
                        seen.add(module)
                        todo.append(module)


def _self_and_parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def test_the_unit_guard_trips_on_a_socket_and_a_process(no_sockets_no_processes: list[str]) -> None:
    with socket.socket() as sock, pytest.raises(HouseRuleViolation, match=r"socket\.bind"):
        sock.bind(("127.0.0.1", 0))
    with pytest.raises(HouseRuleViolation, match=r"subprocess\.Popen"):
        subprocess.run(["true"], check=False)
    with pytest.raises(HouseRuleViolation, match=r"os\.fork"):
        os.fork()
    assert len(no_sockets_no_processes) == 3
    no_sockets_no_processes.clear()  # tripped on purpose: this test passes
