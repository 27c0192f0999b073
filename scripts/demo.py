"""``make run``: the main job on the embedded defaults, end to end.

Starts ``elastrain serve`` (embedded etcd, local TorchX scheduler), submits a small job on 2 of
1..3 nodes, SIGKILLs one worker once a checkpoint is published, shows the recovery, scales the
job to 3 nodes, lets it finish and prints where the checkpoints and the report are. Run from a
terminal, the service then stays up (its URL, metrics and API token file printed) until Ctrl-C;
run without one (CI, a pipe), it stops at once and prints no URL that is about to go away.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from service.ports import free_port

WORKDIR = Path(".elastrain/demo")
SPEC: dict[str, Any] = {
    "name": "demo",
    "model": {"name": "mlp", "kwargs": {"hidden": 64}},
    "data": {"name": "synthetic", "samples": 4096},
    "precision": "fp32",
    "micro_batch_size": 16,
    "grad_accum_steps": 1,
    # Long enough (~30 s here) that the node added by the scale joins a group that is still training:
    # a peer recovery (the default) costs the survivors well under a second, not a restart's seconds.
    "max_steps": 20000,
    "seed": 3,
    "deterministic": True,
    "log_every_steps": 100,
    "checkpoint": {"interval_steps": 1000},
    "nodes": "1:3",
    "initial_nodes": 2,
    "nproc_per_node": 1,
    "max_restarts": 5,
}


def say(text: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {text}", flush=True)


def wait_for(what: str, check: Callable[[], Any], timeout: float = 300.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    raise SystemExit(f"demo: gave up waiting for {what} after {timeout:.0f}s (logs under {WORKDIR})")


def worker_pids(job_id: str = "", *, launch_id: str | None = None) -> list[int]:
    """Worker processes of this job: `-m worker` with ELASTRAIN_JOB_ID set to it, or of one of
    its node apps with ``launch_id`` (ELASTRAIN_LAUNCH_ID); not the torchrun agents (Linux /proc)."""
    tag = f"ELASTRAIN_LAUNCH_ID={launch_id}" if launch_id else f"ELASTRAIN_JOB_ID={job_id}"
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ours = tag.encode() in env and b"--config" in cmd
        if ours and b"worker" in cmd and b"torch.distributed.run" not in b" ".join(cmd):
            found.append(int(entry.name))
    return sorted(found)


def process_env(pid: int) -> dict[str, str]:
    """The environment process ``pid`` started with (Linux /proc)."""
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(p.decode(errors="replace").split("=", 1) for p in pairs if b"=" in p)


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first), None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Running: the process exists and is not a zombie (Linux /proc)."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def parent_pid(pid: int) -> int | None:
    """The parent's pid (Linux /proc), None when the process is gone."""
    fields = _stat(pid)
    return int(fields[1]) if fields is not None else None


_last_shown: list[str] = [""]


def show(job: dict[str, Any]) -> None:
    """A status line, printed only when it changed."""
    line = (
        f"state {job['state']:<10} world size {job['world_size']}  step {job['step']}  "
        f"samples/s {job['samples_per_s'] or 0:,.0f}  loss {job['loss'] or 0:.4f}  "
        f"last checkpoint {job['last_published_step']}  restarts {job['restarts']}"
    )
    if line != _last_shown[0]:
        _last_shown[0] = line
        say(line)


def main() -> int:
    shutil.rmtree(WORKDIR, ignore_errors=True)
    WORKDIR.mkdir(parents=True)
    port, token = free_port(), secrets.token_urlsafe(24)
    url = f"http://127.0.0.1:{port}"
    token_file = WORKDIR / "api-token"  # where `elastrain serve` reads it; never printed
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(token + "\n")
    # Room for the scale to 3 one-process nodes on any machine (the default is one slot per core;
    # the service then gives each worker its share of the cores).
    env = os.environ | {"ELASTRAIN_LOCAL_SLOTS": "3"}
    log = (WORKDIR / "service.log").open("w")
    say(f"starting elastrain serve on {url} (embedded etcd, data dir {WORKDIR})")
    cmd = [sys.executable, "-m", "service", "serve", "--port", str(port), "--data-dir", str(WORKDIR)]
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=10)
    try:
        code = run(http)
        finish(url, token_file, interactive=sys.stdin.isatty() and sys.stdout.isatty(), wait=server.wait)
        return code
    except KeyboardInterrupt:
        return 130
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        say("service stopped")


