"""``elastrain report JOB_OR_RUN_DIR [MORE_RUN_DIRS...] [--json] [--png PATH] [--target-loss X]``.

A run directory (see :mod:`service.report`) or a job's ``s3://BUCKET/PREFIX`` (its events kept
in the bucket, :mod:`worker.report.bucket_events`, with this machine's credentials) is read
directly. Anything else is taken as a job id: the service's record gives the job's checkpoint
directory or ``s3://`` location (read when this machine sees it) and its recoveries as the
service measured them. Further run directories (the same model at
other world sizes) feed the scaling table. Text by default; ``--json`` for machines; ``--png``
draws throughput and loss over time with failures, recoveries, rescales and checkpoints marked.
Imports no torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from service.jobs.recovery import recovery_phases
from service.report import ReportError, Run, build_report, load_run

PNG_SIZE = (10.0, 6.0)
PNG_DPI = 100  # 1000 x 600 pixels


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("report", help="what a run achieved and what failures and checkpoints cost")
    p.add_argument(
        "target",
        metavar="JOB_OR_RUN_DIR",
        help="a run directory (events.jsonl inside), a job's s3:// location or a job id",
    )
    p.add_argument("others", nargs="*", metavar="RUN_DIR", help="runs at other world sizes, for scaling")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--png", metavar="PATH", help="also draw throughput and loss over time into PATH")
    p.add_argument("--target-loss", type=float, metavar="X", help="report the time until loss <= X")
    p.add_argument("--url", default=None, help="service URL for a job id (default $ELASTRAIN_URL)")
    p.add_argument("--token-file", default=None, help="API token file for a job id")
    p.add_argument("--timeout", type=float, default=10.0, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    service_view = None
    if args.target.startswith("s3://") or Path(args.target).exists():
        run = load_run(args.target)
    else:
        record = _fetch_job(args)
        service_view = _service_view(record)
        location = str(record.get("checkpoint_dir") or "")
        # a job on s3:// is read with this machine's credentials
        run = load_run(location) if location.startswith("s3://") else _local_run(args.target, Path(location))
    report = build_report(run, target_loss=args.target_loss, others=[load_run(p) for p in args.others])
    if service_view is not None:
        report["service"] = service_view
    if args.png:
        draw_png(report, Path(args.png))
        report["png"] = args.png
    sys.stdout.write(json.dumps(report, indent=2) + "\n" if args.json else render_text(report))
    return 0


def _local_run(job_id: str, run_dir: Path) -> Run:
    if not (run_dir / "events.jsonl").is_file():
        raise ReportError(
            f"job {job_id}: its run directory {str(run_dir)!r} is not readable here; run "
            "`elastrain report` where the checkpoint volume is mounted"
        )
    return load_run(run_dir)


def _fetch_job(args: argparse.Namespace) -> dict[str, Any]:
    import os

    from service.cli.jobs import DEFAULT_URL, request

    args.url = args.url or os.environ.get("ELASTRAIN_URL", DEFAULT_URL)
    record: dict[str, Any] = request(args, "GET", f"/v1/jobs/{args.target}")
    return record


def _service_view(record: dict[str, Any]) -> dict[str, Any]:
    """The job's incidents as the service recorded them (one incident, one recovery): kind, what
    was lost, each phase, the bytes moved from peers and from storage, the windows voided and the
    steps trained again."""
    recoveries = []
    for r in record.get("recoveries") or []:
        phases = r.get("phases")
        if phases is None:  # a record written without phases: derive them from its timestamps
            phases = [
                {"name": p.name, "seconds": p.seconds}
                for p in recovery_phases(
                    failed_at=r["failed_at"],
                    detected_at=r.get("detected_at"),
                    group_formed_at=r.get("group_formed_at"),
                    state_loaded_at=r.get("state_loaded_at"),
                    first_step_at=r.get("first_step_at"),
                )
            ]
        lost = r.get("steps_lost")
        if lost is None and r.get("step_before") is not None and r.get("resumed_step") is not None:
            lost = max(0, r["step_before"] - r["resumed_step"])
        recoveries.append(
            {
                "incident": r.get("incident", ""),
                "kind": r.get("kind", "restart"),
                "reason": r.get("reason"),
                "lost": r.get("lost", []),
                "lost_ranks": r.get("lost_ranks", []),
                "last_completed_steps": r.get("last_completed_steps") or {},
                "recovery_seconds": r.get("seconds"),
                "phases": [{"name": p["name"], "seconds": round(p["seconds"], 3)} for p in phases],
                "bytes_from_peers": r.get("bytes_from_peers", 0),
                "bytes_from_storage": r.get("bytes_from_storage", 0),
                "voided_windows": r.get("voided_windows", 0),
                "steps_lost": lost,
                "world_before": r.get("world_before"),
                "world_after": r.get("world_after"),
            }
        )
    return {
        "state": record.get("state"),
        "recovery_mode": record.get("recovery_mode", "restart"),
        "restarts": record.get("restarts"),
        "recoveries": recoveries,
    }


# ---------------------------------------------------------------------------- text


def _num(value: float | None, unit: str = "", digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}{unit}"


def _mib(nbytes: float | None) -> float | None:
    return None if nbytes is None else nbytes / 2**20


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1000:.1f} ms"


def _part(d: dict[str, Any] | None) -> str:
    if d is None:
        return "n/a (the worker did not report it)"
    frac = d.get("fraction_of_step_time")
    return f"{d['total']:.3f} s" + ("" if frac is None else f" ({frac:.1%} of step time)")


def render_text(r: dict[str, Any]) -> str:
    tp, lat = r["throughput"], r["step_seconds"] or {}
    lines = [
        f"elastrain report: job {r['job']}  ({r['run_dir']})",
        f"  status         {'finished' if r['finished'] else 'not finished'} at step {r['steps']}, "
        f"{r['samples_seen']} samples, wall {r['wall_seconds']:.1f} s, goodput "
        + ("n/a" if r["goodput"] is None else f"{r['goodput']:.1%}"),
        f"  world sizes    {', '.join(map(str, r['world_sizes'])) or 'n/a'}",
        f"  throughput     {_num(tp['samples_per_second'])} samples/s, "
        f"{_num(tp['tokens_per_second'])} tokens/s",
        f"  step latency   p50 {_ms(lat.get('p50'))}  p95 {_ms(lat.get('p95'))}  p99 {_ms(lat.get('p99'))}"
        + (f"  ({lat['count']} steps, {lat['source']})" if lat else ""),
        f"  exposed comm   {_part(r['comm_exposed_seconds'])}",
        f"  data wait      {_part(r['data_wait_seconds'])}",
        f"  peak memory    {_num(_mib(r['peak_memory_bytes']), ' MiB')}",
    ]
    target = r["time_to_target"]
    if target is not None:
        reached = f"{target['seconds']:.1f} s (step {target['step']})" if target["reached"] else "not reached"
        lines.append(f"  time to loss <= {target['target_loss']:g}: {reached}")
    lines += _restart_lines(r)
    lines += _straggler_lines(r.get("stragglers") or [])
    ck = r["checkpoints"]
    lines.append(
        f"  checkpoints    {ck['published']} published, {ck['aborted']} aborted, "
        f"{_num(_mib(ck['bytes_written']), ' MiB', 2)} written, "
        f"persist mean {_num(ck['persist_seconds_mean'], ' s', 3)}, "
        f"blocking mean {_num(ck['blocking_seconds_mean'], ' s', 3)}, "
        f"every {_num(ck['interval_steps_mean'], ' steps')}"
    )
    stored = ck.get("on_disk") or []
    if stored:
        lines.append(
            f"  stored         {len(stored)} in {r['run_dir']}: "
            + ", ".join(
                f"step {m['step']} (W={m['world_size']}, {_num(_mib(m['bytes']), ' MiB', 2)})" for m in stored
            )
        )
    if r["scaling"]:
        lines.append("  scaling        world  samples/s  global batch  efficiency  kind")
        for s in r["scaling"]:
            lines.append(
                f"                 {s['world_size']:>5}  {s['samples_per_second']:>9.1f}  "
                f"{s['global_batch']:>12g}  {s['efficiency']:>10.1%}  {s['kind']}"
            )
    lines += _precision_lines(r)
    return "\n".join(lines) + "\n"


def _restart_lines(r: dict[str, Any]) -> list[str]:
    lines = [f"  restarts       {len(r['restarts'])}"]
    for i, x in enumerate(r["restarts"], 1):
        lines.append(
            f"    #{i} {x['kind']} at +{x['at_seconds']:.1f} s: world {x['world_size_before']} -> "
            f"{x['world_size_after']}, step {x['last_step_before']} -> resumed at {x['resumed_step']} "
            f"({x['steps_lost']} steps lost), recovered in {_num(x['recovery_seconds'], ' s', 2)}"
        )
        lines.append("       " + ", ".join(f"{p['name']} {p['seconds']:.2f} s" for p in x["phases"]))
    for i, x in enumerate(r.get("incidents") or [], 1):
        phases = ", ".join(f"{p['name']} {p['seconds']:.3f} s" for p in x["phases"]) or "n/a"
        lines.append(
            f"    peer incident #{i} {x['incident']} at +{x['at_seconds']:.1f} s: {x['kind']}, "
            f"{_num(x['recovery_seconds'], ' s', 3)}; lost {', '.join(x['lost']) or 'n/a'}; world "
            f"{x['world_before']} -> {x['world_after']}; {phases}; from peers "
            f"{_num(_mib(x['bytes_from_peers']), ' MiB', 2)}, voided windows {x['voided_windows']}"
        )
    service = r.get("service") or {}
    if service.get("recoveries"):
        mode, used = service.get("recovery_mode"), service.get("restarts")
        count = len(service["recoveries"])
        lines.append(f"  incidents      {count} (service view, {mode} mode, {used} restarts used)")
    for i, x in enumerate(service.get("recoveries", []), 1):
        lines += _incident_lines(i, x)
    return lines


def _straggler_lines(named: list[dict[str, Any]]) -> list[str]:
    lines = [f"  stragglers     {len(named) or 'none'} named"]
    for x in named:
        node = "" if x.get("node") is None else f" on node {x['node']}"
        lines.append(
            f"    rank {x['rank']}{node}: {x['slowdown']}x the median of the other ranks' compute time "
            f"(above {x['threshold']}x) in {x['windows']} windows in a row, "
            f"steps {x['first_step']}-{x['step']}"
        )
    return lines


def _incident_lines(i: int, x: dict[str, Any]) -> list[str]:
    """One incident: kind, what was lost, its phases, what moved from where, what was lost."""
    ranks = ", ".join(map(str, x["lost_ranks"])) or "n/a"
    steps = x.get("last_completed_steps") or {}
    if steps:  # peer mode: the step each lost rank completed, as its beacon last said
        ranks += "; last completed " + ", ".join(f"step {s} on rank {r}" for r, s in sorted(steps.items()))
    world = f"world {x['world_before'] or '?'} -> {x['world_after'] or '?'}"
    phases = ", ".join(f"{p['name']} {p['seconds']:.3f} s" for p in x["phases"]) or "n/a"
    return [
        f"    incident #{i} {x['incident'] or '?'}: {x['kind']}, {_num(x['recovery_seconds'], ' s', 3)}; "
        f"lost {', '.join(x['lost']) or 'no node'} (ranks {ranks}); {world}",
        f"       phases {phases}",
        f"       from peers {_num(_mib(x['bytes_from_peers']), ' MiB', 2)}, from storage "
        f"{_num(_mib(x['bytes_from_storage']), ' MiB', 2)}; voided windows {x['voided_windows']}, "
        f"rolled-back steps {'n/a' if x['steps_lost'] is None else x['steps_lost']}",
        f"       {x['reason']}",
    ]


def _precision_lines(r: dict[str, Any]) -> list[str]:
    lines = [f"  precision      {r['precision'] or 'n/a'}"]
    for op, row in (r["precision_table"] or {}).items():
        lines.append(
            f"    {op:<36} in {row.get('input')}, accumulate {row.get('accumulate')}, out {row.get('output')}"
        )
    env = r["environment"] or {}
    if env:
        versions = ", ".join(f"{k} {v}" for k, v in (env.get("versions") or {}).items() if v)
        lines.append(f"  environment    {versions}")
        # Each attempt writes the run record when it starts, and peer mode again at each new
        # group's first step: a run that changed size says whose size this is
        whose = " (the latest run record's)" if len(r["world_sizes"]) > 1 else ""
        lines.append(
            f"    device {env.get('device')} ({env.get('device_name') or '?'}), "
            f"backend {env.get('backend')}, world size {env.get('world_size')}{whose}, "
            f"seed {env.get('seed')}"
        )
        det = env.get("determinism") or {}
        if det:
            lines.append("    determinism " + ", ".join(f"{k}={v}" for k, v in det.items()))
        # what the worker chose on its own and why (a GPU node on CPU, the restart path)
        lines += [f"    note: {note}" for note in env.get("notes") or ()]
    return lines


# ---------------------------------------------------------------------------- PNG


def draw_png(r: dict[str, Any], path: Path) -> None:
    """Throughput (top) and loss (bottom) over time; failures red, recovery spans green,
    rescales purple, checkpoints grey ticks. 1000 x 600 pixels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = r["timeline"]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=PNG_SIZE, dpi=PNG_DPI)
    for attempt in sorted({p[4] for p in t["progress"]}):
        pts = [p for p in t["progress"] if p[4] == attempt]
        first = attempt == 0
        rate = [(p[0], p[3]) for p in pts if p[3] is not None]
        loss = [(p[0], p[2]) for p in pts if p[2] is not None]
        top.plot(*zip(*rate, strict=True), lw=1, color="C0", label="samples/s" if first else None)
        bottom.plot(*zip(*loss, strict=True), lw=1, color="C1", label="loss" if first else None)
    top.set_ylabel("samples/s")
    bottom.set_ylabel("loss")
    bottom.set_xlabel("seconds since start")
    for ax in (top, bottom):
        for x in t["checkpoints"]:
            ax.axvline(x, color="grey", lw=0.6, alpha=0.6)
        for restart in r["restarts"]:
            at = restart["at_seconds"]
            color = "purple" if restart["kind"] == "rescale" else "red"
            ax.axvline(at, color=color, lw=1.2)
            if restart["recovery_seconds"] is not None:
                ax.axvspan(at, at + restart["recovery_seconds"], color="green", alpha=0.15)
    top.set_title(
        f"elastrain job {r['job']}: throughput and loss "
        "(red failure, purple rescale, green recovery, grey checkpoint)",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=PNG_DPI)
    plt.close(fig)
