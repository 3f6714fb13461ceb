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
from pathlib import Path

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


async def test_stop_kills_only_runsc_helpers_and_reaps_them(tmp_path):
    """What a gVisor stop does before `runsc delete` (`cgroups.kill_sandbox` + `_reaper.reap_killed`):
    the sandbox's runsc helpers (the kernel names them `exe`) are killed and reaped at once; a runsc
    command in the group (the CLI joins it while it starts a sandbox) is never killed: a runsc killed
    while it writes its state file leaves the file cut (`gvisor_state`)."""
    from agentenv.runtimes._reaper import ORPHAN_COMM, reap_killed
    sid = "itest" + secrets.token_hex(8)
    ours = f"--root=/run/ours-{sid}"
    exe = tmp_path / ORPHAN_COMM
    exe.symlink_to("/bin/sleep")
    helper = subprocess.Popen(["bash", "-c", f'exec -a "runsc-sandbox {ours} boot" "{exe}" 600'])
    command = _process(f"runsc {ours} delete --force {sid}")
    try:
        time.sleep(0.2)  # exec'd
        if cgroups.place(sid, helper.pid, 0) is None:
            pytest.skip("no writable cgroup filesystem here")
        cgroups.place(sid, command.pid, 0)
        assert open(f"/proc/{helper.pid}/comm").read().strip() == ORPHAN_COMM

        killed = cgroups.kill_sandbox(sid, owner=ours, comm=ORPHAN_COMM)
        assert killed == [helper.pid]
        assert reap_killed(killed) == 1
        assert not os.path.exists(f"/proc/{helper.pid}"), "the killed helper was not reaped"
        assert command.poll() is None, "a runsc command was killed"
        assert cgroups.kill_sandbox("itest-none" + secrets.token_hex(4), owner=ours, comm=ORPHAN_COMM) == []
    finally:
        for p in (helper, command):
            if p.poll() is None:
                p.kill()
            try:
                p.wait(10)
            except ChildProcessError:
                pass
        await cgroups.remove(sid)


async def test_timer_slack_reaches_every_thread_of_the_group_and_a_missing_group_is_no_error():
    """`set_timer_slack` (the gVisor runtime calls it after a start or restore, `sandbox_timer_slack_us`):
    every thread of every process in the sandbox's group, and nothing, without an error, for a
    sandbox that has no group (it must never fail a start)."""
    sid = "itest" + secrets.token_hex(8)
    assert cgroups.set_timer_slack(sid, 3_000_000) == 0
    proc = subprocess.Popen(["python3", "-c", "import threading, time; "
                             "[threading.Thread(target=time.sleep, args=(600,)).start() for _ in range(3)]; "
                             "time.sleep(600)"], start_new_session=True)
    try:
        tasks = Path(f"/proc/{proc.pid}/task")
        deadline = time.monotonic() + 10
        while len(list(tasks.iterdir())) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        if cgroups.place(sid, proc.pid, 0) is None:
            pytest.skip("no writable cgroup filesystem here")
        tids = sorted(int(t.name) for t in tasks.iterdir())
        assert len(tids) >= 4
        assert cgroups.set_timer_slack(sid, 3_000_000) == len(tids)
        assert {int(Path(f"/proc/{t}/timerslack_ns").read_text()) for t in tids} == {3_000_000}
    finally:
        proc.kill()
        proc.wait(10)
        await cgroups.remove(sid)
