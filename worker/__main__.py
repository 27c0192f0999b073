"""``python -m worker --config SPEC.json`` (what torchrun runs)."""

from __future__ import annotations

from worker.start import startgc

startgc.hold()  # the collector stays off until the run is built (worker/start/startgc.py)

from worker.main import main  # noqa: E402
from worker.wiring import exit_now  # noqa: E402

if __name__ == "__main__":
    exit_now(main())  # a SystemExit from main (``--help``, an argument error) exits as usual
