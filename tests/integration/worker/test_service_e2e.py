"""The whole system as a user drives it: the `elastrain serve` console script (embedded etcd, the
local TorchX scheduler), real torchrun workers on CPU/gloo, REST calls. Compared with a bare
`torchrun -m worker` run.

Workers run at their real step rate, except in the scale test, which needs the job to outlast
two re-forms (see there). A fault is injected with a failpoint at a fixed place, and the test
checks the failpoint's marker in the node's log, so it cannot pass without the fault.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from scripts.demo import process_env, worker_pids
from scripts.prometheus_tools import ensure_tools
from service.cli import main as elastrain
from service.jobs.recovery import PHASES
from service.ports import free_port
from tests import evidence
from tests.integration.launch import REPO, run_worker, worker_env, write_spec
from tests.integration.worker.traces import committed
from tests.waiting import eventually

pytestmark = pytest.mark.integration


def job_spec(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "name": "e2e",
        "model": {"name": "mlp", "kwargs": {"hidden": 32, "norm": "layer"}},
        "data": {"name": "synthetic", "samples": 1024},
        "micro_batch_size": 8,
        "grad_accum_steps": 2,
        "max_steps": 60,
        "seed": 5,
        "deterministic": True,
        "log_every_steps": 5,
        "checkpoint": {"interval_steps": 10, "retention": {"keep_latest": 50}},
        "nodes": "1",
        "nproc_per_node": 2,
        "max_restarts": 3,
    }
    return base | over


ELASTRAIN = Path(sys.executable).with_name("elastrain")  # the console script the package declares


class Service:
    """The ``elastrain serve`` console script in a subprocess; restartable on the same data dir
    (``env`` may change between starts). Its logs: ``service-<n>.log``, one per start."""

    def __init__(
        self,
        data_dir: Path,
        env: dict[str, str],
        *,
        etcd: str = "",
        token: str | None = None,
        worker_port: int | None = None,
    ) -> None:
        """``etcd``: endpoints of an etcd of the test's (default: the service's embedded one);
        ``token``: the API token, to share one between replicas (default: a new one);
        ``worker_port``: ``serve --worker-port`` (default: none, workers call the API's port)."""
        self.data_dir, self.env, self.etcd, self.worker_port = data_dir, env, etcd, worker_port
        self.port, self.token = free_port(), token or secrets.token_urlsafe(24)
        self.url = f"http://127.0.0.1:{self.port}"
        self.http = httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {self.token}"}, timeout=10
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        evidence.keep(lambda: self.proc is not None and self.proc.poll() is None, self.logs)

    def start(self) -> None:
        assert ELASTRAIN.exists(), f"no elastrain console script next to {sys.executable}: run `make venv`"
        # Many small jobs run at once here: slots beyond the cores unless a test sets its own.
        env = worker_env({"ELASTRAIN_LOCAL_SLOTS": "64"} | self.env) | {"ELASTRAIN_API_TOKEN": self.token}
        self.starts += 1
        log = (self.data_dir / f"service-{self.starts}.log").open("w")
        cmd = [str(ELASTRAIN), "serve", "--port", str(self.port), "--data-dir", str(self.data_dir)]
        cmd += ["--etcd", self.etcd] if self.etcd else []
        cmd += ["--worker-port", str(self.worker_port)] if self.worker_port else []
        self.proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        until(lambda: self._ready(), "the service to be ready", 120)

    def log(self) -> str:
        """Everything the service wrote, start after start."""
        logs = sorted(self.data_dir.glob("service-*.log"), key=lambda p: int(p.stem.split("-")[1]))
        return "".join(p.read_text(errors="replace") for p in logs)

    def logs(self) -> dict[str, str]:
        """The service's log and each node's stderr, by name (what a failed test shows)."""
        out = {f"service {self.data_dir}": self.log()}
        for path in self._output_files("*"):
            out[str(path.relative_to(self.data_dir))] = path.read_text(errors="replace")
        return out

    def _output_files(self, job_id: str, stream: str = "stderr") -> list[Path]:
        """The stderr (or ``stream``) files of the nodes of ``job_id`` (a glob: ``*`` for every
        job's; ``job_id/launch_id`` for one node's)."""
        return [p for p in sorted((self.data_dir / "nodes").glob(f"{job_id}/**/{stream}*")) if p.is_file()]

    def job_dir(self, job_id: str) -> str:
        """The job's checkpoint directory (where the service keeps it: no request needed)."""
        return str(self.data_dir / "checkpoints" / job_id)

    def launches(self, job_id: str) -> list[str]:
        """The job's launches by this service: the node directories the real scheduler made."""
        return sorted(p.name for p in (self.data_dir / "nodes" / job_id).glob("*") if p.is_dir())

    def node_logs(self, job_id: str) -> str:
        """Everything the job's nodes (torchrun agents and their workers) wrote to stderr."""
        return "".join(p.read_text(errors="replace") for p in self._output_files(job_id))

    def node_output(self, job_id: str, launch_id: str) -> str:
        """Everything one node's processes wrote to stdout (the workers' JSON event lines)."""
        files = self._output_files(f"{job_id}/{launch_id}", "stdout")
        return "".join(p.read_text(errors="replace") for p in files)

    def _ready(self) -> bool:
        try:
            return self.http.get("/readyz").status_code == 200
        except httpx.HTTPError:
            return False

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def submit(self, spec: dict[str, Any]) -> str:
        answer = self.http.post("/v1/jobs", json=spec)
        assert answer.status_code == 201, answer.text
        return str(answer.json()["id"])

    def job(self, job_id: str) -> dict[str, Any]:
        data: dict[str, Any] = self.http.get(f"/v1/jobs/{job_id}").json()
        return data

    def finished(self, job_id: str, timeout: float = 400) -> dict[str, Any]:
        result: dict[str, Any] = until(
            lambda: (j := self.job(job_id))["state"] in ("SUCCEEDED", "FAILED", "CANCELLED") and j,
            f"job {job_id} to finish",
            timeout,
        )
        return result


def until(check: Callable[[], Any], what: str, timeout: float) -> Any:
    """:func:`tests.waiting.eventually` on the service's HTTP API (not answering yet: false)."""
    return eventually(what, check, timeout, every=0.3, ignoring=(httpx.HTTPError,))


@pytest.fixture
def start_service(tmp_path: Path) -> Iterator[Callable[[dict[str, str]], Service]]:
    """Start a service with an environment of the test's (inherited by the nodes it launches)."""
    started: list[Service] = []

    def start(env: dict[str, str]) -> Service:
        svc = Service(tmp_path / f"svc{len(started) or ''}", env)
        svc.data_dir.mkdir()
        started.append(svc)
        svc.start()
        return svc

    yield start
    for svc in started:
        svc.stop()


@pytest.fixture
def service(start_service: Callable[[dict[str, str]], Service]) -> Service:
    return start_service({})


def bare_run_digest(tmp: Path, **over: Any) -> str:
    """``job_spec(**over)`` on a bare torchrun (2 processes, a checkpoint every 10 steps): its
    final checkpoint digest, which the same job must end with under the service."""
    spec = job_spec(**over) | {"checkpoint": {"dir": str(tmp / "ck"), "interval_steps": 10}}
    run = run_worker(write_spec(tmp, spec), nproc=2)
    assert run.code == 0, run.stderr[-3000:]
    return digest(tmp / "ck")


@pytest.fixture(scope="module")
def bare_digest(tmp_path_factory: pytest.TempPathFactory) -> str:
    return bare_run_digest(tmp_path_factory.mktemp("bare"))


def digest(path: Path) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "service", "checkpoint", "digest", str(path)],
        capture_output=True, text=True, cwd=REPO, check=True,
    )  # fmt: skip
    return out.stdout.split()[0]


