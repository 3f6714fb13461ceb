"""A stopped sandbox's cgroup goes even when a process of it outlived its runtime (`runtimes/cgroups.py`).

Seen in CI: a server killed mid-fork left a child's runsc sandbox running with a half-written runsc
state; after the restart `runsc delete` no longer knew it, its group stayed busy, and the EBUSY
stopped the restarted server's recovery, i.e. the whole server. `remove` now kills what is left in
the group of a sandbox it was told is stopped, then removes the group.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import time

import pytest

from agentenv.runtimes import cgroups

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="moving a process between cgroups needs root")


async def test_remove_kills_what_outlived_the_sandbox_then_removes_the_group():
    sid = "itest" + secrets.token_hex(8)
    stray = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        group = cgroups.place(sid, stray.pid, 0)
        if group is None:
            pytest.skip("no writable cgroup filesystem here")
        assert str(stray.pid) in (group / "cgroup.procs").read_text().split()
        t0 = time.monotonic()
        await cgroups.remove(sid)
        took = time.monotonic() - t0
        assert not group.exists(), "the sandbox's group is still there"
        assert stray.wait(10) == -9, "the stray process was not killed"
        assert took < 5, f"remove took {took:.1f}s"
    finally:
        if stray.poll() is None:
            stray.kill()
            stray.wait(10)
        await cgroups.remove(sid)
