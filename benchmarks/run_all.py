"""``make bench``: every benchmark, one after another, each printing its own ratios.

Each runs in its own process (they start torchrun, etcd and uvicorn themselves). A failing
benchmark is reported and the others still run; the exit code says whether all ran.
"""

from __future__ import annotations

import subprocess
import sys

BENCHMARKS = (
    ("worker throughput vs bare torchrun+DDP", ["benchmarks.worker_throughput"]),
    ("worker with a batch() that costs half the step vs free data", ["benchmarks.data_prefetch"]),
    ("slow batches: training thread, loader thread, DataLoader processes", ["benchmarks.loader_choice"]),
    ("checkpoint save/load vs raw I/O and DCP", ["benchmarks.checkpoint_bench"]),
    ("async checkpoint: blocking and background cost", ["benchmarks.checkpoint_async"]),
    ("re-rendezvous after a worker SIGKILL", ["benchmarks.rendezvous_recovery", "--skip-default"]),
    ("control plane GET/submit load", ["benchmarks.service_api"]),
    (
        "the control plane at scale: simulated nodes of 5 and 20 jobs (the full run: --jobs 10 100 1000)",
        ["benchmarks.control_plane_scale", "--quick"],
    ),
    ("the etcd client's cost per request vs a bare http.client request", ["benchmarks.etcd_client"]),
    ("a job under the service vs bare torchrun; recovery vs its floor", ["benchmarks.service_job"]),
    ("recovery without a restart vs torchrun's restart", ["benchmarks.peer_recovery", "--rounds", "2"]),
    (
        "peer mode's steady-state cost: its step path in one job, the rest of the machine's CPU",
        ["benchmarks.peer_steady", "--rounds", "3", "--steps", "3000", "--block", "10"],
    ),
    ("what a few more numbers cost on the step's small gloo all-reduce", ["benchmarks.allreduce_length"]),
    ("where the commit vote can ride in a DDP step", ["benchmarks.vote_carrier"]),
    ("joining without stopping: a 2 -> 3 scale-up in peer mode", ["benchmarks.peer_join", "--rounds", "2"]),
)


def main() -> int:
    failed = []
    for title, args in BENCHMARKS:
        print(f"\n=== {title}: python -m {' '.join(args)}", flush=True)
        code = subprocess.run([sys.executable, "-m", *args], check=False).returncode
        if code:
            failed.append(title)
            print(f"=== {title}: exit code {code}", flush=True)
    if failed:
        print(f"\nbenchmarks that did not complete: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