def test_submitted_job_succeeds_and_equals_a_bare_torchrun_run(service: Service, bare_digest: str) -> None:
    job_id = service.submit(job_spec())
    final = service.finished(job_id)
    assert final["state"] == "SUCCEEDED", final
    listed = service.http.get(f"/v1/jobs/{job_id}/checkpoints").json()["checkpoints"]
    assert [c["step"] for c in listed][-1] == 60 and all(c["world_size"] == 2 for c in listed)
    assert digest(Path(final["checkpoint_dir"])) == bare_digest


# Rank 1 SIGKILLs itself in its 15th training window of the first attempt: after the step-10
# checkpoint (saves are synchronous, so it is published before step 11 trains), before step 20.
KILL_RANK_1 = "after_grad_sync=kill@1#15^0"


def test_sigkill_of_a_worker_recovers_and_finishes_bit_for_bit(
    start_service: Callable[[dict[str, str]], Service], bare_digest: str
) -> None:
    service = start_service({"ELASTRAIN_FAILPOINTS": KILL_RANK_1})
    job_id = service.submit(job_spec())
    final = service.finished(job_id)
    logs = service.node_logs(job_id)
    assert "elastrain failpoint after_grad_sync: kill" in logs, "the kill never happened"
    # torchrun's agent stops the survivor with SIGTERM before it starts the group again: the
    # survivor leaves at once instead of being killed after the agent's 30 s
    assert "Unable to shutdown process" not in logs, logs[-3000:]
    assert final["state"] == "SUCCEEDED", final
    assert final["restarts"] == 1
    recovery = final["recoveries"][-1]
    assert recovery["first_step_at"] is not None and recovery["resumed_step"] == 10, recovery
    assert digest(Path(final["checkpoint_dir"])) == bare_digest
    check_recovery_metrics(service, job_id)


