"""Warm start: sandboxes are created by restoring a pre-booted image of the template."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from e2b import Sandbox


def _wait_for(pred, what: str, limit: float = 180.0):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.5)
    pytest.fail(f"gave up waiting for {what}")


def _meta(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _lowerdirs(data_dir: Path, sandbox_id: str) -> str:
    target = str(data_dir / "sandboxes" / sandbox_id / "rootfs")
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        if f" {target} " in line:
            return line
    return ""


@pytest.mark.timeout(400)
def test_creates_restore_the_warm_image_and_fall_back_when_it_is_lost(server):
    meta_path = server.data_dir / "warm" / "base.json"
    meta = _wait_for(lambda: _meta(meta_path), "the warm image of template base")
    assert meta["layers"], meta  # envd's start leaves files (its sudo socket dir): one sealed layer

    a, b = Sandbox.create(envs={"K": "a"}), Sandbox.create(envs={"K": "b"})
    try:
        for sbx, k in ((a, "a"), (b, "b")):
            assert sbx.commands.run("echo $K $E2B_SANDBOX_ID").stdout.split() == [k, sbx.sandbox_id]
            assert meta["layers"][0] in _lowerdirs(server.data_dir, sbx.sandbox_id)  # restored, not booted
        a.files.write("/home/user/only-a.txt", "a")
        assert not b.files.exists("/home/user/only-a.txt")
    finally:
        a.kill()
        b.kill()

    # Lose the warm memory image: creates still work (cold boot) and the image is rebuilt.
    shutil.rmtree(server.data_dir / "memory" / meta["memory"])
    c = Sandbox.create()
    try:
        assert c.commands.run("echo ok").stdout == "ok\n"
        assert meta["layers"][0] not in _lowerdirs(server.data_dir, c.sandbox_id)  # booted cold
    finally:
        c.kill()
    rebuilt = _wait_for(lambda: (m := _meta(meta_path)) and m["created"] != meta["created"]
                        and (server.data_dir / "memory" / m["memory"]).is_dir() and m, "the rebuilt warm image")
    d = Sandbox.create()
    try:
        assert rebuilt["layers"][0] in _lowerdirs(server.data_dir, d.sandbox_id)
    finally:
        d.kill()
