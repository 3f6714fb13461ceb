"""Helpers shared by the end-to-end tests (imported as ``e2e_util``)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable

import pytest
from e2b import AsyncSandbox, Sandbox

# Long enough for any module; the server kills leftovers after this anyway.
SANDBOX_TIMEOUT_S = 900


def new_tag() -> str:
    return secrets.token_hex(6)


def kill_quietly(sbx: Sandbox) -> None:
    try:
        sbx.kill()
    except Exception:
        pass


async def akill_quietly(sbx: AsyncSandbox) -> None:
    try:
        await sbx.kill()
    except Exception:
        pass


def wait_until(predicate: Callable[[], object], what: str, limit: float = 60.0, interval: float = 0.2):
    """Poll ``predicate`` until it returns a truthy value; fail after ``limit`` seconds (a hang guard)."""
    deadline = time.monotonic() + limit
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting for {what} after {limit:.0f}s")
        time.sleep(interval)


class SandboxFactory:
    """Creates sync sandboxes and kills every one of them at teardown."""

    def __init__(self, suite: str) -> None:
        self.suite = suite
        self.created: list[Sandbox] = []

    def create(self, **kwargs) -> Sandbox:
        metadata = {"suite": "e2e", "module": self.suite, **kwargs.pop("metadata", {})}
        kwargs.setdefault("timeout", SANDBOX_TIMEOUT_S)
        sbx = Sandbox.create(metadata=metadata, **kwargs)
        self.created.append(sbx)
        return sbx

    def cleanup(self) -> None:
        for sbx in self.created:
            kill_quietly(sbx)
