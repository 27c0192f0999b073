"""What the run record says about compute threads: how many this process uses and who decided.

The service sets ``OMP_NUM_THREADS`` for every node it launches (its reason in
``ELASTRAIN_THREADS_REASON``, see :mod:`service.launch.threads`) unless the job's ``env`` sets it;
torchrun sets 1 when it starts several processes; otherwise torch takes every core it sees.
Pure and torch-free: the caller passes the count torch reports.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

OMP = "OMP_NUM_THREADS"
REASON_ENV = "ELASTRAIN_THREADS_REASON"


def record(
    env: Mapping[str, str], *, job_env: Mapping[str, str], intra_op: int, inter_op: int
) -> dict[str, Any]:
    """The run record's ``threads`` entry: torch's intra- and inter-op threads, ``OMP_NUM_THREADS``
    as this process saw it, and who set it (the job's ``env``, the service, torchrun, or nobody)."""
    value = env.get(OMP)
    if OMP in job_env:
        source = "the job's env"
    elif REASON_ENV in env:
        source = env[REASON_ENV]
    elif value is not None:
        source = "the launcher (torchrun sets 1 when it starts several processes per node)"
    else:
        source = "nobody: torch uses every core it sees"
    return {"intra_op": intra_op, "inter_op": inter_op, OMP: value, "decided_by": source}