def test_scale_two_three_one_keeps_every_sample_once(tmp_path: Path) -> None:
    trace = tmp_path / "trace"
    trace.mkdir()
    # The one test that slows every step (0.1 s): it scales twice while the job trains, and each
    # scale re-forms the group (seconds), so at the real step rate (~1 ms) the 96 steps would be
    # over before the test could act. Races at real step rates are the other tests' business.
    # Rank 0 also pauses 15 s at its 10th step (the scale-up is asked for from step 5): a joining
    # node starts a process and imports torch, which on a loaded machine can take longer than the
    # 96 slowed steps: the job would end at world size 3 before the scale-down could come.
    failpoints = "after_grad_sync=sleep:15@0#10^0,after_grad_sync=sleep:0.1"
    env = {"ELASTRAIN_FAILPOINTS": failpoints, "ELASTRAIN_TRACE_SAMPLES": str(trace)}
    svc = Service(tmp_path / "svc", env)
    svc.data_dir.mkdir()
    svc.start()
    try:
        spec = job_spec(nodes="1:3", initial_nodes=2, nproc_per_node=1, max_steps=96, grad_accum_steps=None,
                        global_batch_size=48, data={"name": "synthetic", "samples": 1536})  # fmt: skip
        job_id = svc.submit(spec)
        for nodes in (3, 1):
            until(
                lambda: svc.job(job_id)["state"] == "RUNNING" and (svc.job(job_id)["step"] or 0) >= 5,
                "progress",
                200,
            )
            assert svc.http.post(f"/v1/jobs/{job_id}/scale", json={"nodes": nodes}).status_code == 202
            # the rescale is over and the job trains at the new size (or, after the scale-down,
            # finished there: it has about 3 s of training left), and saved there
            until(functools.partial(at_world_size, svc, job_id, nodes), f"world size {nodes}", 200)
            until(functools.partial(saved_at, svc, job_id, nodes), f"a checkpoint at world size {nodes}", 200)
        final = svc.finished(job_id)
    finally:
        svc.stop()
    assert final["state"] == "SUCCEEDED", final
    sizes = {c["world_size"] for c in svc_checkpoints(final)}
    assert sizes == {2, 3, 1}, sizes
    # Each checkpoint's run record, and the run record on disk, say the world they trained in.
    for manifest in svc_checkpoints(final):
        assert manifest["run_record"]["world_size"] == manifest["world_size"], manifest["run_record"]
    record = json.loads((Path(final["checkpoint_dir"]) / "run-record.json").read_text())
    assert record["world_size"] == record["batch"]["world_size"] == 1 and record["spec_hash"], record
    seen = committed(trace)
    assert set(seen.values()) == {1}, "a sample was trained on twice in one epoch"
    assert {i for (e, i) in seen if e == 0} == set(range(1536)) and {e for e, _ in seen} == {0, 1, 2}
    # Peer mode (auto under the service): the 2 -> 3 join is no incident in the run's report, as
    # it is none in the job record.
    grown = [i for i in events_of(Path(final["checkpoint_dir"]) / "events.jsonl", "recovery_incident")
             if i["world_after"] > i["world_before"]]  # fmt: skip
    assert not grown and not final["recoveries"], (grown, final["recoveries"])
    # The join kept the survivors' DDP wrappers (their buckets as they were: the newcomer's agreed)
    transfers = events_of(Path(final["checkpoint_dir"]) / "events.jsonl", "state_transferred")
    assert any(t["ddp_carried_over"] for t in transfers), transfers


