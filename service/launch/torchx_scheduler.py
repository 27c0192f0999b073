"""Launch, watch and cancel node apps through TorchX (``local_cwd`` processes or ``kubernetes`` jobs).

:class:`TorchXScheduler` is the scheduler the reconciler drives
(:class:`service.launch.protocol.Scheduler`). Handles are strings that outlive this process:

* ``local_cwd:<node dir>``: the node runs under :mod:`service.launch.node_exec`, which records its
  process group and exit code in the node directory (also holding ``spec.json`` and TorchX's
  per-node logs), so a restarted service still reads a node's state and can cancel it.
* ``kubernetes://torchx/<namespace>:<volcano job>``: TorchX asks the API server; a member of a
  gang (:meth:`TorchXScheduler.launch_gang`) adds ``#<role>``, its task in that Volcano Job.

A launch is a plan, then its application: :meth:`TorchXScheduler.dryrun` returns what will be
started (:mod:`service.launch.dryrun`), :meth:`TorchXScheduler.schedule` starts exactly that.
Idempotent per launch id (the reconciler's name for one launch of one node slot): launching the
same id again returns the first handle and starts nothing.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from torchx import specs
from torchx.runner import Runner
from torchx.schedulers import get_scheduler_factories, local_scheduler

import service
from service.launch.apps import SchedulerSettings, local_node_app
from service.launch.dryrun import (
    KUBERNETES,
    LOCAL,
    KubernetesLaunch,
    LocalLaunch,
    gang_role,
    kubernetes_gang_request,
    kubernetes_request,
)
from service.launch.node_exec import EXIT_FILE, NODE_FILE
from service.launch.protocol import NodeLaunch, NodeStatus
from worker.errors import ElastrainError
from worker.jobspec.spec import spec_json

log = logging.getLogger("elastrain.scheduler")
LOCAL_PREFIX = "local_cwd:"
GANG_SEP = "#"
CANCELLED_FILE = "cancelled"
SPEC_FILE = "spec.json"
_RUNNING = {
    specs.AppState.UNSUBMITTED,
    specs.AppState.SUBMITTED,
    specs.AppState.PENDING,
    specs.AppState.RUNNING,
}


class SchedulerError(ElastrainError):
    """A node app could not be launched or cancelled."""


def status_from_app_state(state: specs.AppState | None) -> NodeStatus:
    """TorchX's app state -> ours (a cancelled app counts as failed). Pure."""
    if state is None:
        return NodeStatus("unknown", message="the scheduler does not know this app")
    if state in _RUNNING:
        return NodeStatus("running")
    if state == specs.AppState.SUCCEEDED:
        return NodeStatus("succeeded", 0)
    if state in (specs.AppState.FAILED, specs.AppState.CANCELLED):
        return NodeStatus("failed", message=f"torchx state {state.name}")
    return NodeStatus("unknown", message=f"torchx state {state.name}")


def status_from_records(
    node: Mapping[str, Any] | None, ended: Mapping[str, Any] | None, *, alive: bool, cancelled: bool
) -> NodeStatus:
    """A local node's state from its records (see :mod:`service.launch.node_exec`). Pure."""
    note = "cancelled" if cancelled else ""
    if ended is not None:
        code = int(ended["exit_code"])
        at = ended.get("ended_at")
        when = float(at) if isinstance(at, int | float) and not isinstance(at, bool) else None
        return NodeStatus("succeeded" if code == 0 else "failed", code, note, ended_at=when)
    if node is None:
        return NodeStatus("unknown", message="the node never started (no node.json)")
    if alive:
        return NodeStatus("running", message=note)
    return NodeStatus("failed", None, note or "the node's wrapper died without recording an exit code")


