"""`/tmp` is a directory of the sandbox's disk, as in E2B (issue 14 item 7), through the real SDKs.

gVisor mounts a tmpfs of its own over an empty `/tmp` unless told otherwise; files there then lived in
memory only: gone after a filesystem-only pause, missing from filesystem snapshots and templates.
Here `/tmp` must behave like any other directory of the disk (1777 root:root, same filesystem as `/`)
through pause/resume (memory and filesystem-only), fork, both kinds of snapshot, and a boot where
`/tmp` was left empty. tests/js/tmp_dir.test.mjs checks the same with the npm SDK.
"""

from __future__ import annotations

import secrets

import pytest
from e2b import Sandbox
from e2b.exceptions import ServiceBusyException

from e2e_util import SandboxFactory, kill_quietly, run_node_tests, wait_until

pytestmark = pytest.mark.timeout(900)

HOME = "/home/user"
# The mount point of /tmp's filesystem and whether it is the root's: a line of mountinfo names /tmp
# only when something (a tmpfs) is mounted there.
TMP_MOUNTS = "awk '$5 == \"/tmp\"' /proc/self/mountinfo"


def sh(sbx: Sandbox, cmd: str, **kw) -> str:
    return sbx.commands.run(cmd, timeout=120, **kw).stdout


def assert_tmp_on_disk(sbx: Sandbox) -> None:
    assert sh(sbx, TMP_MOUNTS) == "", "something is mounted on /tmp"
    devs = sh(sbx, "stat -c %d / /tmp").split()
    assert len(devs) == 2 and devs[0] == devs[1], f"/tmp is another filesystem than /: {devs}"
    assert sh(sbx, "stat -c '%a %U:%G' /tmp").strip() == "1777 root:root"


@pytest.fixture
def fresh(sandbox_factory: SandboxFactory) -> Sandbox:
    return sandbox_factory.create()


def test_tmp_is_a_directory_of_the_disk_with_e2b_permissions(fresh: Sandbox):
    sbx = fresh
    assert_tmp_on_disk(sbx)
    # The default user writes there through the SDK and its commands; the files are theirs.
    sbx.files.write("/tmp/sdk.txt", "from the sdk")
    sh(sbx, "echo from-a-command > /tmp/cmd.txt")
    assert sh(sbx, "stat -c %U /tmp/sdk.txt /tmp/cmd.txt").split() == ["user", "user"]
    assert sbx.files.read("/tmp/cmd.txt") == "from-a-command\n"
    # One filesystem with the rest of the disk: rename(2) across it works (a tmpfs gives EXDEV).
    sh(sbx, "python3 -c \"import os; os.rename('/tmp/cmd.txt', '/home/user/moved.txt')\"")
    assert sbx.files.read(f"{HOME}/moved.txt") == "from-a-command\n"
    # The sticky bit: another non-root user can add files but not remove the user's.
    sh(sbx, "useradd -M other", user="root")
    r = sbx.commands.run("echo other > /tmp/other.txt; rm -f /tmp/sdk.txt; echo rc=$?", user="other", timeout=60)
    assert "rc=1" in r.stdout and "Operation not permitted" in r.stderr, (r.stdout, r.stderr)
    assert sbx.files.read("/tmp/sdk.txt") == "from the sdk"
    assert sh(sbx, "stat -c %U /tmp/other.txt").strip() == "other"
    # Listing through the SDK shows the disk's entries.
    names = {e.name for e in sbx.files.list("/tmp")}
    assert {"sdk.txt", "other.txt"} <= names, names


def test_tmp_survives_pause_resume_with_and_without_memory(fresh: Sandbox):
    sbx = fresh
    tag = secrets.token_hex(4)
    sbx.files.write("/tmp/work/sdk.txt", tag)
    # A process living in /tmp, appending to a file it keeps open there.
    sbx.commands.run("cd /tmp/work && exec python3 -u -c \"import os, time\nf = open('ticks', 'a')\n"
                     "open('pid', 'w').write(str(os.getpid()))\n"
                     "while True:\n    f.write('t\\n'); f.flush(); time.sleep(0.2)\"", background=True)
    wait_until(lambda: sh(sbx, "wc -l < /tmp/work/ticks 2>/dev/null || echo 0").strip() not in ("", "0"),
               "the ticker in /tmp")
    pid = sbx.files.read("/tmp/work/pid")

    assert sbx.pause() is True
    sbx = Sandbox.connect(sbx.sandbox_id, timeout=600)
    assert sbx.files.read("/tmp/work/sdk.txt") == tag
    assert sh(sbx, f"cat /proc/{pid}/cmdline | tr '\\0' ' '").startswith("python3 -u -c"), "the ticker is gone"
    before = int(sh(sbx, "wc -l < /tmp/work/ticks"))
    wait_until(lambda: int(sh(sbx, "wc -l < /tmp/work/ticks")) > before, "the ticker after the resume")
    assert sh(sbx, f"readlink /proc/{pid}/cwd", user="root").strip() == "/tmp/work"
    assert_tmp_on_disk(sbx)

    # A filesystem-only pause keeps the disk, /tmp included, and the resume is a boot.
    assert sbx.pause(mode="filesystem") is True
    sbx = Sandbox.connect(sbx.sandbox_id, timeout=600)
    assert sh(sbx, "ps -eo args | grep -c '[o]pen(.ticks' || true").strip() == "0"
    assert sbx.files.read("/tmp/work/sdk.txt") == tag
    assert int(sh(sbx, "wc -l < /tmp/work/ticks")) >= before
    assert_tmp_on_disk(sbx)


