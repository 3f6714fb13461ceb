"""Fixtures for the people-facing CLI tests: the `agentenv` executable against the session server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cli_util import Sandboxes


@pytest.fixture(scope="module")
def sandboxes(server) -> Iterator[Sandboxes]:
    s = Sandboxes(server)
    try:
        yield s
    finally:
        s.cleanup()


@pytest.fixture(scope="module")
def sid(sandboxes: Sandboxes) -> str:
    """One sandbox shared by a module's tests."""
    return sandboxes.create("--metadata", "suite=cli")


@pytest.fixture(autouse=True)
def _server_alive(server):
    code = server.proc.poll()
    if code is not None:
        pytest.fail(f"the agentenv server exited (code {code}); log tail:\n{server.log_tail(40)}", pytrace=False)
