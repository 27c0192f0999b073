"""``make bench``: every benchmark, one after another, each printing its own ratios; then the
table of ``docs/benchmarks.md`` rewritten from their result records (:mod:`benchmarks.record`).

``python -m benchmarks.run_all [--quick] [--no-table] [--only MODULE ...] [--machine-note TEXT]``

Each benchmark runs in its own process (they start torchrun, etcd and uvicorn themselves). A
failing benchmark is reported, its row keeps its last measured value, and the others still run;
the exit code says whether all ran and each printed its record. ``--quick`` runs each in a short
mode (a round or two of small runs: it proves the benchmark works, its numbers are rough; the
rows say "quick mode"; one that fails runs once more, saying so). ``--no-table`` leaves the docs
alone (what the test suite runs).
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.record import Row, machine, merge, parse

TABLE = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


@dataclass(frozen=True, slots=True)
class Bench:
    """A benchmark: its module, what it compares, its arguments in a full and in a quick run."""

    module: str
    compares: str
    full: tuple[str, ...] = ()
    quick: tuple[str, ...] = ()


BENCHMARKS = (
    Bench("benchmarks.worker_throughput", "`-m worker` samples/s vs a bare torchrun + DDP loop",
          quick=("--rounds", "1", "--steps", "60")),
    Bench("benchmarks.data_prefetch", "a `batch()` that costs half the step, loaded ahead, vs free data",
          quick=("--rounds", "1", "--steps", "60")),
    Bench("benchmarks.loader_choice",
          "slow batches: training thread, loader thread, DataLoader processes vs free data",
          quick=("--rounds", "1", "--steps", "20")),
    Bench("benchmarks.checkpoint_bench", "checkpoint save/load vs raw I/O and DCP; resharded loads",
          quick=("--mb", "16", "--repeats", "1", "--load-rounds", "1", "--fsdp-rounds", "1")),
    Bench("benchmarks.checkpoint_async", "training blocked by an async save vs a synchronous save",
          quick=("--mb", "16", "--repeats", "1")),
    Bench("benchmarks.checkpoint_s3",
          "checkpoints on S3 (SeaweedFS) vs DCP's fsspec writer over s3fs; W'=3 loads; async; memory",
          quick=("--mb", "16", "--rounds", "1", "--async-saves", "1")),
    Bench("benchmarks.rendezvous_recovery", "re-rendezvous after a worker SIGKILL: etcd-v3 vs c10d",
          full=("--skip-default",), quick=("--skip-default",)),
    Bench("benchmarks.service_api", "control plane: paced `GET /v1/jobs/{id}` vs 1,000 req/s at p99 < 50 ms",
          quick=("--seconds", "2", "--forward-rounds", "1")),
    Bench("benchmarks.control_plane_scale",
          "the control plane at scale: N jobs x 10 simulated nodes on the real service and etcd",
          full=("--jobs", "10", "100", "1000"), quick=("--quick",)),
    Bench("benchmarks.queue_idle",
          "idle means idle: one job training next to 1,000 queued vs an empty queue",
          quick=("--quick",)),
    Bench("benchmarks.etcd_client", "the etcd client's CPU per request vs a bare http.client request",
          quick=("--rounds", "2", "--requests", "100")),
    Bench("benchmarks.service_job", "a job under the service vs bare torchrun",
          quick=("--quick",)),
    Bench("benchmarks.peer_recovery", "recovery without a restart vs torchrun's restart",
          full=("--rounds", "2"), quick=("--rounds", "1", "--steps", "200")),
    Bench("benchmarks.peer_steady", "peer mode's step path vs restart mode's, in one job",
          full=("--rounds", "3", "--steps", "3000", "--block", "10"),
          quick=("--rounds", "1", "--steps", "150", "--block", "10")),
    Bench("benchmarks.allreduce_length", "a 7-number vs a 2-number gloo all-reduce in a small step",
          quick=("--iterations", "600")),
    Bench("benchmarks.vote_carrier", "where the commit vote rides in a DDP step vs no vote",
          quick=("--iterations", "600")),
    Bench("benchmarks.peer_join", "the longest step across a 2 -> 3 scale-up in peer mode vs its bound",
          full=("--rounds", "2"), quick=("--rounds", "1", "--steps", "300", "--warm", "50")),
    Bench("benchmarks.preemption", "a SIGTERM: exit time vs the grace period, steps lost",
          full=("--rounds", "3"), quick=("--rounds", "1")),
    Bench("benchmarks.stragglers", "straggler events in clean runs of the benchmark job (false positives)",
          full=("--rounds", "20"), quick=("--rounds", "1", "--steps", "200")),
    Bench("benchmarks.straggler_replace",
          "a straggler replaced by a warm spare: throughput two windows after the join vs before",
          full=("--window", "50"), quick=("--window", "25")),
    Bench("benchmarks.integrity_check", "the replicas' comparison at its default interval vs none, one job",
          full=("--rounds", "3", "--steps", "3000"), quick=("--rounds", "1", "--steps", "400")),
)  # fmt: skip


def run(bench: Bench, *, quick: bool) -> tuple[int, list[str]]:
    """Runs one benchmark, echoing its output; its exit code and output lines."""
    args = bench.quick if quick else bench.full
    print(f"\n=== {bench.compares}: python -m {bench.module} {' '.join(args)}", flush=True)
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", bench.module, *args], stdout=subprocess.PIPE, text=True, bufsize=1
    )
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        print(line, end="", flush=True)
        lines.append(line.rstrip("\n"))
    code = proc.wait()
    print(f"=== {bench.module}: exit code {code} after {time.monotonic() - started:.0f} s", flush=True)
    return code, lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run of each (rough numbers)")
    parser.add_argument("--no-table", action="store_true", help=f"do not rewrite {TABLE.name}")
    parser.add_argument("--only", nargs="+", default=[], help="these modules only")
    parser.add_argument("--machine-note", default="", help="appended to the machine column")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.only) - {b.module for b in BENCHMARKS})
    if unknown:
        parser.error(f"not a benchmark of make bench: {', '.join(unknown)} (see benchmarks/run_all.py)")
    chosen = [b for b in BENCHMARKS if not args.only or b.module in args.only]
    started = time.monotonic()
    failed, rows = [], []
    given = (machine(), "quick mode" if args.quick else "", args.machine_note)
    where = ", ".join(dict.fromkeys(p for g in given for p in g.split(", ") if p))  # nothing twice
    for bench in chosen:
        code, lines = run(bench, quick=args.quick)
        if args.quick and (code or not parse(lines)):
            # A short run proves the benchmark works; on a machine shared with the tests a port
            # that torchrun's --standalone picked can be taken before it binds. Once more, said so
            print(f"=== {bench.module} failed in its short run; running it once more", flush=True)
            code, lines = run(bench, quick=args.quick)
        records = parse(lines)
        if code or not records:
            failed.append(bench.module)
            print(f"=== {bench.module} did not complete: {len(records)} result records", flush=True)
            continue
        today = datetime.datetime.now(datetime.UTC).date().isoformat()
        rows.append(Row(bench.module, bench.compares, records[-1], today, where))
    if not args.no_table and rows:
        TABLE.write_text(merge(TABLE.read_text(), rows, [b.module for b in BENCHMARKS]))
        print(f"\n{TABLE}: {len(rows)} rows written")
    print(f"\n{len(chosen)} benchmarks in {time.monotonic() - started:.0f} s")
    if failed:
        print(f"benchmarks that did not complete: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
