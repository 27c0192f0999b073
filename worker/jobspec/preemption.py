"""The JobSpec's ``preemption`` field: how long a graceful stop may take. Torch-free, like
:mod:`worker.jobspec.spec`, which embeds it.

A SIGTERM (a kubelet evicting a pod, a drained or reclaimed node, a cancel) asks the group to
stop at its next commit point, save the step it reached and exit. ``grace_s`` is the time the
sender allows before its SIGKILL: the chart sets the pods' ``terminationGracePeriodSeconds``
from it and torchrun's ``--shutdown-timeout`` is set to it, so that neither kills a save that
would finish in time.
"""

from __future__ import annotations

from pydantic import Field

from worker.jobspec.limits import Frozen

DEFAULT_GRACE_S = 25.0
"""Below Kubernetes' default grace period (30 s), leaving the kubelet a margin."""


class PreemptionSpec(Frozen):
    grace_s: float = Field(
        default=DEFAULT_GRACE_S,
        gt=0,
        le=3600,
        description=(
            "Seconds from a SIGTERM to the processes' exit: enough for one step, one checkpoint "
            "save and its publish. The pods' terminationGracePeriodSeconds is this plus a margin."
        ),
    )
