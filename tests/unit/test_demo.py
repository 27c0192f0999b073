"""``make run``'s end (scripts/demo.py): from a terminal the service stays up, its URL said, until
Ctrl-C; without one (CI, a pipe) the demo returns at once and offers no URL about to go away."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.demo import finish


def test_from_a_terminal_the_service_stays_up_until_ctrl_c(capsys: pytest.CaptureFixture[str]) -> None:
    waited: list[bool] = []
    finish("http://127.0.0.1:8123", Path("d/api-token"), interactive=True, wait=lambda: waited.append(True))
    out = capsys.readouterr().out
    assert waited == [True]
    assert "the service stays up at http://127.0.0.1:8123 (metrics: http://127.0.0.1:8123/metrics)" in out
    assert "until you press Ctrl-C" in out and "--token-file d/api-token" in out


def test_without_a_terminal_it_returns_at_once_and_offers_no_url(capsys: pytest.CaptureFixture[str]) -> None:
    def never() -> None:
        raise AssertionError("a non-interactive run must not wait for Ctrl-C")

    finish("http://127.0.0.1:8123", Path("d/api-token"), interactive=False, wait=never)
    assert "http://" not in capsys.readouterr().out