class TorchXScheduler:
    """The reconciler's scheduler: one TorchX app per node. ``cancel`` is idempotent."""

    def __init__(
        self, settings: SchedulerSettings, *, runner: Runner | None = None, cancel_grace_s: float = 10.0
    ) -> None:
        self._settings = settings
        self._cancel_grace_s = cancel_grace_s
        self._runner = runner or quiet_runner()
        self._torchx: dict[str, str] = {}
        if settings.scheduler == LOCAL:
            _create_keeping_signal_handlers(self._runner, LOCAL)

    def close(self) -> None:
        """Close the TorchX runner. TorchX's local scheduler terminates the local nodes it
        started in this process; a process that dies without closing leaves them running."""
        self._runner.close()

    # -- launch: plan, then apply ------------------------------------------------------
    def launch(self, node: NodeLaunch) -> str:
        """Start ``node``; returns its handle. Exactly :meth:`schedule` of :meth:`dryrun`."""
        return self.schedule(self.dryrun(node))

    def dryrun(self, node: NodeLaunch) -> LocalLaunch | KubernetesLaunch:
        """What launching ``node`` will do, as a value; starts and writes nothing."""
        if self._settings.scheduler == KUBERNETES:
            return KubernetesLaunch(kubernetes_request(node, self._settings))
        node_dir = (Path(self._settings.log_root) / node.job_id / node.launch_id).absolute()
        spec_path = node_dir / SPEC_FILE
        app = local_node_app(
            node,
            self._settings,
            node_dir=str(node_dir),
            spec_path=str(spec_path),
            python=sys.executable,
            workdir=os.getcwd(),
            import_root=str(Path(service.__file__).resolve().parent.parent),
        )
        log_dir = node_dir / "logs"
        request = self._runner.dryrun(app, LOCAL, cfg={"log_dir": str(log_dir)})
        return LocalLaunch(
            handle=LOCAL_PREFIX + str(node_dir),
            node_dir=node_dir,
            spec_path=spec_path,
            spec_json=spec_json(node.spec),
            log_dir=log_dir,
            request=request,
        )

    @property
    def gangs(self) -> bool:
        """Whether :meth:`launch_gang` starts nodes together (on Kubernetes, through Volcano)."""
        return self._settings.scheduler == KUBERNETES

    def dryrun_gang(self, nodes: Sequence[NodeLaunch]) -> KubernetesLaunch:
        """What :meth:`launch_gang` will submit: one Volcano Job of ``nodes``; starts nothing."""
        if not self.gangs:
            raise SchedulerError(f"{self._settings.scheduler} starts no gang; launch the nodes one by one")
        return KubernetesLaunch(kubernetes_gang_request(nodes, self._settings))

    def launch_gang(self, nodes: Sequence[NodeLaunch]) -> list[str]:
        """Start ``nodes`` as one gang: Volcano places all of their pods or none. Returns their
        handles, in order. Idempotent per the first node's launch id. A member that ends leaves
        the others running; cancelling a running member stops the whole gang (Volcano deletes a
        Job's pods together)."""
        handle = self._schedule_kubernetes(self.dryrun_gang(nodes))
        return [f"{handle}{GANG_SEP}{gang_role(node.node_index)}" for node in nodes]

    def schedule(self, plan: LocalLaunch | KubernetesLaunch) -> str:
        """Perform a :meth:`dryrun` value; returns the node's handle. Idempotent per launch id: a
        node directory (local) or a Volcano Job (kubernetes) that already exists is that launch."""
        if isinstance(plan, KubernetesLaunch):
            return self._schedule_kubernetes(plan)
        if plan.node_dir.exists() and not cut_off(plan.node_dir, _commands()):
            return plan.handle  # launched before
        if plan.node_dir.exists():
            log.warning(
                "%s: its launch was cut off before the node started; launching it", plan.node_dir.name
            )
        plan.node_dir.mkdir(parents=True, exist_ok=True)
        plan.spec_path.write_text(plan.spec_json, encoding="utf-8")
        try:
            torchx_handle = self._runner.schedule(plan.request)
        except Exception as exc:
            raise SchedulerError(f"local_cwd could not start {plan.node_dir.name}: {exc}") from exc
        (plan.node_dir / "torchx_handle").write_text(torchx_handle, encoding="utf-8")
        self._torchx[plan.handle] = torchx_handle
        return plan.handle

    def _schedule_kubernetes(self, plan: KubernetesLaunch) -> str:
        try:
            return self._runner.schedule(plan.request)
        except ValueError as exc:
            if "already exists" in str(exc):  # launched before under this launch id
                return f"kubernetes://{self._runner.name()}/{plan.namespace}:{plan.name}"
            raise SchedulerError(f"kubernetes refused {plan.name}: {exc}") from exc

    # -- status --------------------------------------------------------------------------
    def status(self, handle: str) -> NodeStatus:
        """The node's state now; ``unknown`` if no record of it can be found."""
        if not handle.startswith(LOCAL_PREFIX):
            return status_from_app_state(self._kubernetes_state(handle))
        node_dir = Path(handle.removeprefix(LOCAL_PREFIX))
        torchx_handle = self._torchx.get(handle)
        if torchx_handle is not None:
            self._torchx_state(torchx_handle)  # also reaps the finished wrapper process
        node = _read_json(node_dir / NODE_FILE)
        return status_from_records(
            node,
            _read_json(node_dir / EXIT_FILE),
            alive=node is not None and _alive(int(node["pid"]), node_dir),
            cancelled=(node_dir / CANCELLED_FILE).exists(),
        )

    def _kubernetes_state(self, handle: str) -> specs.AppState | None:
        """A Volcano Job's state, or for a gang member its own task's."""
        app_handle, _, role = handle.partition(GANG_SEP)
        if not role:
            return self._torchx_state(app_handle)
        try:
            status = self._runner.status(app_handle)
        except Exception:
            return None
        if status is None:
            return None
        for role_status in status.roles:
            if role_status.role == role and role_status.replicas:
                return role_status.replicas[0].state  # TorchX's ReplicaState is its AppState
        return status.state  # before Volcano counts the task: the Job's own state

    def _torchx_state(self, torchx_handle: str) -> specs.AppState | None:
        try:
            status = self._runner.status(torchx_handle)
        except Exception:  # an unknown session or scheduler: say unknown, never crash the loop
            return None
        return None if status is None else status.state

    # -- cancel --------------------------------------------------------------------------
    def cancel(self, handle: str) -> None:
        """Stop the node without waiting: SIGTERM to its first process, the node wrapper, as a
        kubelet sends it (the wrapper passes it to torchrun, which passes it to its workers:
        they save and exit); if it still runs ``cancel_grace_s`` later, SIGKILL to the group and
        every process below it (from a timer, and from any repeated cancel). Idempotent:
        cancelling an ended, cancelled or unknown node is a no-op."""
        if not handle.startswith(LOCAL_PREFIX):
            self._cancel_kubernetes(handle)
            return
        node_dir = Path(handle.removeprefix(LOCAL_PREFIX))
        node = _read_json(node_dir / NODE_FILE)
        if node is None or (node_dir / EXIT_FILE).exists() or not _alive(int(node["pid"]), node_dir):
            return
        pid, pgid = int(node["pid"]), int(node["pgid"])
        marker = node_dir / CANCELLED_FILE
        if not marker.exists():
            marker.write_text(str(time.time()), encoding="utf-8")
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGTERM)
            timer = threading.Timer(self._cancel_grace_s, self._escalate, args=(handle, pid, pgid))
            timer.daemon = True
            timer.start()
        elif time.time() - _float(marker.read_text(encoding="utf-8")) >= self._cancel_grace_s:
            self._escalate(handle, pid, pgid)

    def _escalate(self, handle: str, pid: int, pgid: int) -> None:
        node_dir = Path(handle.removeprefix(LOCAL_PREFIX))
        torchx_handle = self._torchx.get(handle)
        if torchx_handle is not None:
            self._torchx_state(torchx_handle)  # reaps our child if it has exited
        if _alive(pid, node_dir):
            log.warning("node %s ignored SIGTERM for %.0fs; sending SIGKILL", node_dir, self._cancel_grace_s)
            # torchrun's workers run in sessions of their own: kill them by ancestry, not by group.
            workers = _descendants(pid)
            _signal_group(pgid, signal.SIGKILL)
            for child in workers:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(child, signal.SIGKILL)

    def _cancel_kubernetes(self, handle: str) -> None:
        app_handle, _, role = handle.partition(GANG_SEP)
        if role and self._kubernetes_state(handle) not in _RUNNING:
            return  # this member ended: the gang's others go on
        try:
            self._runner.cancel(app_handle)
        except Exception as exc:
            if getattr(exc, "status", None) == 404:  # already deleted
                return
            raise SchedulerError(f"could not cancel {handle}: {exc}") from exc

    def log_dir(self, handle: str) -> Path | None:
        """Where a local node's stdout/stderr files are (``None`` for kubernetes)."""
        if not handle.startswith(LOCAL_PREFIX):
            return None
        return Path(handle.removeprefix(LOCAL_PREFIX)) / "logs"