def finish(url: str, token_file: Path, *, interactive: bool, wait: Callable[[], object]) -> None:
    """After the job: from a terminal, say where the running service is and keep it up until
    Ctrl-C (``wait`` returns when the service ends on its own); otherwise return at once, and the
    service is stopped without its URL having been offered."""
    if not interactive:
        return
    say(f"the service stays up at {url} (metrics: {url}/metrics) until you press Ctrl-C; try")
    say(f"  .venv/bin/elastrain jobs --url {url} --token-file {token_file}")
    wait()


def ok(http: httpx.Client, path: str) -> bool:
    try:
        return http.get(path).status_code == 200
    except httpx.HTTPError:
        return False


def run(http: httpx.Client) -> int:
    wait_for("the service to be ready", lambda: ok(http, "/readyz"), timeout=120)
    answer = http.post("/v1/jobs", json=SPEC, headers={"Idempotency-Key": "demo"})
    answer.raise_for_status()
    job_id = answer.json()["id"]
    say(f"submitted job {job_id}: nodes {SPEC['nodes']}, starting on {SPEC['initial_nodes']}")

    def job() -> dict[str, Any]:
        data: dict[str, Any] = http.get(f"/v1/jobs/{job_id}").json()
        return data

    def published() -> dict[str, Any] | None:
        current = job()
        show(current)
        return current if (current["last_published_step"] or 0) >= 1000 else None

    wait_for("the first published checkpoint", published)
    victim = wait_for("a worker process", lambda: worker_pids(job_id))[-1]
    say(f"SIGKILL worker pid {victim}")
    os.kill(victim, signal.SIGKILL)
    # A peer recovery (the default for DDP) may be over before the first poll: look for its record too.
    noticed = lambda: (j := job())["restarts"] >= 1 or j["state"] == "RECOVERING" or j["recoveries"]  # noqa: E731
    wait_for("the job to notice", noticed, 60)
    recovered = wait_for("the recovery", lambda: (j := job())["state"] == "RUNNING" and j["recoveries"] and j)
    show(recovered)
    rec = recovered["recoveries"][-1]
    phases = {
        k: round(rec[k] - rec["failed_at"], 2)
        for k in ("group_formed_at", "state_loaded_at", "first_step_at")
        if rec.get(k)
    }
    kind = str(rec.get("kind"))
    how = {"peer": "from the survivors' memory", "storage": "from the checkpoint, in process",
           "restart": "by a torchrun restart from the checkpoint"}.get(kind, kind)  # fmt: skip
    say(
        f"recovered {how} (kind {kind}): resumed at step {rec.get('resumed_step')}; "
        f"seconds after the kill: {json.dumps(phases)}"
    )
    say("scaling to 3 nodes")
    http.post(f"/v1/jobs/{job_id}/scale", json={"nodes": 3}).raise_for_status()

    def at_three() -> dict[str, Any] | None:
        current = job()
        show(current)
        return current if current["world_size"] == 3 and current["state"] == "RUNNING" else None

    wait_for("world size 3", at_three)

    def finished() -> dict[str, Any] | None:
        current = job()
        show(current)
        return current if current["state"] in ("SUCCEEDED", "FAILED", "CANCELLED") else None

    final = wait_for("the job to finish", finished, timeout=900)
    checkpoints = http.get(f"/v1/jobs/{job_id}/checkpoints").json()
    reason = final.get("reason")
    say(f"job {job_id} {final['state']}" + (f": {reason}" if reason else ""))
    for ck in checkpoints.get("checkpoints", []):
        say(f"  checkpoint step {ck.get('step')} world size {ck.get('world_size')} bytes {ck.get('bytes')}")
    say(f"checkpoints: {final['checkpoint_dir']}; worker logs and metrics targets under {WORKDIR}")
    say(f"report (offline, from the run directory): .venv/bin/elastrain report {final['checkpoint_dir']}")
    return 0 if final["state"] == "SUCCEEDED" else 1


if __name__ == "__main__":
    sys.exit(main())
