"""What the worker says: JSON lines on stdout for machines, a readable line on stderr for people.

Only rank 0 speaks unless told otherwise. One JSON object per line, always with ``event``.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

Sink = Callable[[str, dict[str, Any]], None]


class Events:
    """``sinks`` see every event of this rank (e.g. the service client), printed or not."""

    def __init__(self, *, enabled: bool, job: str, rank: int) -> None:
        self.enabled = enabled
        self.job = job
        self.rank = rank
        self.sinks: list[Sink] = []
        self.log_path: Path | None = None  # rank 0 appends every event here too (the run dir)

    def emit(self, event: str, **fields: Any) -> None:
        for sink in self.sinks:
            sink(event, fields)
        if self.enabled:
            self._write(event, fields)

    def record(self, event: str, **fields: Any) -> None:
        """Like :meth:`emit`, but said whatever this rank: what only this process knows (in peer
        mode, a recovery as its leader decided and timed it; the leader is not always rank 0)."""
        for sink in self.sinks:
            sink(event, fields)
        self._write(event, fields)

    def _write(self, event: str, fields: dict[str, Any]) -> None:
        record = {"event": event, "job": self.job, "time": round(time.time(), 3), **fields}
        line = json.dumps(record, sort_keys=False, default=str) + "\n"
        sys.stdout.write(line)
        sys.stdout.flush()
        if self.log_path is not None:
            with self.log_path.open("a", encoding="utf-8") as out:
                out.write(line)

    def say(self, text: str) -> None:
        if self.enabled:
            sys.stderr.write(f"[elastrain {self.job}] {text}\n")
            sys.stderr.flush()


def progress_line(
    *, step: int, max_steps: int, samples: int, loss: float, rate: float, scale: float, skipped: int
) -> str:
    return (
        f"step {step}/{max_steps}  samples {samples}  loss {loss:.5f}  "
        f"{rate:,.0f} samples/s  loss-scale {scale:g}  skipped {skipped}"
    )
