"""``python -m worker --config SPEC.json`` (what torchrun runs)."""

from __future__ import annotations

import sys

from worker.main import main

if __name__ == "__main__":
    sys.exit(main())
