"""``elastrain serve`` and the REST client commands: submit, jobs, status, scale, cancel,
checkpoints, logs. Client commands take ``--url`` (default ``$ELASTRAIN_URL`` or
http://127.0.0.1:8080) and the API token from ``$ELASTRAIN_API_TOKEN``, ``--token-file``, or the
``api-token`` file a local ``elastrain serve`` generated under ``.elastrain``. Errors are one
line on stderr and a non-zero exit (the dispatcher prints :class:`ElastrainError`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from worker.errors import ElastrainError

DEFAULT_URL = "http://127.0.0.1:8080"
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}


class ClientError(ElastrainError):
    """The service refused a request or could not be reached."""


# ---------------------------------------------------------------------- client


def _token(args: argparse.Namespace) -> str:
    if os.environ.get("ELASTRAIN_API_TOKEN"):
        return os.environ["ELASTRAIN_API_TOKEN"]
    path = (
        Path(args.token_file)
        if args.token_file
        else Path(os.environ.get("ELASTRAIN_DATA_DIR", ".elastrain")) / "api-token"
    )
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError:
        if args.token_file:
            raise ClientError(f"cannot read token file {str(path)!r}") from None
        raise ClientError(
            "no API token: set ELASTRAIN_API_TOKEN or pass --token-file (a local `elastrain serve` "
            "writes .elastrain/api-token)"
        ) from None


RETRIES_503 = 5
"""A 503 (a standby instance, leadership being taken over, etcd without quorum) is retried this
often, after its Retry-After (default 1 s). Every call the CLI makes is safe to repeat: reads,
cancel and scale are idempotent, and submit always sends an Idempotency-Key."""


def request(args: argparse.Namespace, method: str, path: str, **kwargs: Any) -> Any:
    """One API call; returns the decoded JSON body or raises :class:`ClientError`."""
    url = args.url.rstrip("/") + path
    headers = {"Authorization": f"Bearer {_token(args)}", **kwargs.pop("headers", {})}
    for attempt in range(RETRIES_503 + 1):
        try:
            resp = httpx.request(method, url, headers=headers, timeout=args.timeout, **kwargs)
        except httpx.HTTPError as exc:
            raise ClientError(
                f"cannot reach the service at {args.url}: {exc}; is `elastrain serve` running?"
            ) from None
        if resp.status_code != 503 or attempt == RETRIES_503:
            break
        retry_after = resp.headers.get("Retry-After", "1")
        time.sleep(min(10.0, float(retry_after)) if retry_after.isdigit() else 1.0)
    try:
        body = resp.json()
    except ValueError:
        body = None
    if resp.status_code >= 400:
        error = body.get("error", {}) if isinstance(body, dict) else {}
        message = error.get("message") or resp.text[:200] or resp.reason_phrase
        raise ClientError(f"{resp.status_code} {error.get('code', '')}: {message}".replace(" :", ":"))
    return body


# ---------------------------------------------------------------------- commands


def cmd_serve(args: argparse.Namespace) -> int:
    from service.server import serve
    from service.settings import load_settings

    settings = load_settings(
        host=args.host,
        port=args.port,
        worker_port=args.worker_port,
        data_dir=args.data_dir,
        etcd=args.etcd,
        storage_root=args.storage_root,
        token_file=args.token_file,
    )
    return serve(settings)


def cmd_submit(args: argparse.Namespace) -> int:
    try:
        body = Path(args.spec).read_bytes()
    except OSError as exc:
        raise ClientError(f"cannot read spec file {args.spec!r}: {exc.strerror}") from None
    headers = {"Content-Type": "application/json"}
    # A key of our own when none is given: a retried submit (after a 503) cannot create two jobs.
    headers["Idempotency-Key"] = args.idempotency_key or f"cli-{uuid.uuid4()}"
    job = request(args, "POST", "/v1/jobs", content=body, headers=headers)
    print(job["id"] if args.quiet else f"{job['id']}  {job['state']}  checkpoints in {job['checkpoint_dir']}")
    return 0


def cmd_jobs(args: argparse.Namespace) -> int:
    params: dict[str, Any] = {"limit": args.limit}
    if args.state:
        params["state"] = args.state.upper()
    page = request(args, "GET", "/v1/jobs", params=params)
    if args.json:
        print(json.dumps(page, indent=2))
        return 0
    print(f"{'JOB':<40} {'STATE':<11} {'NODES':>5} {'WORLD':>5} {'RESTARTS':>8} {'PUBLISHED':>9}")
    for j in page["jobs"]:
        published = "-" if j["last_published_step"] is None else j["last_published_step"]
        world = j["world_size"] or "-"
        nodes, restarts = j["desired_nodes"], j["restarts"]
        print(f"{j['id']:<40} {j['state']:<11} {nodes:>5} {world:>5} {restarts:>8} {published:>9}")
    if page["next_cursor"]:
        print(f"(more: elastrain jobs --limit {args.limit * 2})")
    return 0


def status_line(job: dict[str, Any]) -> str:
    """The one-line live view of ``status --watch`` (pure)."""

    def show(value: Any, fmt: str = "{}") -> str:
        return "-" if value is None else fmt.format(value)

    parts = [
        f"{job['state']:<10}",
        f"step {show(job.get('step'))}",
        f"{show(job.get('samples_per_s'), '{:.1f}')} samples/s",
        f"loss {show(job.get('loss'), '{:.4g}')}",
        f"world {show(job.get('world_size'))}",
        f"nodes {job.get('desired_nodes')}",
        f"ckpt {show(job.get('last_published_step'))}",
        f"restarts {job.get('restarts', 0)}",
    ]
    return "  ".join(parts)


def _print_status(job: dict[str, Any]) -> None:
    print(f"job {job['id']}  ({job['name']})")
    print("  " + status_line(job))
    if job.get("reason"):
        print(f"  reason: {job['reason']}")
    if job.get("queue_position"):
        print(f"  place in the queue: {job['queue_position']}")
    if job.get("waiting") and job.get("waiting") != job.get("reason"):
        print(f"  waiting: {job['waiting']}")
    print(f"  checkpoints: {job['checkpoint_dir']}")
    for node in job.get("nodes", []):
        role = "spare" if node.get("role") == "spare" else "node"
        print(f"  {role} {node['index']} attempt {node['attempt']}: {node['phase']}  {node['handle'] or ''}")
    for rec in job.get("recoveries", [])[-3:]:
        took = (
            "in progress"
            if rec["seconds"] is None
            else f"{rec['seconds']:.2f}s, {rec['steps_lost']} steps lost"
        )
        print(f"  recovery ({rec.get('kind', 'restart')}): {took}: {rec['reason']}")
    for event in job.get("events", [])[-5:]:
        stamp = time.strftime("%H:%M:%S", time.localtime(event["time"]))
        print(f"  {stamp} {event['kind']}: {event['message']}")


def cmd_status(args: argparse.Namespace) -> int:
    path = f"/v1/jobs/{args.job}"
    job = request(args, "GET", path)
    if args.json:
        print(json.dumps(job, indent=2))
        return 0
    if not args.watch:
        _print_status(job)
        return 0
    tty = sys.stdout.isatty()
    while True:
        line = status_line(job)
        print(("\r\x1b[2K" + line) if tty else line, end="" if tty else "\n", flush=True)
        if job["state"] in TERMINAL:
            break
        time.sleep(args.interval)
        job = request(args, "GET", path)
    if tty:
        print()
    if job.get("reason"):
        print(f"reason: {job['reason']}")
    return 0 if job["state"] == "SUCCEEDED" else 1


def cmd_scale(args: argparse.Namespace) -> int:
    job = request(args, "POST", f"/v1/jobs/{args.job}/scale", json={"nodes": args.nodes})
    print(f"{job['id']}: desired nodes {job['desired_nodes']} ({job['state']})")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    job = request(args, "DELETE", f"/v1/jobs/{args.job}")
    print(f"{job['id']}: {job['state']}{' (cancelling)' if job['state'] not in TERMINAL else ''}")
    return 0


def cmd_checkpoints(args: argparse.Namespace) -> int:
    body = request(args, "GET", f"/v1/jobs/{args.job}/checkpoints")
    if args.json:
        print(json.dumps(body, indent=2))
        return 0
    print(f"{'STEP':>10} {'WORLD':>5} {'BYTES':>12} {'VERIFIED':>8}  {'PUBLISHED':<19}  DIR")
    for c in body["checkpoints"]:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(c["published_at"]))
        size, verified = c["bytes"], str(c["verified"])
        print(f"{c['step']:>10} {c['world_size']:>5} {size:>12} {verified:>8}  {when:<19}  {c['dir']}")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    params: dict[str, Any] = {"tail": args.tail}
    if args.node is not None:
        params["node"] = args.node
    body = request(args, "GET", f"/v1/jobs/{args.job}/logs", params=params)
    for launch_id, lines in body["nodes"].items():
        print(f"==> {launch_id} <==")
        for line in lines:
            print(line)
    if body.get("note"):
        print(f"note: {body['note']}")
    return 0


# ---------------------------------------------------------------------- parser


def _client(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--url", default=os.environ.get("ELASTRAIN_URL", DEFAULT_URL), help="service URL")
    parser.add_argument("--token-file", help="file holding the API token (default: $ELASTRAIN_API_TOKEN)")
    parser.add_argument("--timeout", type=float, default=30.0, help=argparse.SUPPRESS)
    return parser


def register(sub: Any) -> None:
    serve = sub.add_parser("serve", help="run the control plane (API, reconciler, embedded etcd)")
    serve.add_argument("--host", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8080)")
    serve.add_argument(
        "--worker-port", type=int, help="a port of its own for the workers' calls (default: --port)"
    )
    serve.add_argument("--data-dir", help="state directory (default ./.elastrain)")
    serve.add_argument("--etcd", help="etcd endpoints URL[,URL]; empty starts an embedded etcd")
    serve.add_argument("--storage-root", help="checkpoint root (default <data-dir>/checkpoints)")
    serve.add_argument("--token-file", help="file holding the API token")
    serve.set_defaults(func=cmd_serve)

    p = _client(sub.add_parser("submit", help="submit a job spec (JSON)"))
    p.add_argument("spec", help="path of the JobSpec JSON file")
    p.add_argument("--idempotency-key", help="the same key returns the same job")
    p.add_argument("-q", "--quiet", action="store_true", help="print only the job id")
    p.set_defaults(func=cmd_submit)

    p = _client(sub.add_parser("jobs", help="list jobs"))
    p.add_argument("--state", help="only jobs in this state")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_jobs)

    p = _client(sub.add_parser("status", help="show a job (--watch: live progress)"))
    p.add_argument("job")
    p.add_argument("--watch", action="store_true", help="refresh until the job finishes")
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)

    p = _client(sub.add_parser("scale", help="set a job's node count"))
    p.add_argument("job")
    p.add_argument("--nodes", type=int, required=True)
    p.set_defaults(func=cmd_scale)

    p = _client(sub.add_parser("cancel", help="cancel a job (idempotent)"))
    p.add_argument("job")
    p.set_defaults(func=cmd_cancel)

    p = _client(sub.add_parser("checkpoints", help="list a job's published checkpoints"))
    p.add_argument("job")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_checkpoints)

    p = _client(sub.add_parser("logs", help="show a job's node logs"))
    p.add_argument("job")
    p.add_argument("--node", type=int)
    p.add_argument("--tail", type=int, default=200)
    p.set_defaults(func=cmd_logs)
