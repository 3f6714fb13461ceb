"""/tmp in a microVM guest is the root drive's own directory, as in E2B (issue 14 item 7).

The guest's /init used to mount a tmpfs on /tmp; now nothing is mounted there: /tmp is 1777
root:root on the root filesystem, and its files live through pause/resume. The same /init serves
Firecracker (agentenv/storage/guest.py). (A filesystem-only capture of a VM holds none of its file
changes, /tmp or not: docs/limitations.md.)
"""

from __future__ import annotations

import time

import pytest
from e2b import Sandbox

REQ = 300  # request timeout (s): a cold TCG boot plus a busy host


def sh(sbx: Sandbox, cmd: str, **kw) -> str:
    return sbx.commands.run(cmd, timeout=120, request_timeout=REQ, **kw).stdout


def assert_tmp_on_disk(sbx: Sandbox) -> None:
    assert sh(sbx, "awk '$5 == \"/tmp\"' /proc/self/mountinfo") == "", "something is mounted on /tmp"
    assert sh(sbx, "stat -c %d / /tmp").split()[0] == sh(sbx, "stat -c %d / /tmp").split()[1]
    assert sh(sbx, "stat -c '%a %U:%G' /tmp").strip() == "1777 root:root"


@pytest.mark.timeout(1500)
def test_tmp_is_the_root_drive_and_survives_pause_resume(qemu_server):
    # test_qemu_e2e's last test replaces the session's server (kill -9, then a successor on its data dir)
    srv = qemu_server.successor or qemu_server
    sbx = Sandbox.create(timeout=1800, request_timeout=REQ, **srv.sdk_opts())
    ids = [sbx]
    try:
        assert sh(sbx, "uname -r").startswith("6.1."), "not the guest kernel"
        assert_tmp_on_disk(sbx)
        sbx.files.write("/tmp/vm/a.txt", "in tmp", request_timeout=REQ)
        assert sh(sbx, "stat -c %U /tmp/vm/a.txt").strip() == "user"
        sh(sbx, "python3 -c \"import os; os.rename('/tmp/vm/a.txt', '/home/user/a.txt'); "
                "open('/tmp/vm/a.txt', 'w').write('in tmp')\"")
        assert sbx.files.read("/home/user/a.txt", request_timeout=REQ) == "in tmp"

        t0 = time.monotonic()
        assert sbx.pause(request_timeout=REQ) is True
        sbx = Sandbox.connect(sbx.sandbox_id, timeout=1800, request_timeout=REQ, **srv.sdk_opts())
        print(f"pause + resume: {time.monotonic() - t0:.1f}s")
        assert sbx.files.read("/tmp/vm/a.txt", request_timeout=REQ) == "in tmp"

        assert sh(sbx, "cat /tmp/vm/a.txt") == "in tmp"
        assert_tmp_on_disk(sbx)
    finally:
        for s in ids:
            try:
                s.kill()
            except Exception:  # noqa: BLE001 - cleanup
                pass