def test_an_emptied_tmp_stays_on_disk_across_boots(fresh: Sandbox):
    """A boot where /tmp is empty (the user removed everything) still gets the disk's /tmp."""
    sbx = fresh
    sh(sbx, "rm -rf /tmp/* /tmp/.[!.]* && ls -A /tmp | wc -l", user="root")
    assert sbx.pause(mode="filesystem") is True
    sbx = Sandbox.connect(sbx.sandbox_id, timeout=600)
    assert_tmp_on_disk(sbx)
    sbx.files.write("/tmp/after-empty-boot.txt", "kept")
    assert sbx.pause(mode="filesystem") is True
    sbx = Sandbox.connect(sbx.sandbox_id, timeout=600)
    assert sbx.files.read("/tmp/after-empty-boot.txt") == "kept"
    assert_tmp_on_disk(sbx)


def test_fork_children_see_tmp_and_do_not_share_their_writes(fresh: Sandbox):
    src = fresh
    src.files.write("/tmp/from-source.txt", "source")
    children = src.fork(count=2, timeout=600)
    try:
        assert all(isinstance(c, Sandbox) for c in children), children
        a, b = children
        for c in children:
            assert c.files.read("/tmp/from-source.txt") == "source"
            assert_tmp_on_disk(c)
        a.files.write("/tmp/only-in-a.txt", "a")
        sh(a, "echo changed-in-a > /tmp/from-source.txt")
        assert not b.files.exists("/tmp/only-in-a.txt")
        assert not src.files.exists("/tmp/only-in-a.txt")
        assert b.files.read("/tmp/from-source.txt") == "source"
        assert src.files.read("/tmp/from-source.txt") == "source"
        assert a.files.read("/tmp/from-source.txt") == "changed-in-a\n"
    finally:
        for c in children:
            if isinstance(c, Sandbox):
                kill_quietly(c)


def test_snapshots_with_and_without_memory_carry_tmp(fresh: Sandbox, sandbox_factory: SandboxFactory):
    src = fresh
    src.files.write("/tmp/snap/data.txt", "in the snapshot")
    full = src.create_snapshot()
    fs = src.create_snapshot(mode="filesystem")
    src.files.write("/tmp/snap/data.txt", "changed after the snapshots")
    try:
        for snap in (full, fs):
            s = sandbox_factory.create(template=snap.snapshot_id)
            assert s.files.read("/tmp/snap/data.txt") == "in the snapshot", snap
            assert_tmp_on_disk(s)
            kill_quietly(s)
    finally:
        for snap in (full, fs):
            try:
                Sandbox.delete_snapshot(snap.snapshot_id)
            except Exception:  # noqa: BLE001 - cleanup
                pass


def test_pause_refused_while_a_deleted_file_in_tmp_is_open(fresh: Sandbox):
    """runsc 20240729 cannot checkpoint a deleted file of the disk that a process holds open
    (Python's TemporaryFile on /tmp): the pause is refused with that reason and the sandbox runs on
    unchanged; once the file is closed the pause works (docs/limitations.md)."""
    sbx = fresh
    sbx.commands.run("exec python3 -c \"import tempfile, time\nf = tempfile.TemporaryFile()\n"
                     "f.write(b'x' * 4096); f.flush()\nopen('/tmp/holder-ready', 'w').close()\n"
                     "time.sleep(3600)\"", background=True)
    wait_until(lambda: sbx.files.exists("/tmp/holder-ready"), "the TemporaryFile holder")
    with pytest.raises(ServiceBusyException) as e:  # 503: retry later
        sbx.pause()
    msg = str(e.value)
    assert "deleted file /tmp/" in msg and "close it" in msg, msg
    assert sh(sbx, "echo still-running").strip() == "still-running"
    sh(sbx, "pkill -f '[T]emporaryFile'; true")
    wait_until(lambda: sh(sbx, "pgrep -f '[T]emporaryFile' || true").strip() == "", "the holder to exit")
    assert sbx.pause() is True
    sbx = Sandbox.connect(sbx.sandbox_id, timeout=600)
    assert sbx.files.exists("/tmp/holder-ready")


def test_js_sdk_sees_tmp_on_disk(server):
    run_node_tests(server, "tmp_dir.test.mjs", passes=3)

