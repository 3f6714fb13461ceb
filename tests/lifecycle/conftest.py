"""Fixtures for the lifecycle suite (fork, pause/resume, snapshots, illegal transitions, crash, S3)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from e2b import Sandbox

from lifecycle_util import SANDBOX_TIMEOUT_S, kill_quietly


class Tracker:
    """Creates sandboxes on the session server and kills every one (and every id registered) at teardown."""

    def __init__(self) -> None:
        self.sandboxes: list[Sandbox] = []
        self.ids: set[str] = set()

    def create(self, template: str | None = None, **kw) -> Sandbox:
        kw.setdefault("timeout", SANDBOX_TIMEOUT_S)
        kw.setdefault("metadata", {"suite": "lifecycle"})
        sbx = Sandbox.create(template, **kw) if template else Sandbox.create(**kw)
        self.add(sbx)
        return sbx

    def add(self, sbx: Sandbox) -> Sandbox:
        self.sandboxes.append(sbx)
        self.ids.add(sbx.sandbox_id)
        return sbx

    def cleanup(self) -> None:
        for s in self.sandboxes:
            kill_quietly(s)
        for sid in self.ids:
            try:
                Sandbox.kill(sid)
            except Exception:  # noqa: BLE001
                pass


@pytest.fixture
def tracker(server) -> Iterator[Tracker]:
    t = Tracker()
    try:
        yield t
    finally:
        t.cleanup()


@pytest.fixture(autouse=True)
def _server_alive(server):
    code = server.proc.poll()
    if code is not None:
        pytest.fail(f"the agentenv server exited (code {code}); log tail:\n{server.log_tail(40)}", pytrace=False)
