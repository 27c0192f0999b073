"""Fixtures for the observability tests: Prometheus and promtool from the distribution package
(installed once when missing, and the test run says so)."""

from __future__ import annotations

import pytest

from scripts.prometheus_tools import PrometheusTools, ensure_tools


@pytest.fixture(scope="session")
def prom_tools(request: pytest.FixtureRequest) -> PrometheusTools:
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")

    def say(message: str) -> None:
        if reporter is not None:
            reporter.write_line(f"[observability] {message}")

    return ensure_tools(say=say)
