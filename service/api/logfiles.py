"""A node's log files as the logs route serves them: only regular files inside the node's own
directory, opened without following a link.

On one machine job code runs as the service's user and can write into its node's directory;
a link placed there (``ln -s <data-dir>/api-token <node dir>/logs/x.log``) must not make the
service read a file for it. So the node's directory (the parent of its ``logs``), ``logs`` and
every directory below are opened with ``O_NOFOLLOW | O_DIRECTORY`` relative to the one above
(``openat``: nothing on the way can be swapped for a link between a check and the open), and
every file with ``O_NOFOLLOW | O_NONBLOCK`` and kept only when ``fstat`` says it is a regular
file. Anything else is named in a line ``<name>: (not a regular file inside the node's log
directory; not served)`` instead of its content. The walk is bounded (depth and file count).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

MAX_DEPTH = 4
MAX_FILES = 64
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def refused(name: str) -> str:
    return f"{name}: (not a regular file inside the node's log directory; not served)"


def tail_lines(directory: Path | None, count: int) -> list[str]:
    """The last ``count`` lines of the regular files under ``directory`` (a node's ``logs``),
    each prefixed by its path below it; see the module doc for what is not served."""
    if directory is None:
        return []
    try:
        parent = os.open(directory.parent.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return []
    try:
        node = _open_dir(directory.parent.name, parent)
        if node is None:
            return [refused(directory.parent.name)] if _exists(directory.parent.name, parent) else []
        try:
            logs = _open_dir(directory.name, node)
            if logs is None:
                return [refused(directory.name)] if _exists(directory.name, node) else []
            lines: list[str] = []
            budget = [MAX_FILES]
            try:
                _walk(logs, "", count, lines, budget, depth=0)
            finally:
                os.close(logs)
            return lines[-count:]
        finally:
            os.close(node)
    finally:
        os.close(parent)


def _exists(name: str, dir_fd: int) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return False
    return True


def _open_dir(name: str, dir_fd: int) -> int | None:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError:  # ELOOP or ENOTDIR for a link, ENOENT when absent
        return None


def _walk(fd: int, prefix: str, count: int, lines: list[str], budget: list[int], *, depth: int) -> None:
    names = sorted(os.listdir(fd))
    for name in names:
        if budget[0] <= 0:
            return
        budget[0] -= 1
        shown = prefix + name
        try:
            info = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode) and depth < MAX_DEPTH:
            sub = _open_dir(name, fd)
            if sub is None:
                lines.append(refused(shown))
                continue
            try:
                _walk(sub, shown + "/", count, lines, budget, depth=depth + 1)
            finally:
                os.close(sub)
            continue
        text = _tail(name, fd, count)
        if text is None:
            lines.append(refused(shown))
        else:
            lines.extend(f"{shown}: {line}" for line in text)


def _tail(name: str, dir_fd: int, count: int) -> list[str] | None:
    """The last ``count`` lines of the regular file ``name``, None for anything else."""
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        want = min(size, 256 * count)
        data = os.pread(fd, want, size - want)
    except OSError:
        return None
    finally:
        os.close(fd)
    return data.decode("utf-8", errors="replace").splitlines()[-count:]
