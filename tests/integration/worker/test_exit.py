"""The worker's exit without the interpreter's teardown (worker.wiring.exit_now) keeps what a normal
exit keeps: a real subprocess that leaves a non-daemon thread writing, an idle thread pool, a file
object unflushed, an ``atexit`` handler and a ``logging`` file handler, then exits through it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.integration.launch import REPO

pytestmark = pytest.mark.integration

SCRIPT = textwrap.dedent(
    """
    import atexit, logging, sys, threading, time
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path
    from worker.wiring import exit_now

    out = Path(sys.argv[1])
    left_open = (out / "left-open.txt").open("w")
    left_open.write("buffered, never flushed by the script")
    logging.basicConfig(filename=out / "log.txt", level=logging.INFO)
    logging.info("logged at the end")
    atexit.register(lambda: (out / "atexit.txt").write_text("ran"))

    def late() -> None:
        time.sleep(0.5)
        (out / "thread.txt").write_text("finished")

    threading.Thread(target=late, daemon=False).start()
    idle = ThreadPoolExecutor(2)  # its idle workers end through threading's own exit callbacks
    idle.submit(time.sleep, 0).result()
    print("on stdout, buffered", end="")
    exit_now(7)
    """
)


def test_exit_now_joins_threads_runs_atexit_and_flushes_open_files(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=60
    )  # a wait that never ends (the pool's workers joined before they were told to stop) times out
    assert proc.returncode == 7, proc.stderr
    assert proc.stdout == "on stdout, buffered"
    assert (tmp_path / "thread.txt").read_text() == "finished"  # joined, as a normal exit joins it
    assert (tmp_path / "atexit.txt").read_text() == "ran"
    assert "logged at the end" in (tmp_path / "log.txt").read_text()
    assert (tmp_path / "left-open.txt").read_text() == "buffered, never flushed by the script"
