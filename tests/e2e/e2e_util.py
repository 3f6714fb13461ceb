"""Helpers shared by the end-to-end tests (imported as ``e2e_util``)."""

from __future__ import annotations

import secrets
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

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


JS_DIR = Path(__file__).resolve().parent.parent / "js"


def run_node_tests(server, test_file: str, passes: int, timeout: float = 800) -> str:
    """Run `node --test tests/js/<test_file>` against the test server; all `passes` tests must pass.

    Counting the passes guards against an empty or renamed test file. Returns node's stdout.
    """
    node = shutil.which("node")
    if node is None:
        pytest.fail("node is not installed (run scripts/setup.sh --test)")
    if not (JS_DIR / "node_modules" / "e2b" / "package.json").exists():
        pytest.fail(f"{JS_DIR}/node_modules is missing (run scripts/setup.sh --test)")
    proc = subprocess.run([node, "--test", test_file], cwd=JS_DIR, env=server.sdk_env(), capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"node --test {test_file}: {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert f"# pass {passes}" in proc.stdout and "# fail 0" in proc.stdout, proc.stdout
    return proc.stdout
