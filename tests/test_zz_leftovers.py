"""Killing a sandbox releases its host resources immediately (runs last: `zz`)."""

from __future__ import annotations

import os

from e2b import Sandbox

from leftovers import NETNS_PREFIX, agentenv_netns, mounts_under, processes_mentioning, runsc_containers


def test_kill_releases_host_resources(server):
    sbx = Sandbox.create(metadata={"suite": "leftovers"}, timeout=300)
    sid = sbx.sandbox_id
    sandbox_dir = server.data_dir / "sandboxes" / sid
    try:
        # while it runs, the resources exist where we are going to look for them
        assert any(sid in c for c in runsc_containers(server.data_dir)), runsc_containers(server.data_dir)
        assert f"{NETNS_PREFIX}{sid}" in agentenv_netns()
        assert sandbox_dir.is_dir()
        assert any(m == str(sandbox_dir) or m.startswith(f"{sandbox_dir}/") for m in mounts_under(server.data_dir))
        assert sbx.commands.run("echo alive").stdout == "alive\n"
    finally:
        killed = sbx.kill()
    assert killed is True
    # right away after kill returned — no polling
    assert not any(sid in c for c in runsc_containers(server.data_dir))
    assert f"{NETNS_PREFIX}{sid}" not in agentenv_netns()
    assert [m for m in mounts_under(server.data_dir) if m == str(sandbox_dir) or m.startswith(f"{sandbox_dir}/")] == []
    assert not sandbox_dir.exists()
    assert processes_mentioning(str(sandbox_dir), exclude_pids={os.getpid()}) == []
    assert processes_mentioning(sid, exclude_pids={os.getpid()}) == []
