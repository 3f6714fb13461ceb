"""A stopped sandbox's cgroup goes even when a process of it outlived its runtime (`runtimes/cgroups.py`),
and a process of the same sandbox id that is not this runtime's is never touched.

Seen in CI: after a server killed mid-fork restarted, its recovery dropped a sandbox whose runsc
processes `runsc delete` did not end; the group stayed busy, and the EBUSY stopped the recovery,
i.e. the whole server. And in the cluster tests (three
nodes on one host): a paused sandbox moved from node C to node A runs in the group of the same name,
so C's release of its old copy must leave A's processes alone.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import time

import pytest

from agentenv.errors import RuntimeFailure
from agentenv.runtimes import cgroups

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="moving a process between cgroups needs root")


def _process(argv0: str) -> subprocess.Popen:
    return subprocess.Popen(["bash", "-c", f'exec -a "{argv0}" sleep 600'], start_new_session=True)


async def test_remove_kills_only_what_this_runtime_left_in_the_group():
    sid = "itest" + secrets.token_hex(8)
    ours, theirs = f"--root=/run/ours-{sid}", f"--root=/run/theirs-{sid}"
    stray = _process(f"runsc-sandbox {ours} boot")
    other = _process(f"runsc-sandbox {theirs} boot")
    try:
        time.sleep(0.2)  # exec'd
        group = cgroups.place(sid, stray.pid, 0)
        if group is None:
            pytest.skip("no writable cgroup filesystem here")
        cgroups.place(sid, other.pid, 0)
        assert {str(stray.pid), str(other.pid)} <= set((group / "cgroup.procs").read_text().split())

        # another server's process of this sandbox id keeps the group: an error, nothing killed
        with pytest.raises(RuntimeFailure, match="cannot remove cgroup"):
            await cgroups.remove(sid, owner=ours, wait_s=1.0)
        assert other.poll() is None, "a process that is not this runtime's was killed"
        assert stray.wait(10) == -9, "this runtime's stray process was not killed"

        other.kill()
        other.wait(10)
        t0 = time.monotonic()
        await cgroups.remove(sid, owner=ours)
        assert not group.exists(), "the sandbox's group is still there"
        assert time.monotonic() - t0 < 5
    finally:
        for p in (stray, other):
            if p.poll() is None:
                p.kill()
                p.wait(10)
        await cgroups.remove(sid)
