"""Fixtures for the end-to-end suite: sandboxes created through the real E2B SDKs.

Sandboxes are shared per module where a test does not need a fresh one and are always
killed in teardown, even when the test failed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio
from e2b import AsyncSandbox, Sandbox

from e2e_util import SANDBOX_TIMEOUT_S, SandboxFactory, akill_quietly


@pytest.fixture(scope="module")
def sandbox_factory(server, request) -> Iterator[SandboxFactory]:
    factory = SandboxFactory(request.module.__name__.rsplit(".", 1)[-1])
    try:
        yield factory
    finally:
        factory.cleanup()


@pytest.fixture(scope="module")
def sbx(sandbox_factory: SandboxFactory) -> Sandbox:
    """A sync sandbox shared by the tests of one module (default template)."""
    return sandbox_factory.create()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def async_sbx(server, request) -> AsyncIterator[AsyncSandbox]:
    """An async sandbox shared by the tests of one module."""
    module = request.module.__name__.rsplit(".", 1)[-1]
    sandbox = await AsyncSandbox.create(metadata={"suite": "e2e", "module": module}, timeout=SANDBOX_TIMEOUT_S)
    try:
        yield sandbox
    finally:
        await akill_quietly(sandbox)


@pytest.fixture(autouse=True)
def _server_alive(server):
    """Fail fast with the server's log instead of a cascade of 'connection refused' errors."""
    code = server.proc.poll()
    if code is not None:
        pytest.fail(f"the agentenv server exited (code {code}); log tail:\n{server.log_tail(40)}", pytrace=False)
