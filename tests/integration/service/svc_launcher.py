"""Run ``elastrain serve`` with a file-backed fake scheduler (a separate process, so tests can
``kill -9`` it). The scheduler keeps everything in ``--nodes-dir``: ``<launch id>.json`` per
launch (with the environment a node would get; written whole or not at all, so a kill -9 of
the service mid-launch never leaves a half-recorded launch: the record IS the launch), and
the status a test sets in ``<launch id>.status`` (running until then; with the time its agent
ended, as ``node_exec`` records it)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from service.launch.apps import node_env
from service.launch.protocol import NodeLaunch, NodeStatus
from service.server import serve
from service.settings import load_settings


class FileScheduler:
    """The whole :class:`service.launch.protocol.Scheduler` protocol, on files."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)

    def launch(self, node: NodeLaunch) -> str:
        record = self.dir / f"{node.launch_id}.json"
        if not record.exists():  # idempotent per launch id
            # the environment a real node would get (who it is, and what the service told it)
            launched = {"job": node.job_id, "node": node.node_index, "env": node_env(node)}
            tmp = self.dir / f".{node.launch_id}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(launched))
            try:
                os.link(tmp, record)  # appears complete, once
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
        return f"file://{node.launch_id}"

    def status(self, handle: str) -> NodeStatus:
        launch_id = handle.removeprefix("file://")
        if not (self.dir / f"{launch_id}.json").exists():
            return NodeStatus("unknown")
        try:
            raw = json.loads((self.dir / f"{launch_id}.status").read_text())
        except (OSError, ValueError):
            return NodeStatus("running")
        return NodeStatus(raw["state"], raw.get("exit_code"), ended_at=raw.get("ended_at"))

    def cancel(self, handle: str) -> None:
        launch_id = handle.removeprefix("file://")
        if self.status(handle).state == "running":
            (self.dir / f"{launch_id}.status").write_text(json.dumps({"state": "failed", "exit_code": -15}))
        with (self.dir / "cancels.log").open("a") as log:
            log.write(launch_id + "\n")

    def log_dir(self, handle: str) -> Path | None:
        return None  # nothing runs, nothing logs

    def close(self) -> None:
        with (self.dir / "closed.log").open("a") as log:
            log.write("closed\n")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--etcd", default="")
    parser.add_argument("--nodes-dir", required=True)
    args = parser.parse_args()
    settings = load_settings(
        port=args.port,
        data_dir=args.data_dir,
        etcd=args.etcd,
        reconcile_interval_s=0.2,
        leader_ttl_s=3,
        local_slots=None
        if "ELASTRAIN_LOCAL_SLOTS" in os.environ
        else 65536,  # nothing runs: no slot is used up
    )
    return serve(settings, scheduler=FileScheduler(Path(args.nodes_dir)))


if __name__ == "__main__":
    sys.exit(main())
