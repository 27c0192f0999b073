"""The real worker (its exporter is wired in ``worker/train/trainer.py``), held open after training.

Run it like the worker: ``torchrun ... instrumented_worker.py --config SPEC``. After training,
each rank keeps serving its metrics until the file ``$ELASTRAIN_TEST_RELEASE`` exists (at most
two minutes), so that a test can query Prometheus while every series is still live. Nothing
else differs from ``python -m worker``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from worker import main as worker_main
from worker.train.trainer import Trainer

_run = Trainer.run


def run(self: Trainer) -> dict[str, Any]:
    out = _run(self)
    release = os.environ.get("ELASTRAIN_TEST_RELEASE")
    deadline = time.monotonic() + 120
    while release and not Path(release).exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    return out


Trainer.run = run  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(worker_main.main())
