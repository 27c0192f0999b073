"""The file limit the service asks for and the client connections it holds under it (pure)."""

from __future__ import annotations

import resource

from service.api.connections import NOFILE_CEILING, connection_cap, nofile_target

INF = resource.RLIM_INFINITY


def test_the_soft_file_limit_is_raised_to_the_hard_one() -> None:
    assert nofile_target(1024, 524_288) == 524_288
    assert nofile_target(1024, 1024) == 1024
    assert nofile_target(1024, INF) == NOFILE_CEILING  # unlimited: the kernel's usual ceiling
    assert nofile_target(INF, INF) == INF  # already unlimited: left as it is
    assert nofile_target(4096, 2048) == 4096  # never lowered


def test_client_connections_leave_a_quarter_of_the_file_limit_to_the_service() -> None:
    assert connection_cap(1024, 4096) == 768
    assert connection_cap(1_048_576, 4096) == 4096
    assert connection_cap(200, 4096) == 136  # at least 64 files kept
    assert connection_cap(64, 4096) == 1
