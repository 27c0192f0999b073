"""Run the fault matrix (tests/faults) N times per row with recorded seeds and print a table.

``python -m scripts.faults --trials N [--rows a,b] [--seed BASE] [--out PATH]``

Draws N seeds from ``--seed`` (default: from the clock, printed so a run can be repeated), runs
every selected row once per seed in a single pytest session (rows share the uninterrupted
reference run), and writes a Markdown table -- row, trials, passed, failed seeds, notes -- to
stdout and to ``--out`` (default ``.elastrain/faults.md``). A failed seed reruns alone with
``ELASTRAIN_FAULT_SEED=<seed> pytest <row's test>``. Exit status 1 when any trial failed.

A row that could not run here (pytest skipped it, e.g. no permission to mount the tmpfs of
``enospc-tmpfs``, or it never reported) is ``NOT RUN`` in the passed column, with the reason, and
the summary line counts such rows: it is never shown as passed. A row marked as a known defect
(``xfail``, strict) that failed as expected is ``XFAIL`` with the defect.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
T = "tests/faults/"
R = "tests/integration/recovery/"
W = "tests/integration/worker/"
ROWS: dict[str, str] = {
    "sigkill-rank": T + "test_worker_faults.py::test_sigkill_random_rank_at_random_step",
    "bare-torchrun": T + "test_bare_torchrun.py::test_bare_torchrun_survives_a_sigkill",
    "kill-at-failpoint": T + "test_worker_faults.py::test_kill_at_a_checkpoint_failpoint",
    "kill-chain": "tests/integration/checkpoint/test_faults_torchrun.py::test_kill_at_every_failpoint",
    "corrupt-shard": T + "test_worker_faults.py::test_corrupt_newest_shard_is_refused",
    "enospc-failpoint": T + "test_worker_faults.py::test_enospc_failpoint_during_a_save",
    "enospc-tmpfs": T + "test_worker_faults.py::test_enospc_on_a_real_small_tmpfs",
    "rescale-during-save": T + "test_rescale_save.py::test_rescale_during_a_save",
    "sigstop-worker": T + "test_sigstop.py::test_sigstop_a_worker_then_sigcont",
    "sigstop-worker-past-timeout": T + "test_sigstop.py::test_sigstop_past_the_collective_timeout",
    "service-kill-submit": T + "test_service_faults.py::test_kill9_during_submit_with_idempotency_key",
    "service-kill-scale": T + "test_service_faults.py::test_kill9_during_scale_converges",
    "service-kill-publish": T + "test_service_publish.py::test_kill9_of_the_service_during_publish",
    "leader-sigstop-fencing": T + "test_leader_fencing.py::test_sigstop_leader_past_lease_is_fenced",
    "etcd-quorum": T + "test_etcd_quorum.py::test_lose_one_then_two_etcd_members",
    "service-kill-real": T + "test_real_service.py::test_real_kill9_during_submit_and_during_scale",
    "leader-fencing-real": T + "test_real_service.py::test_real_leader_fencing",
    "etcd-quorum-real": T + "test_real_service.py::test_real_etcd_quorum",
    "bad-path-fields": T + "test_bad_input.py::test_traversal_paths_are_422",
    "bad-large-bodies": T + "test_bad_input.py::test_large_and_deep_bodies_are_refused",
    "bad-manifest-code": T + "test_bad_input.py::test_crafted_checkpoint_never_executes_code",
    "poison": T + "test_poison.py::test_poison_next_to_a_healthy_job",
    "hostile-job": T + "test_hostile_job.py::test_a_hostile_job_reaches_nothing_beside_a_victim",
    "storage-outage": T + "test_storage_outage.py::test_storage_server_killed_during_a_save",
    # Graceful preemption: a SIGTERM from outside, under the README's bare torchrun command.
    "preempt-agent": T + "test_preemption.py::test_sigterm_to_the_agent_saves_and_the_same_command_resumes",
    "preempt-worker": T + "test_preemption.py::test_sigterm_to_one_worker_stops_the_group_at_one_step",
    "preempt-job-second-signal": T
    + "test_preemption.py::test_a_second_signal_during_the_save_keeps_the_published_checkpoint",
    # A straggler made from outside: a SIGSTOP/SIGCONT duty cycle on one rank's process.
    "straggler-duty-cycle": T + "test_stragglers.py::test_a_rank_in_a_stop_duty_cycle_is_named",
    "straggler-replace": T
    + "test_straggler_replace.py::test_a_straggler_leaves_and_the_spare_takes_its_place",
    "service-preempt": T
    + "test_service_preemption.py::test_sigterm_to_nodes_is_a_preemption_that_loses_no_step",
    "peer-preempt": T
    + "test_service_preemption.py::test_in_peer_mode_a_preempted_node_hands_off_and_a_preempted_job_saves",
    # Silent corruption: a user's model flips one bit of one weight on one rank (bare torchrun).
    "bitflip-replica": T + "test_bitflip.py::test_a_flipped_bit_in_one_replica_is_named_and_trained_away",
    # Peer recovery: each row's cases (W, replacement, who dies) run once per seed.
    "peer-sigkill-rank": R + "test_peer_recovery.py::test_sigkill_of_a_random_rank",
    "peer-kill-in-transfer": R + "test_peer_faults.py::test_kill_during_the_state_transfer",
    "peer-corrupt-transfer": R + "test_peer_faults.py::test_a_corrupt_chunk_is_never_trained_on",
    "peer-sigstop-fenced": R + "test_peer_faults.py::test_a_stalled_rank_is_fenced_when_it_wakes",
    "peer-two-ranks": R + "test_peer_faults.py::test_two_ranks_killed_at_once_shrink_to_one",
    "peer-agent-kill": W + "test_service_peer.py::test_a_killed_agent_is_one_recovery_timed_from_the_kill",
    "peer-kill-in-save-wait": W
    + "test_service_peer.py::test_a_loss_while_a_save_waits_for_the_service_ends_the_wait",
    "peer-sigstop-named": W
    + "test_service_peer.py::test_a_stopped_worker_is_named_with_the_last_step_it_completed",
    "peer-bitflip-replica": W
    + "test_service_peer.py::test_a_flipped_bit_in_one_of_three_replicas_is_trained_away_in_process",
}


@dataclass
class Tally:
    trials: int = 0
    passed: int = 0
    failed: list[int] = field(default_factory=list)
    notes: set[str] = field(default_factory=set)
    xfailed: int = 0

    @property
    def not_run(self) -> bool:
        """No trial of the row ran (skipped, or absent from the results)."""
        return self.trials == 0 and not self.xfailed


def draw_seeds(base: int, trials: int) -> list[int]:
    """``trials`` distinct seeds determined by ``base``."""
    rng = random.Random(base)
    return rng.sample(range(1, 1_000_000), trials)


def tally(junit: Path, rows: dict[str, str]) -> dict[str, Tally]:
    """Per-row results from a pytest junit XML file (test ids ``name[seed=N]``, or with other
    parameters next to the seed: ``name[sender-seed=N]``)."""
    by_func = {node.split("::")[-1]: row for row, node in rows.items()}
    out = {row: Tally() for row in rows}
    for case in ET.parse(junit).getroot().iter("testcase"):
        func, _, param = case.get("name", "").partition("[")
        row = by_func.get(func)
        if row is None:
            continue
        seed = next((p[5:] for p in param.rstrip("]").split("-") if p.startswith("seed=")), "")
        result = out[row]
        skipped = case.find("skipped")
        if skipped is not None and skipped.get("type") == "pytest.xfail":
            result.xfailed += 1  # ran and failed as a known defect says it does
            result.notes.add("known failure: " + skipped.get("message", "")[:200])
            continue
        if skipped is not None:
            result.notes.add("not run: " + skipped.get("message", "").removeprefix("Skipped: ")[:160])
            continue
        result.trials += 1
        if case.find("failure") is not None or case.find("error") is not None:
            result.failed.append(int(seed) if seed.isdigit() else -1)
        else:
            result.passed += 1
    for result in out.values():
        if result.trials == 0 and not result.notes:
            result.notes.add("not run: see the pytest output above the table")
    return out


def table(results: dict[str, Tally], *, base: int, seconds: float) -> str:
    lines = [
        "| row | trials | passed | failed seeds | notes |",
        "|---|---:|---:|---|---|",
    ]
    for row, r in results.items():
        failed = ", ".join(map(str, r.failed)) or "-"
        passed = "NOT RUN" if r.not_run else f"XFAIL {r.xfailed}" if r.xfailed else str(r.passed)
        lines.append(f"| {row} | {r.trials} | {passed} | {failed} | {'; '.join(sorted(r.notes)) or ''} |")
    lines.append("")
    not_run = [row for row, r in results.items() if r.not_run]
    if not_run:
        lines.append(f"**{len(not_run)} of {len(results)} rows NOT RUN** here: {', '.join(not_run)}.")
    lines.append(f"Base seed {base}; total runtime {seconds:.0f} s; rerun with `--seed {base}`.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.faults", description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--rows", default="", help=f"comma-separated subset of: {', '.join(ROWS)}")
    parser.add_argument("--seed", type=int, default=None, help="base seed (default: from the clock)")
    parser.add_argument("--out", default=".elastrain/faults.md")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds for the whole pytest run")
    args = parser.parse_args(argv)
    chosen = [r.strip() for r in args.rows.split(",") if r.strip()] or list(ROWS)
    unknown = [r for r in chosen if r not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    rows = {r: ROWS[r] for r in chosen}
    base = args.seed if args.seed is not None else int(time.time()) % 1_000_000
    seeds = draw_seeds(base, args.trials)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    junit = out.with_suffix(".junit.xml")
    env = dict(os.environ, ELASTRAIN_FAULT_SEEDS=",".join(map(str, seeds)), ELASTRAIN_FAULT_SWEEP="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    print(f"faults: base seed {base}, seeds {seeds}, rows {', '.join(rows)}", flush=True)
    started = time.monotonic()
    subprocess.run(cmd + list(rows.values()), cwd=REPO, env=env, timeout=args.timeout, check=False)
    results = tally(junit, rows)
    text = table(results, base=base, seconds=time.monotonic() - started)
    out.write_text(text)
    print(text, end="")
    return 1 if any(r.failed for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
