"""Starting driver processes (tests/integration/recovery/driver.py) against one etcd, and reading
what they said."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from worker.recovery.etcdkv import connect
from worker.recovery.membership import Membership

REPO = Path(__file__).resolve().parents[3]


class Job:
    """Driver processes of one job id. ``args``: the driver's arguments shared by every process."""

    def __init__(self, workdir: Path, etcd: str, **args: Any) -> None:
        self.workdir = workdir
        self.out = workdir / "out"
        self.out.mkdir(parents=True, exist_ok=True)
        self.args = {"job": f"peer-{uuid.uuid4().hex[:8]}", "secret": uuid.uuid4().hex * 2, "etcd": etcd,
                     "out": str(self.out), "seed": 3, "dataset": 240, "micro_batch": 4, "accum": 2,
                     "chunk_bytes": 1 << 16, **args}  # fmt: skip
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.names: dict[int, str] = {}

    def start(self, name: str, *, role: str = "member", node: int = 0, env: dict[str, str] | None = None,
              **overrides: Any) -> subprocess.Popen[bytes]:  # fmt: skip
        full = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        full.pop("ELASTRAIN_FAILPOINTS", None)
        full.update(env or {})
        full["DRIVER_ARGS"] = json.dumps(
            {**self.args, "role": role, "node": node, "launch": name, **overrides}
        )
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - the child owns it
        cmd = [sys.executable, "-m", "tests.integration.recovery.driver"]
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=full, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        self.procs[proc.pid] = proc
        self.names[proc.pid] = name
        return proc

    def wait_leading(self, proc: subprocess.Popen[bytes]) -> None:
        """Until ``proc`` holds the job's generation record as its leader. The first generation's
        leader is whichever process claims it first, and the order processes reach that point is
        load's choice, not their start order: a test whose faults need a set leader (spares
        connect to the leader; a gate held by it) starts that process alone and waits here."""
        member = Membership(connect(self.args["etcd"]), self.args["job"])

        def leading() -> bool:
            started = self.events("started", proc.pid)
            record, _ = member.generation()
            return bool(started) and record is not None and record.leader == started[0]["member"]

        self.wait_for(f"{self.names[proc.pid]} to lead the first generation", leading)

    def events(self, event: str | None = None, pid: int | None = None) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        for path in sorted(self.out.glob("events-*.jsonl")):
            for line in path.read_text().splitlines():
                if line.strip():
                    with contextlib.suppress(json.JSONDecodeError):  # a line being written
                        rows.append(json.loads(line))
        return [
            r for r in rows if (event is None or r["event"] == event) and (pid is None or r["pid"] == pid)
        ]

    def trace(self) -> list[dict[str, Any]]:
        rows = []
        for path in sorted(self.out.glob("trace-*.jsonl")):
            rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return rows

    def wait_for(self, what: str, check: Callable[[], bool], timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if check():
                return
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}\n{self.logs()}")

    def wait_exit(self, timeout: float = 240.0) -> dict[str, int | None]:
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        codes = {self.names[pid]: proc.poll() for pid, proc in self.procs.items()}
        if any(code is None for code in codes.values()):
            raise AssertionError(f"processes still running: {codes}\n{self.logs()}")
        return codes

    def logs(self) -> str:
        parts = []
        for path in sorted(self.workdir.glob("*.log")):
            parts.append(f"--- {path.name}\n" + path.read_text(errors="replace")[-3000:])
        return "\n".join(parts)

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def finished_digests(self) -> dict[str, str]:
        return {self.names[e["pid"]]: e["digest"] for e in self.events("finished")}


def reference(tmp: Path, etcd: str, cache: dict[tuple[Any, ...], dict[str, Any]], *, world: int,
              **args: Any) -> dict[str, Any]:  # fmt: skip
    """The uninterrupted run's final digest (and layout) at ``world`` members, cached per arguments."""
    key = (world, *sorted(args.items()))
    if key not in cache:
        job = Job(
            tmp / f"reference-{len(cache)}", etcd, world=world, min_world=world, max_world=world, **args
        )
        try:
            for node in range(world):
                job.start(f"ref{node}", node=node)
            codes = job.wait_exit()
            assert set(codes.values()) == {0}, f"{codes}\n{job.logs()}"
        finally:
            job.kill_all()
        finished = job.events("finished")
        assert len({e["digest"] for e in finished}) == 1, finished
        cache[key] = {"digest": finished[0]["digest"], "layout": finished[0]["layout"]}
    return cache[key]


def timeline(job: Job, survivors: list[int]) -> dict[str, float]:
    """Milliseconds from the kill to each phase, for the slowest survivor (printed, not asserted):
    each survivor's first step after the kill, and its last event of each phase before it."""
    killed = min(e["t"] for e in job.events("killed"))
    out: dict[str, list[float]] = {}
    for pid in survivors:
        steps = [e["t"] for e in job.events("first_step", pid) if e["t"] > killed]
        if not steps:
            continue
        first = min(steps)
        out.setdefault("first_step", []).append(first)
        phases = (("detect", "recovery_detected", "failed_at"), ("formed", "group_formed", "at"),
                  ("transferred", "state_transferred", "at"))  # fmt: skip
        for name, event, field in phases:
            times = [e[field] for e in job.events(event, pid) if killed <= e[field] <= first]
            if times:
                out.setdefault(name, []).append(max(times))
    order = ("detect", "formed", "transferred", "first_step")
    return {name: round((max(out[name]) - killed) * 1e3, 1) for name in order if name in out}
