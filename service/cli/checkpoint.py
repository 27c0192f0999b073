"""``elastrain checkpoint inspect|verify|digest|reshard|export-weights`` (torch-free, except
``export-weights --format torch``, which imports torch to write a torch state dict).

DIR may be a job directory (its ``latest``, else its newest published step) or a step
directory. Exit codes: 0 success, 1 verification found a mismatch, 2 usage or unreadable input
(raised as :class:`worker.errors.ElastrainError`, printed by the dispatcher).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from worker.checkpoint.export import DTYPES, FORMATS, export_weights
from worker.checkpoint.manifest import MANIFEST_NAME, Manifest
from worker.checkpoint.offline import reshard
from worker.checkpoint.places import load_manifest, resolve_checkpoint
from worker.checkpoint.verify import logical_digest, verify_checkpoint


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "checkpoint", help="inspect, verify, digest, reshard or export a checkpoint"
    )
    sub = parser.add_subparsers(dest="checkpoint_command", required=True, metavar="SUBCOMMAND")

    p = sub.add_parser("inspect", help="summarise a checkpoint (a table, or --json)")
    p.add_argument("dir", metavar="DIR", help="job directory or step directory")
    p.add_argument("--json", action="store_true", help="print JSON for machines")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("verify", help="check every block of every shard; exit 1 naming file and offset")
    p.add_argument("dir", metavar="DIR")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("digest", help="digest of the logical state (independent of sharding and world size)")
    p.add_argument("dir", metavar="DIR")
    p.set_defaults(func=cmd_digest)

    p = sub.add_parser("reshard", help="rewrite a checkpoint for another world size (offline)")
    p.add_argument("src", metavar="SRC")
    p.add_argument("dst", metavar="DST", help="job directory to publish the resharded step in")
    p.add_argument("--world-size", type=int, required=True, metavar="N")
    p.set_defaults(func=cmd_reshard)

    p = sub.add_parser(
        "export-weights", help="model weights only, to load elsewhere (cannot resume training)"
    )
    p.add_argument("src", metavar="SRC")
    p.add_argument("dst", metavar="DST", help="new directory for the weights (and config.json)")
    p.add_argument(
        "--format",
        choices=sorted(FORMATS),
        default="safetensors",
        help="model.safetensors (default) or pytorch_model.bin (a torch.save state dict)",
    )
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="convert floating tensors (default: as stored, fp32 master weights)",
    )
    p.add_argument(
        "--strip-prefix",
        default=None,
        metavar="PREFIX",
        help="export the module under PREFIX (e.g. hf.) with names relative to it; default: "
        "where the checkpoint says its Hugging Face model is, else ''",
    )
    p.set_defaults(func=cmd_export)  # fmt: skip


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def summary(m: Manifest, path: str) -> dict[str, Any]:
    progress = m.meta.get("progress", {})
    return {
        "path": path,
        "job": m.job,
        "step": m.step,
        "generation": m.generation,
        "world_size": m.world_size,
        "parallelism": m.parallelism,
        "samples_seen": progress.get("samples_seen"),
        "epoch": progress.get("epoch"),
        "parent_step": m.parent_step,
        "spec_hash": m.spec_hash,
        "data_version": m.data_version,
        "metrics": m.metrics,
        "bytes": m.total_bytes,
        "files": {n: {"size": f.size, "digest": f.digest} for n, f in sorted(m.files.items())},
        "tensors": {
            n: {"dtype": t.dtype, "shape": list(t.shape), "kind": t.kind, "pieces": len(t.pieces)}
            for n, t in sorted(m.tensors.items())
        },
        "aliases": m.aliases,
        "rng_ranks": sorted(int(r) for r in m.rank_meta),
        "run_record": m.run_record,
    }


def cmd_inspect(args: argparse.Namespace) -> int:
    step_dir = resolve_checkpoint(args.dir)
    m = load_manifest(step_dir, check_files=False)  # what the manifest says; `verify` checks the files
    info = summary(m, str(step_dir))
    if args.json:
        print(json.dumps(info, indent=1, sort_keys=True))
        return 0
    keys = ("path", "job", "step", "generation", "world_size", "parallelism", "samples_seen", "epoch")
    rows = [(k, info[k]) for k in (*keys, "parent_step", "data_version")]
    rows.append(("metrics", " ".join(f"{k}={v:g}" for k, v in info["metrics"].items()) or "-"))
    rows.append(("tensors", f"{len(info['tensors'])}" + (f" (+{len(m.aliases)} tied)" if m.aliases else "")))
    rows.append(("bytes", _human(info["bytes"])))
    rows.append(("files", f"{len(info['files'])}"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {'-' if value is None else value}")
    for name, f in info["files"].items():
        print(f"  {name:<20} {_human(f['size']):>10}  {f['digest']}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    step_dir, problems = verify_checkpoint(args.dir)
    if problems and problems[0].file == MANIFEST_NAME:  # refused before any shard was read
        print(f"elastrain: error: {problems[0].message}", file=sys.stderr)
        return 1
    if problems:
        for p in problems:
            print(f"MISMATCH {step_dir}/{p}")
        print(f"{step_dir}: {len(problems)} problem(s); this checkpoint must not be loaded", file=sys.stderr)
        return 1
    m = load_manifest(step_dir)
    print(f"OK {step_dir}: {len(m.files)} files, {_human(m.total_bytes)}, every block verified")
    return 0


def cmd_digest(args: argparse.Namespace) -> int:
    step_dir = resolve_checkpoint(args.dir)
    print(f"{logical_digest(step_dir)}  {step_dir}")
    return 0


def cmd_reshard(args: argparse.Namespace) -> int:
    out = reshard(args.src, args.dst, world_size=args.world_size)
    m = load_manifest(out)
    print(f"resharded step {m.step} to {m.world_size} ranks: {out} (digest {logical_digest(out)})")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    done = export_weights(
        args.src, args.dst, fmt=args.format, dtype=args.dtype, strip_prefix=args.strip_prefix
    )
    dtype = f", {args.dtype}" if args.dtype else ""
    print(f"exported {done.tensors} tensors ({_human(done.bytes)}{dtype}) to {done.path}")
    if done.strip_prefix:
        print(f"names are relative to {done.strip_prefix!r} (--strip-prefix)")
    if done.left_out:
        names = ", ".join(done.left_out[:5]) + (", ..." if len(done.left_out) > 5 else "")
        print(f"left out {len(done.left_out)} tensors outside {done.strip_prefix!r}: {names}")
    if done.config_written:
        where = str(done.path.parent)
        print(f"config.json written beside them: transformers' from_pretrained({where!r}) loads it")
    print("weights only: this export has no optimizer state, progress or RNG and cannot resume training")
    return 0
