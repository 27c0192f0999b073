"""Transitional: the old name of :mod:`worker.checkpoint.checkpointer` (issue 15 renamed it).

Kept only until tests/unit/observability/test_dashboards_and_rules.py imports
``worker.checkpoint.CheckpointStats``; then delete this file.
"""

from __future__ import annotations

from worker.checkpoint.checkpointer import Checkpointer, CheckpointStats

__all__ = ["CheckpointStats", "Checkpointer"]
