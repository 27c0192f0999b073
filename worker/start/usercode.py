"""A team's code, found by ``package.module:function`` (model, data and loss factories), and the
line a failure to find it gives: what was looked for, where, and the fix.

Three failures are told apart: no such module where the worker looks (the places a team's code
lives are named: the working directory, which ``python -m`` and ``torchrun -m`` put first on the
import path, and ``PYTHONPATH``, which under the service is the job's ``env.PYTHONPATH``, with
the names there that come close); the module found but its own import failing (its error and the
line); the module without that callable (the callables it defines). The lines are composed by
pure functions of plain values (the import path, the environment, the working directory).
"""

from __future__ import annotations

import difflib
import importlib
import os
import pkgutil
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

from worker.errors import SpecError

_SHOWN = 12  # names listed at most


def load_factory(path: str, field: str) -> Callable[..., Any]:
    """Import ``package.module:function``; a failure is one SpecError naming ``field``, what was
    looked for, where, and the fix."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not _is_part_of(exc.name, module_name):
            raise SpecError(failed_inside(field, module_name, exc)) from None
        raise SpecError(_not_found(field, path, exc.name)) from None
    except Exception as exc:  # the module's own code (or what it imports) failed
        raise SpecError(failed_inside(field, module_name, exc)) from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise SpecError(no_callable(field, module, attr))
    return factory


def _is_part_of(missing: str, module_name: str) -> bool:
    """Whether the module not found is ``module_name`` or one of its packages."""
    return module_name == missing or module_name.startswith(missing + ".")


def _not_found(field: str, path: str, missing: str) -> str:
    """:func:`not_found` for this process: its import path, environment and working directory."""
    package = missing.rpartition(".")[0]
    module = sys.modules.get(package) if package else None
    where = places(sys.path, os.environ, os.getcwd())
    parent = None
    if module is not None:
        dirs = getattr(module, "__path__", None)
        parent = (str(getattr(module, "__file__", None) or package), list(dirs) if dirs is not None else None)
    near = nearby_modules(parent[1] or [] if parent is not None else [d for _, d in where])
    return not_found(
        field, path, missing, places=where, near=near, under_service=under_service(os.environ), parent=parent
    )


def under_service(env: Mapping[str, str]) -> bool:
    """Whether the control plane launched this worker (its job id and URL are in the environment)."""
    return bool(env.get("ELASTRAIN_JOB_ID") and env.get("ELASTRAIN_SERVICE_URL"))


def places(sys_path: Sequence[str], env: Mapping[str, str], cwd: str) -> list[tuple[str, str]]:
    """Where a team's code is looked for, as (what the place is, directory): the working
    directory when it is on the import path, then each ``PYTHONPATH`` entry. Pure."""
    out: list[tuple[str, str]] = []
    on_path = {os.path.abspath(p or cwd) for p in sys_path}
    if os.path.abspath(cwd) in on_path:
        out.append(("the working directory", cwd))
    for entry in (env.get("PYTHONPATH") or "").split(os.pathsep):
        if entry and entry not in (d for _, d in out):
            out.append(("PYTHONPATH", entry))
    return out


def nearby_modules(dirs: Sequence[str]) -> list[str]:
    """The module and package names directly in ``dirs`` (no import)."""
    try:
        return sorted({m.name for m in pkgutil.iter_modules(list(dirs))})
    except OSError:
        return []


def not_found(
    field: str,
    path: str,
    missing: str,
    *,
    places: Sequence[tuple[str, str]],
    near: Sequence[str],
    under_service: bool,
    parent: tuple[str, Sequence[str] | None] | None = None,
) -> str:
    """The line for a module that is nowhere the worker looks. ``parent``: (where, its
    directories; None for a module that is no package) when ``missing``'s package was found. Pure."""
    package, _, name = missing.rpartition(".")
    if parent is None:
        listed = [f"{what} {d}" for what, d in places] or ["neither the working directory nor PYTHONPATH"]
        where = f"in {', '.join(listed)}, nor among the installed packages"
    elif parent[1] is None:
        where = f"({package!r} is the module {parent[0]}, not a package)"
    else:
        where = f"in package {package!r} ({', '.join(parent[1])})"
    line = f"field '{field}': no module {missing!r} (for {path!r}) {where}"
    if name == "py" and parent is not None:
        return f"{line}; give the module without .py ({path.replace('.py:', ':')!r})"
    guess = difflib.get_close_matches(name, near, n=1, cutoff=0.6)
    if guess and guess[0] != name:
        line += f" (a close name there: {guess[0]!r})"
    if under_service:
        fix = "set the job's env.PYTHONPATH to the directory holding it, as the nodes see it"
    else:
        fix = "start torchrun in the directory holding it, or put that directory on PYTHONPATH"
    return f"{line}; spell the module as its file is named and {fix}"


def failed_inside(field: str, module_name: str, exc: BaseException) -> str:
    """The line for a module that was found but whose import raised ``exc`` (call it in the
    ``except`` block: it reads the traceback). Pure but for that."""
    where = _where(exc)
    error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
    fix = (
        "install it where the workers run, or fix the import"
        if isinstance(exc, ModuleNotFoundError)
        else "fix the module"
    )
    return (
        f"field '{field}': module {module_name!r} was found, but importing it failed"
        f"{f' at {where}' if where else ''}: {error}; {fix}"
    )


def _where(exc: BaseException) -> str | None:
    """The first line of the team's code the failure went through (the import's own frames left
    out), or a syntax error's line."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{exc.filename}:{exc.lineno}"
    own = (__file__, importlib.__file__ or "")
    for frame in traceback.extract_tb(exc.__traceback__):
        if not frame.filename.startswith("<frozen") and frame.filename not in own:
            return f"{frame.filename}:{frame.lineno}"
    return None


def callables_of(module: ModuleType) -> list[str]:
    """The public functions and classes ``module`` defines (not those it imports)."""
    name = module.__name__
    return sorted(
        n
        for n, v in vars(module).items()
        if not n.startswith("_") and callable(v) and getattr(v, "__module__", None) == name
    )


def no_callable(field: str, module: ModuleType, attr: str) -> str:
    """The line for a module without the callable ``attr``. Pure but for reading the module."""
    origin = getattr(module, "__file__", None)
    label = f"module {module.__name__!r}" + (f" ({origin})" if origin else "")
    value = getattr(module, attr, None)
    if value is not None:
        return f"field '{field}': {attr!r} in {label} is a {type(value).__name__}, not a function or class"
    names = callables_of(module)
    guess = difflib.get_close_matches(attr, names, n=1, cutoff=0.6)
    hint = f" (a close name: {guess[0]!r})" if guess else ""
    shown = ", ".join(names[:_SHOWN]) + (", ..." if len(names) > _SHOWN else "")
    listed = f"; it defines {shown}" if names else "; it defines no function or class"
    return f"field '{field}': {label} has no callable {attr!r}{hint}{listed}"
