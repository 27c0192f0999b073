"""Talking to the control plane from a worker: heartbeats, progress, events, checkpoint reports.

Active only when the service launched this worker (``ELASTRAIN_SERVICE_URL``,
``ELASTRAIN_WORKER_TOKEN`` and ``ELASTRAIN_JOB_ID`` are set). The service being away never stops
training: heartbeats, progress and events go through a bounded queue on a background thread and
are dropped (counted) when the queue is full; checkpoint reports are retried until their
timeout, and an unreachable coordinator makes the save abort, never publish twice.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from worker.checkpoint.commit import Report, report_to_json
from worker.checkpoint.coordinator import Outcome
from worker.jobspec.jsonlimits import finite
from worker.report.events import replace_line, straggler_line

log = logging.getLogger("elastrain.service_client")


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    url: str
    token: str
    job_id: str
    launch_id: str
    node_index: int

    @staticmethod
    def from_env(env: Mapping[str, str]) -> ServiceConfig | None:
        url, token, job = (
            env.get("ELASTRAIN_SERVICE_URL"),
            env.get("ELASTRAIN_WORKER_TOKEN"),
            env.get("ELASTRAIN_JOB_ID"),
        )
        if not (url and token and job):
            return None
        return ServiceConfig(
            url=url.rstrip("/"),
            token=token,
            job_id=job,
            launch_id=env.get("ELASTRAIN_LAUNCH_ID", "local"),
            node_index=int(env.get("ELASTRAIN_NODE_INDEX", "0") or 0),
        )


EVENT_RETRY_S = (0.5, 1.0, 2.0, 4.0, 8.0, 15.0)
"""Waits between attempts to deliver a lifecycle event: about 30 s, longer than a leader's lease
takes to pass to a standby."""


PERIOD_RANGE_S = (0.5, 300.0)
"""A period the service asks for is kept within this range."""


def _period(asked: object, current: float) -> float:
    """The period the service asked for, within :data:`PERIOD_RANGE_S`; ``current`` when it
    asked for none (an older service) or sent something else."""
    if isinstance(asked, bool) or not isinstance(asked, int | float) or asked != asked:
        return current
    low, high = PERIOD_RANGE_S
    return min(max(float(asked), low), high)


class ServiceClient:
    """Fire-and-forget callbacks plus the blocking checkpoint calls."""

    def __init__(
        self,
        cfg: ServiceConfig,
        *,
        heartbeat_s: float = 5.0,
        progress_s: float = 2.0,
        timeout_s: float = 5.0,
        event_retry_s: Sequence[float] = EVENT_RETRY_S,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.cfg = cfg
        self.base = f"{cfg.url}/v1/jobs/{cfg.job_id}"
        self.http = httpx.Client(
            headers={"Authorization": f"Bearer {cfg.token}"}, timeout=timeout_s, transport=transport
        )
        self.dropped = 0
        self.cancel_requested = False
        self._queue: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue(maxsize=256)
        self._stop = threading.Event()
        self._heartbeat_s = heartbeat_s
        self._progress_s = progress_s
        self._event_retry_s = tuple(event_retry_s)
        self._beat: dict[str, Any] | None = None
        self._progress: dict[str, Any] | None = None
        self._thread = threading.Thread(target=self._run, name="elastrain-service", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- fire and forget

    def send(self, path: str, body: dict[str, Any]) -> None:
        try:
            self._queue.put_nowait((path, body))
        except queue.Full:
            self.dropped += 1

    def heartbeat_from(self, local_rank: int) -> None:
        self._beat = {"launch_id": self.cfg.launch_id, "local_rank": local_rank, "step": None}

    def set_step(self, step: int) -> None:
        if self._beat is not None:
            self._beat["step"] = step

    def event(self, kind: str, **fields: Any) -> None:
        self.send("/workers/events", {"kind": kind, "node_index": self.cfg.node_index, **fields})

    def failed(
        self,
        line: str,
        *,
        rank: int,
        step: int | None,
        attempt: str,
        restartable: bool = True,
        ranks: Sequence[int] = (),
    ) -> None:
        """This rank stops with ``line`` (one line, what went wrong) at ``step`` (None: before
        training began) in ``attempt`` (see :func:`attempt_id`). The service fails the job when
        the next attempt stops with the same line at the same step: a deterministic error would
        only spend the remaining restarts; or at once when not ``restartable``. ``ranks``: those a
        timed-out collective waited for."""
        fields: dict[str, Any] = {} if restartable else {"restartable": False}
        if ranks:
            fields["lost_ranks"] = list(ranks)[:1024]
        self.event(
            "failed", rank=rank, step=step, group_id=attempt[:200], message=line.strip()[:2000], **fields
        )

    def progress(
        self, *, step: int, samples_seen: int, samples_per_s: float, loss: float | None, world_size: int
    ) -> None:
        """Hold the newest numbers; the thread posts them every ``progress_s`` (and at close).
        The trainer reports every ``log_every_steps``, many times a second on a small model."""
        body = {"step": step, "samples_seen": samples_seen, "samples_per_s": max(0.0, samples_per_s)}
        self._progress = body | {"loss": loss, "world_size": world_size}

    def _run(self) -> None:
        next_beat = next_progress = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if self._beat is not None and now >= next_beat:
                self._post("/workers/heartbeat", dict(self._beat))
                next_beat = now + self._heartbeat_s
            if now >= next_progress:
                self._send_progress()
                next_progress = now + self._progress_s
            # Sleep until the next beat or progress is due: an event or close() wakes it earlier.
            # (A fixed short poll woke each worker 5 times a second, on cores training shares.)
            due = min(next_progress, next_beat) if self._beat is not None else next_progress
            try:
                path, body = self._queue.get(timeout=max(0.05, due - time.monotonic()))
            except queue.Empty:
                continue
            try:
                if path:
                    self._post(path, body, retry=True)
            finally:
                self._queue.task_done()

    def _send_progress(self) -> None:
        body, self._progress = self._progress, None
        if body is not None:
            self._post("/workers/progress", body)

    def _post(self, path: str, body: dict[str, Any], *, retry: bool = False) -> None:
        """POST once; with ``retry`` (lifecycle events, which come only once) again after each
        delay of ``event_retry_s`` while the service answers 503 (a standby, or a failover in
        progress) or cannot be connected to: in both cases it did not apply the event. Heartbeats
        and progress are not retried: the next one supersedes them."""
        delays = iter(self._event_retry_s if retry else ())
        while True:
            try:
                answer = self.http.post(self.base + path, json=finite(body))  # the service refuses NaN
            except httpx.ConnectError as exc:
                failure = f"service unreachable: {exc}"
            except httpx.HTTPError as exc:  # sent, perhaps applied: not repeated
                log.warning("service unreachable for %s: %s", path, exc)
                return
            else:
                if answer.status_code == 200:
                    self._answered(answer.json())
                    return
                failure = f"service answered {answer.status_code}: {answer.text[:300]}"
                if answer.status_code != 503:
                    log.warning("%s to %s", failure, path)
                    return
            delay = next(delays, None)
            if delay is None or self._stop.wait(delay):
                if retry:
                    self.dropped += 1
                log.warning("%s to %s; given up", failure, path)
                return

    def _answered(self, ack: dict[str, Any]) -> None:
        """Take what an answer asks: whether the job is being cancelled, and how often to send
        heartbeats and progress (the service lengthens both as the ranks it serves grow)."""
        self.cancel_requested = bool(ack.get("cancel_requested", False))
        self._heartbeat_s = _period(ack.get("heartbeat_s"), self._heartbeat_s)
        self._progress_s = _period(ack.get("progress_s"), self._progress_s)

    def close(self, *, drain_s: float = 5.0) -> None:
        """Send what is queued, retries included (for at most ``drain_s``), then stop."""
        deadline = time.monotonic() + drain_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.05)
        self._stop.set()
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(("", {}))  # wake the thread now
        self._thread.join(timeout=drain_s)
        self._send_progress()  # the final numbers
        self.http.close()


class HttpCoordinator:
    """The control plane's checkpoint coordinator, seen from a rank (see worker.checkpoint)."""

    def __init__(
        self, client: ServiceClient, *, retry_s: float = 0.5, abandon: Callable[[], str | None] | None = None
    ) -> None:
        """``abandon``: asked while this rank waits for an outcome; a reason (peer mode: a member
        of the group is gone, so the round cannot complete before the group re-forms) ends the
        wait at once as an abort, where it would otherwise last to the collective timeout."""
        self.client = client
        self.retry_s = retry_s
        self.abandon = abandon

    def report(self, report: Report, *, seq: int) -> None:
        """Deliver the phase-1 report, retrying a while: the service may be restarting (5xx, no
        connection) or ask this job to slow down (429, after its Retry-After). Any other answer
        is final (a 409: the job has ended)."""
        body = report_to_json(report)
        deadline = time.monotonic() + 60.0
        while True:
            wait = self.retry_s
            try:
                answer = self.client.http.post(
                    self.client.base + "/workers/checkpoints",
                    params={"seq": seq},
                    content=body,
                    headers={"Content-Type": "application/json"},
                )
                if answer.status_code < 500 and answer.status_code != 429:
                    return
                wait = max(wait, retry_after(answer.headers.get("retry-after")))
            except httpx.HTTPError as exc:
                log.warning("checkpoint report for step %s not delivered yet: %s", report.step, exc)
            if time.monotonic() + wait > deadline:
                return  # the outcome poll will time out and the save aborts
            time.sleep(wait)

    def outcome(self, step: int, generation: int, *, seq: int, timeout: float) -> Outcome:
        """Poll until the service says published or aborted; no answer in time means abort."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            answer = self._ask(step, generation, seq)
            if answer is not None:
                return answer
            reason = self._pause(min(self.retry_s, max(deadline - time.monotonic(), 0.0)))
            if reason is not None:  # the service's answer wins if it has one (a member that saw
                # "published" may have finished and gone before this rank's next poll)
                return self._ask(step, generation, seq) or Outcome(False, step, generation, reason)
        return Outcome(False, step, generation, f"no answer from the service within {timeout:.0f}s")

    def _ask(self, step: int, generation: int, seq: int) -> Outcome | None:
        """The service's final answer for the round, or None (pending, or no answer)."""
        url = f"{self.client.base}/workers/checkpoints/{step}"
        try:
            answer = self.client.http.get(url, params={"generation": generation, "seq": seq})
            if answer.status_code == 200:
                raw = answer.json()
                if raw.get("status") in ("published", "aborted"):
                    return Outcome(
                        published=raw["status"] == "published",
                        step=step,
                        generation=generation,
                        reason=str(raw.get("reason", "")),
                        path=raw.get("path"),
                    )
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("checkpoint outcome for step %s unknown yet: %s", step, exc)
        return None

    def _pause(self, seconds: float) -> str | None:
        """Sleep between polls, asking ``abandon`` every 20 ms; its reason, if it gives one."""
        end = time.monotonic() + seconds
        while True:
            reason = self.abandon() if self.abandon is not None else None
            left = end - time.monotonic()
            if reason is not None or left <= 0:
                return reason
            time.sleep(min(left, 0.02) if self.abandon is not None else left)


