"""Compute threads per worker process: each worker gets its share of the cores it is given.

A node app is one torchrun agent. torchrun sets ``OMP_NUM_THREADS=1`` only when it starts several
processes, and in peer mode every node app is a one-process torchrun, so without a decision each
worker would start as many compute threads as the machine has cores, and the workers of every
job on the host would fight over them. The service decides instead, from what it gives a process:

* the local scheduler runs at most ``slots`` worker processes at once on a host of ``cores``
  cores: ``cores // slots`` threads per process, at least 1;
* on Kubernetes a pod requests ``resources.cpu`` cores for its ``nproc_per_node`` processes:
  ``cpu // nproc_per_node`` threads per process, at least 1; a pod without a CPU request gets no
  decision (it may use whatever its node has free).

torch's intra-op pool and OpenMP read ``OMP_NUM_THREADS`` when torch starts
(``torch.get_num_threads()`` follows it), so the environment variable is the whole decision. A
job whose own ``env`` sets ``OMP_NUM_THREADS`` decides for itself. The worker states the outcome
in its run record (:func:`worker.start.threads.record`), with the service's reason from
``ELASTRAIN_THREADS_REASON``. The decisions are pure; :func:`host_cores` and :func:`host_slots`
read the host.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from service.jobs.resources import parse_resources
from service.launch import hostgpus
from worker.jobspec.spec import JobSpec
from worker.start.threads import OMP, REASON_ENV


@dataclass(frozen=True, slots=True)
class Threads:
    """Threads per worker process (None: no decision) and why, in words for the run record."""

    count: int | None
    reason: str

    def env(self, spec: JobSpec) -> dict[str, str]:
        """What a node of ``spec`` adds to its environment: nothing when the job's ``env`` sets
        ``OMP_NUM_THREADS`` or there is no decision."""
        if OMP in spec.env:
            return {}
        if self.count is None:
            return {REASON_ENV: self.reason}
        return {OMP: str(self.count), REASON_ENV: self.reason}


def local(*, cores: int, slots: int) -> Threads:
    """On one host of ``cores`` cores running at most ``slots`` worker processes at once."""
    count = max(1, cores // max(1, slots))
    return Threads(
        count,
        f"the service: {cores} core(s) on this host for at most {slots} worker process(es) at once "
        f"(ELASTRAIN_LOCAL_SLOTS) gives each {count} thread(s)",
    )


def kubernetes(spec: JobSpec) -> Threads:
    """For a pod of ``spec``: its CPU request shared by its ``nproc_per_node`` processes."""
    cpu = parse_resources(spec.resources).cpu
    if cpu <= 0:
        return Threads(None, "the service: no CPU request (resources.cpu), so no thread count was set")
    count = max(1, cpu // spec.nproc_per_node)
    return Threads(
        count,
        f"the service: the pod's CPU request of {cpu} core(s) (resources.cpu) for "
        f"{spec.nproc_per_node} process(es) gives each {count} thread(s)",
    )


def host_cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def host_slots(setting: int | None) -> int:
    """Worker processes the local scheduler runs at once: ``ELASTRAIN_LOCAL_SLOTS`` when set,
    else the host's GPUs when it has any, else its CPU cores."""
    return setting if setting is not None else hostgpus.host_gpus() or host_cores()
