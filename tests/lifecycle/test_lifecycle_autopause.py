"""autoPause: a sandbox created with on_timeout=pause is paused (not killed) when its TTL ends."""

from __future__ import annotations

import time

import pytest
from e2b import Sandbox, SandboxState


@pytest.mark.timeout(240)
def test_timeout_with_auto_pause_pauses_then_connect_resumes(server):
    sbx = Sandbox.create(timeout=4, lifecycle={"on_timeout": "pause"})
    try:
        sbx.files.write("/home/user/kept.txt", "kept across auto-pause")
        h = sbx.commands.run("sleep 100000", background=True)
        h.disconnect()
        deadline = time.monotonic() + 90
        state = None
        while time.monotonic() < deadline:
            state = Sandbox.get_info(sbx.sandbox_id).state
            if state == SandboxState.PAUSED:
                break
            time.sleep(0.5)
        assert state == SandboxState.PAUSED, f"expected the TTL to pause the sandbox, state is {state}"
        assert not sbx.is_running()  # envd is not reachable while paused

        resumed = Sandbox.connect(sbx.sandbox_id, timeout=60)
        assert resumed.files.read("/home/user/kept.txt") == "kept across auto-pause"
        assert h.pid in [p.pid for p in resumed.commands.list()]  # the process came back with its PID
        assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.RUNNING
    finally:
        Sandbox.kill(sbx.sandbox_id)
