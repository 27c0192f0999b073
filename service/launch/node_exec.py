"""``python -m service.launch.node_exec --state-dir DIR -- CMD...``: run one local node, leave a record.

The ``local_cwd`` scheduler starts every node through this wrapper so that a node's fate can
be read from disk by any process, including a restarted service that no longer holds the
TorchX handle: ``DIR/node.json`` (written once the command is running: wrapper pid, process
group, command pid) and ``DIR/exit.json`` (written when the command ends: its exit code,
``128 + signal`` if a signal killed it). Both are replaced atomically.

The command's environment is :func:`service.launch.environment.node_environment` of the
wrapper's: the names given with ``--env`` (what the service set for the node) and the allowed
variables of the machine's; nothing else of the service's environment reaches the node.

The wrapper runs the command in its own process group (TorchX gave it a new session) and is
the node's first process, as a container's entry point is on Kubernetes: a SIGTERM, SIGINT or
SIGHUP sent to it is passed on to the command once (a kubelet signals only the first process;
torchrun forwards it to its workers, which stop gracefully: :mod:`worker.train.preemption`), and the
wrapper records how the command ended. A cancel signals the wrapper the same way. Torch-free.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

from service.launch.environment import node_environment

NODE_FILE = "node.json"
EXIT_FILE = "exit.json"


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as out:
        json.dump(data, out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


def exit_status(returncode: int) -> int:
    """A Popen return code as a shell would report it (``-9`` -> ``137``)."""
    return returncode if returncode >= 0 else 128 - returncode


class _Forward:
    """The wrapper's handler: pass each signal on to the command, then wait for it to end."""

    def __init__(self, child_pid: int) -> None:
        self.child_pid = child_pid

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        with contextlib.suppress(ProcessLookupError):  # it has ended; the wait reaps it
            os.kill(self.child_pid, signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.launch.node_exec")
    parser.add_argument("--state-dir", required=True, type=Path)
    parser.add_argument("--env", default="", help="comma-separated names the node was given")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    state: Path = args.state_dir
    state.mkdir(parents=True, exist_ok=True)
    try:
        env = node_environment(os.environ, [n for n in args.env.split(",") if n])
        child = subprocess.Popen(command, env=env)
    except OSError as exc:
        write_json_atomic(state / EXIT_FILE, {"exit_code": 127, "ended_at": time.time(), "error": str(exc)})
        print(f"node_exec: cannot run {command[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127
    forward = _Forward(child.pid)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    write_json_atomic(
        state / NODE_FILE,
        {"pid": os.getpid(), "pgid": os.getpgid(0), "child_pid": child.pid, "started_at": time.time()},
    )
    code = exit_status(child.wait())
    write_json_atomic(state / EXIT_FILE, {"exit_code": code, "ended_at": time.time()})
    return code


if __name__ == "__main__":
    sys.exit(main())