class _CWDWithoutCombinedLog(local_scheduler.CWDImageProvider):
    """TorchX's ``local_cwd`` image provider, minus the combined stdout+stderr log: TorchX fills
    it from a thread that polls both files ten times a second in the service for as long as the
    node runs, a wake-up that lands on the training cores (nothing here reads that file; the
    node's stdout.log and stderr.log stay)."""

    def get_replica_param(
        self,
        img_root: str,
        role: specs.Role,
        stdout: str | None = None,
        stderr: str | None = None,
        combined: str | None = None,
    ) -> local_scheduler.ReplicaParam:
        return super().get_replica_param(img_root, role, stdout, stderr, None)


def quiet_runner() -> Runner:
    """A TorchX runner whose ``local_cwd`` scheduler starts no log-combining thread."""
    factories = dict(get_scheduler_factories())
    factories["local_cwd"] = functools.partial(
        local_scheduler.create_scheduler, image_provider_class=_CWDWithoutCombinedLog
    )
    return Runner("torchx", factories)


def _create_keeping_signal_handlers(runner: Runner, scheduler: str) -> None:
    """Create TorchX's scheduler now, then restore SIGTERM/SIGINT: its local scheduler installs
    handlers that raise in the main thread, which would replace the service's (uvicorn's)."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    runner._scheduler(scheduler)  # TorchX creates schedulers lazily; force it while we watch
    if threading.current_thread() is threading.main_thread():
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc; empty where there is none)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if not entry.name.isdigit():
            continue
        try:
            ppid = int(
                (entry / "stat").read_text(encoding="ascii", errors="replace").rsplit(")", 1)[1].split()[1]
            )
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 0.0


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def cut_off(node_dir: Path, commands: Iterable[bytes]) -> bool:
    """A launch begun and never started: the node's directory exists, its wrapper recorded
    neither its start nor its end, and none of ``commands`` (the machine's processes' command
    lines) runs anything of the node (each names the directory, see :func:`_alive`). A service
    killed between making the directory and starting the wrapper leaves this; without it, every
    later launch of the node would take the directory for a node that runs."""
    if (node_dir / NODE_FILE).exists() or (node_dir / EXIT_FILE).exists():
        return False
    mark = str(node_dir).encode()
    return not any(mark in command for command in commands)


def _commands() -> Iterator[bytes]:
    """The command line of every other process of this machine (Linux /proc)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            try:
                yield (entry / "cmdline").read_bytes()
            except OSError:
                continue


def _alive(pid: int, node_dir: Path) -> bool:
    """Is ``pid`` still the (non-zombie) wrapper of this node? Guards against pid reuse."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return False
    if stat.rsplit(")", 1)[-1].split()[:1] == ["Z"]:
        return False
    return str(node_dir).encode() in cmdline