def at_world_size(svc: Service, job_id: str, world_size: int) -> bool:
    """The job trains at ``world_size`` (GET's world size is its newest progress's, as fresh as
    its step), or finished there."""
    job = svc.job(job_id)
    return bool(job["world_size"] == world_size and job["state"] in ("RUNNING", "SUCCEEDED"))


def saved_at(svc: Service, job_id: str, world_size: int) -> bool:
    """A checkpoint saved at ``world_size`` is published (the job's last one counts too)."""
    listed = svc.http.get(f"/v1/jobs/{job_id}/checkpoints").json()["checkpoints"]
    return any(c["world_size"] == world_size for c in listed)


def check_recovery_metrics(svc: Service, job_id: str) -> None:
    """The service's /metrics page after a real recovery (a real worker SIGKILLed under the real
    scheduler): the series the recovery dashboard and the slow-recovery alert read are there,
    with that one recovery in them, and promtool accepts the page."""
    page = svc.http.get("/metrics").text
    samples = [s for f in text_string_to_metric_families(page) for s in f.samples]

    def values(name: str, **labels: str) -> list[float]:
        return [s.value for s in samples if s.name == name and labels.items() <= s.labels.items()]

    assert values("elastrain_job_recovery_seconds_count") == [1.0], "one recovery, observed once"
    phases = {s.labels["phase"] for s in samples if s.name == "elastrain_job_recovery_phase_seconds_count"}
    assert phases and all(set(p.split("+")) <= set(PHASES) for p in phases), phases
    assert any(p.endswith("first_step") for p in phases), f"no phase ends at the first step: {phases}"
    assert len(values("elastrain_job_rollback_steps_total", job_id=job_id)) == 1
    check = ensure_tools().promtool_run("check", "metrics", stdin=page.encode())
    assert check.returncode == 0 and not check.stdout.strip(), check.stdout + check.stderr


