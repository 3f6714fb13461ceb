"""Fixtures for the security suite (the session server comes from tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sec_util import Sandboxes


@pytest.fixture(scope="module")
def sandboxes(server) -> Iterator[Sandboxes]:
    s = Sandboxes(server)
    try:
        yield s
    finally:
        s.cleanup()


@pytest.fixture(autouse=True)
def _server_alive(server):
    code = server.proc.poll()
    if code is not None:
        pytest.fail(f"the agentenv server exited (code {code}); log tail:\n{server.log_tail(40)}", pytrace=False)