def attempt_id(env: Mapping[str, str], generation: int | None) -> str:
    """One attempt of the worker group, the same on all its ranks: the generation the group agreed
    on; before the group exists, this node's launch and torchrun restart count."""
    if generation is not None:
        return f"generation-{generation}"
    launch = env.get("ELASTRAIN_LAUNCH_ID", "local")
    return f"{launch}-restart-{env.get('TORCHELASTIC_RESTART_COUNT', '0') or '0'}"


def retry_after(header: str | None) -> float:
    """Seconds a 429's ``Retry-After`` asks for (0 when absent or not a number; at most 30)."""
    try:
        return min(30.0, max(0.0, float(header or 0)))
    except ValueError:
        return 0.0


def from_env(env: Mapping[str, str] | None = None) -> ServiceClient | None:
    cfg = ServiceConfig.from_env(os.environ if env is None else env)
    return ServiceClient(cfg) if cfg else None


class EventForwarder:
    """An Events sink that turns the worker's own events into the service's callbacks. ``rank``
    and ``world_size`` follow the group: peer mode re-seats them at every re-formation. The
    group's rank 0 reports, except a peer-mode recovery (``recovery``, ``spare_promoted``), which
    its leader reports whatever its rank: only the leader knows it, and one process says it; and a
    rank's own leaving (``straggler_left``, a handed-off ``preempted``), which that rank reports."""

    def __init__(self, client: ServiceClient, *, rank: int, world_size: int, env: Mapping[str, str]) -> None:
        self.client, self.rank, self.world_size = client, rank, world_size
        self.launch_id = env.get("ELASTRAIN_LAUNCH_ID", "")
        self.group_id = ":".join(
            env.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "MASTER_PORT")
        )

    def __call__(self, event: str, fields: dict[str, Any]) -> None:
        client = self.client
        if event == "progress" and "step" in fields:
            client.set_step(int(fields["step"]))
        if event in ("recovery", "spare_promoted"):  # peer mode: from the recovery's leader, any rank
            client.event(event, **fields)
            return
        if event == "straggler_left":  # from the leaving rank itself, any rank
            step = int(fields["step"])
            what = f"rank {self.rank} of {self.launch_id or 'its node'} left the group after step {step}"
            client.event(event, rank=self.rank, step=step, message=f"{what}: its node ends for a spare")
            return
        if event == "preempted" and fields.get("handed_off"):  # peer mode: the leaving rank, any rank
            why = f"{fields.get('signal') or 'a signal'} received; rank {self.rank} left without a save"
            client.event("preempted", rank=self.rank, step=int(fields["step"]), message=why)
            return
        if self.rank != 0:
            return
        if event == "run_record":
            client.event(
                "group_formed",
                rank=0,
                group_id=str(fields.get("group_id") or self.group_id)[:200],
                world_size=self.world_size,
                restart_count=int(fields.get("restart_count", 0)),
            )
        elif event == "resumed":
            read = int(fields.get("bytes_read") or 0)
            client.event("state_loaded", rank=0, step=int(fields["step"]), bytes_from_storage=read)
        elif event == "progress":
            client.progress(
                step=int(fields["step"]),
                samples_seen=int(fields["samples_seen"]),
                samples_per_s=float(fields["samples_per_second"]),
                loss=fields.get("loss"),
                world_size=self.world_size,
            )
        elif event == "first_step":
            client.event("first_step", rank=0, step=int(fields["step"]))
        elif event == "finished":
            client.event("finished", rank=0, step=int(fields["step"]), message="training finished")
        elif event == "events_stopped":  # a full volume: the service's record says it instead
            message = f"events are no longer written to {fields['place']}: {fields['reason']}"
            client.event("log", rank=0, message=message)
        elif event == "straggler":
            client.event(
                "straggler",
                rank=int(fields["rank"]),
                step=int(fields["step"]),
                message=straggler_line(fields),
            )
        elif event in ("straggler_replaced", "straggler_kept"):
            leaves = event == "straggler_replaced"
            client.event(
                event,
                rank=int(fields["rank"]),
                step=int(fields["step"]),
                message=replace_line(leaves, fields),
            )
        elif event == "replica_mismatch":
            client.event(
                "replica_mismatch", rank=0, step=int(fields["step"]), message=str(fields["message"])[:2000]
            )
        elif event == "preempted":
            why = f"{fields.get('signal') or 'a peer'} received; saved in {fields.get('save_seconds')} s"
            client.event("preempted", rank=0, step=int(fields["step"]), message=why)


def forward_events(
    client: ServiceClient, *, rank: int, world_size: int, env: Mapping[str, str]
) -> EventForwarder:
    """The :class:`EventForwarder` of this rank."""
    return EventForwarder(client, rank=rank, world_size=world_size, env=env)