def events_of(path: Path, name: str) -> list[dict[str, Any]]:
    """The run's events called ``name`` (its ``events.jsonl``, what ``elastrain report`` reads)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["event"] == name]


def svc_checkpoints(final: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for manifest in sorted(Path(final["checkpoint_dir"]).glob("step-*/manifest.json")):
        out.append(json.loads(manifest.read_text()))
    return out


# Rank 0 pauses in window 12 of the first attempt (after the step-10 checkpoint): the one place
# the test needs time to act, to kill the service while the job is provably in the middle of
# its run. Every other step runs at the real rate.
PAUSE_AT_12 = "after_grad_sync=sleep:10@0#12^0"


def test_service_kill9_and_restart_keeps_the_job(tmp_path: Path, bare_digest: str) -> None:
    """While the service is down the workers carry on, and the next save waits for the
    coordinator to answer again (its reports are retried), so nothing is lost or restarted."""
    svc = Service(tmp_path / "svc", {"ELASTRAIN_FAILPOINTS": PAUSE_AT_12})
    svc.data_dir.mkdir()
    svc.start()
    try:
        job_id = svc.submit(job_spec())
        until(lambda: "after_grad_sync: sleep" in svc.node_logs(job_id), "rank 0 paused at step 12", 200)
        svc.kill9()
        ck = Path(svc.job_dir(job_id))
        # The service is gone and no save publishes without it: the kill landed mid-job.
        assert (ck / "latest").read_text().strip() == "step-00000010", "the kill came after step 20"
        svc.start()
        final = svc.finished(job_id)
    finally:
        svc.stop()
    assert final["state"] == "SUCCEEDED", final
    assert len(final["nodes"]) == 1 and final["nodes"][0]["attempt"] == 0, final["nodes"]
    assert final["restarts"] == 0
    assert digest(Path(final["checkpoint_dir"])) == bare_digest


def test_workers_call_a_port_of_their_own(tmp_path: Path) -> None:
    """`serve --worker-port`: the nodes are told that port, not the API's, and a job whose ranks
    beat, report progress and publish checkpoints through it alone succeeds; users keep the
    API's port."""
    svc = Service(tmp_path / "svc", {}, worker_port=free_port())
    svc.data_dir.mkdir()
    svc.start()
    try:
        job_id = svc.submit(job_spec(max_steps=20))
        env = process_env(until(lambda: worker_pids(job_id), f"a worker of {job_id}", 120)[0])
        workers_url = f"http://127.0.0.1:{svc.worker_port}"
        assert env["ELASTRAIN_SERVICE_URL"] == workers_url and svc.url != workers_url
        assert env["ELASTRAIN_KV_GATEWAY"] == f"{workers_url}/v1/jobs/{job_id}/kv"
        final = svc.finished(job_id)
        assert final["state"] == "SUCCEEDED" and final["step"] == 20, final
        listed = svc.http.get(f"/v1/jobs/{job_id}/checkpoints").json()["checkpoints"]
        assert [c["step"] for c in listed][-1] == 20
        assert f"workers' calls on http://127.0.0.1:{svc.worker_port}" in svc.log()
    finally:
        svc.stop()
    assert svc.proc is not None and svc.proc.returncode == 0, svc.log()[-2000:]


def test_a_worker_port_in_use_is_refused_at_start_naming_it(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [str(ELASTRAIN), "serve", "--port", str(free_port()), "--worker-port", str(port)]
        out = subprocess.run(
            [*cmd, "--data-dir", str(tmp_path)], env=worker_env({}), cwd=REPO,
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert out.returncode != 0
    assert f"ELASTRAIN_WORKER_PORT: cannot listen on 127.0.0.1:{port}" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    assert not (tmp_path / "etcd").exists(), "refused before anything started"


def test_cli_talks_to_the_service(service: Service, capsys: pytest.CaptureFixture[str]) -> None:
    os.environ["ELASTRAIN_API_TOKEN"] = service.token
    try:
        spec = write_spec(service.data_dir, job_spec(max_steps=10))
        assert elastrain(["submit", str(spec), "--url", service.url]) == 0
        job_id = service.http.get("/v1/jobs").json()["jobs"][0]["id"]
        service.finished(job_id)
        capsys.readouterr()
        assert elastrain(["status", job_id, "--url", service.url]) == 0
        assert "SUCCEEDED" in capsys.readouterr().out
    finally:
        del os.environ["ELASTRAIN_API_TOKEN"]


def test_a_deterministic_error_fails_the_job_with_its_line_not_after_every_restart(service: Service) -> None:
    """A model whose output the worker cannot use fails the contract check on every attempt:
    the second attempt's identical report fails the job with that line, although restarts are
    left (torchrun's --max-restarts 3, the job's max_restarts 3)."""
    job_id = service.submit(job_spec(model={"name": "mlp", "output": 1}))
    final = service.finished(job_id, timeout=300)
    assert final["state"] == "FAILED", final
    reason = final["reason"] or ""
    assert "in two attempts in a row" in reason and "field 'model.output'" in reason, reason
    failures = [e for e in final["events"] if e["kind"] == "worker_failed"]
    assert len(failures) == 2, failures  # one per attempt, however many ranks reported it
    assert final["restarts"] < 3
