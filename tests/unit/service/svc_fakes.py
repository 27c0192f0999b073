"""An in-memory scheduler and a settable clock for the control plane's unit tests."""

from __future__ import annotations

from collections.abc import Mapping

from service.reconciler import UNKNOWN, SchedulerStatus
from worker.spec import JobSpec


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeScheduler:
    """Launches nothing; records launches and cancels; tests set each app's status."""

    def __init__(self) -> None:
        self.launches: list[tuple[str, int, dict[str, str]]] = []
        self.states: dict[str, SchedulerStatus] = {}
        self.cancelled: list[str] = []
        self.refuse: str | None = None

    def launch(self, job_id: str, spec: JobSpec, node_index: int, env: Mapping[str, str]) -> str:
        assert spec.name and env["ELASTRAIN_JOB_ID"] == job_id
        if self.refuse:
            raise RuntimeError(self.refuse)
        handle = f"fake://{env['ELASTRAIN_LAUNCH_ID']}"
        self.launches.append((job_id, node_index, dict(env)))
        self.states[handle] = SchedulerStatus("running")
        return handle

    def status(self, handle: str) -> SchedulerStatus:
        return self.states.get(handle, UNKNOWN)

    def cancel(self, handle: str) -> None:
        self.cancelled.append(handle)
        if self.states.get(handle, UNKNOWN).state == "running":
            self.states[handle] = SchedulerStatus("failed", -15)

    def finish(self, launch_id: str, *, exit_code: int = 0) -> None:
        state = "succeeded" if exit_code == 0 else "failed"
        self.states[f"fake://{launch_id}"] = SchedulerStatus(state, exit_code)  # type: ignore[arg-type]

    @property
    def launch_ids(self) -> list[str]:
        return [env["ELASTRAIN_LAUNCH_ID"] for _, _, env in self.launches]
