from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration.checkpoint.harness import Run, torchrun
from tests.s3server import SeaweedServer

STEPS, EVERY, SEED = 8, 2, 1


@dataclass
class Reference:
    dir: Path
    run: Run

    @property
    def digest(self) -> str:
        return str(self.run.last("finished")["digest"])


@pytest.fixture(scope="session")
def reference_ddp(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """An uninterrupted DDP run at W=2 (sync saves every 2 steps, 8 steps)."""
    d = tmp_path_factory.mktemp("ref") / "ddp"
    run = torchrun(
        2, "--dir", str(d), "--steps", str(STEPS), "--every", str(EVERY), "--seed", str(SEED)
    ).check()
    return Reference(d, run)


@pytest.fixture(scope="session")
def s3server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    """A real S3-compatible server (SeaweedFS) for the session, bucket ``ckpt``; tests isolate
    themselves by prefix."""
    with SeaweedServer(tmp_path_factory.mktemp("seaweed")) as server:
        yield server
