"""Fixtures for the template suite: templates built through the real SDK `Template` builder."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _server_alive(server):
    code = server.proc.poll()
    if code is not None:
        pytest.fail(f"the agentenv server exited (code {code}); log tail:\n{server.log_tail(40)}", pytrace=False)
