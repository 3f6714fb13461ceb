"""Warm start: sandboxes are created by restoring a pre-booted image of the template."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from e2b import Sandbox

from leftovers import NETNS_PREFIX, agentenv_netns
from lifecycle_util import slow_delete_runsc
from serverproc import new_data_dir, remove_data_dir, start_extra_server, stop_unchecked


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

    # Lose the warm memory image (its extracted copy and its recipe: the copy alone is rebuilt from
    # its pages): creates still work (cold boot) and the image is rebuilt.
    shutil.rmtree(server.data_dir / "memory" / meta["memory"])
    (server.data_dir / "cache" / "memory" / meta["memory"]).unlink()
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


def _warm_sandbox(data_dir: Path) -> str | None:
    """The id of the warm-image sandbox being built on `data_dir` (its sandbox dir), if any."""
    d = data_dir / "sandboxes"
    return next((p.name for p in d.iterdir() if p.name.startswith("w")), None) if d.is_dir() else None


@pytest.mark.timeout(400)
def test_a_stop_signal_while_the_server_is_still_starting_stops_it_in_order(server):
    """SIGTERM after startup made the warm image's sandbox but before the server answers: the
    server stops in order (exit 0, its own cleanup), it is not killed half-started with that
    sandbox's netns, mount and HAProxy left behind (what the default action of SIGTERM did)."""
    data_dir = new_data_dir("startstop")
    srv = None
    try:
        srv = start_extra_server(data_dir, env={"AGENTENV_WARM_START": "true"}, wait_healthy=False)
        deadline = time.monotonic() + 300
        while _warm_sandbox(data_dir) is None:
            assert srv.proc.poll() is None, srv.log_tail()
            assert time.monotonic() < deadline, "no warm-image sandbox after 300 s"
            time.sleep(0.01)
        srv.known_ids.add(_warm_sandbox(data_dir))
        problems = srv.stop(gc=False)  # raises when anything of this server is left
        assert not problems, problems
        assert srv.proc.returncode == 0, srv.log_tail()
        assert "shutting down" in srv.log_tail(), srv.log_tail()
    finally:
        stop_unchecked(srv)
        remove_data_dir(data_dir)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("stop_when", ["booting", "sealed"])
def test_a_shutdown_during_the_warm_image_build_leaves_nothing_behind(server, stop_when):
    """SIGTERM while the warm image's sandbox is up (`booting`) or being torn down after its image
    was written (`sealed`, with a slow runsc delete): the server's own shutdown (no `agentenv gc`)
    leaves no netns, mount, container or dir of it."""
    data_dir = new_data_dir("warmstop")
    wrapper = slow_delete_runsc(data_dir)
    srv = None
    try:
        srv = start_extra_server(data_dir, env={"AGENTENV_WARM_START": "true", "AGENTENV_RUNSC_PATH": str(wrapper)})
        wid = _wait_for(lambda: _warm_sandbox(data_dir), "the warm-image sandbox's dir")
        if stop_when == "sealed":
            _wait_for(lambda: _meta(data_dir / "warm" / "base.json"), "the warm image's metadata")
        srv.known_ids.add(wid)
        problems = srv.stop(gc=False)  # raises when anything of this server is left
        assert not problems, problems
        assert f"{NETNS_PREFIX}{wid}" not in agentenv_netns()
    finally:
        if srv is not None and not srv.stopped:
            srv.stop()
        remove_data_dir(data_dir)
