"""process.Process through the real E2B SDK (sync and async) against a live envd."""

from __future__ import annotations

import os
import secrets
import subprocess
import time

import pytest
from e2b import CommandExitException, InvalidArgumentException, PtySize
from e2b.exceptions import AuthenticationException


def test_run_stdout_stderr_and_exit_code(sbx):
    r = sbx.commands.run("echo out; echo err >&2; exit 0")
    assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 0)
    with pytest.raises(CommandExitException) as exc:
        sbx.commands.run("echo before; exit 7")
    assert exc.value.exit_code == 7
    assert exc.value.stdout == "before\n"
    assert "exit status 7" in (exc.value.error or "")


def test_run_streams_output_as_it_is_produced(sbx):
    seen: list[tuple[float, str]] = []
    start = time.monotonic()
    sbx.commands.run("echo first; sleep 1; echo second", on_stdout=lambda s: seen.append((time.monotonic() - start, s)))
    text = "".join(s for _, s in seen)
    assert text == "first\nsecond\n"
    first_at = next(t for t, s in seen if "first" in s)
    assert first_at < 0.9, f"first chunk arrived only after {first_at:.2f}s: not streamed"


def test_large_output_is_chunked_and_complete(sbx):
    chunks: list[str] = []
    r = sbx.commands.run("head -c 300000 /dev/zero | tr '\\0' x", on_stdout=chunks.append)
    assert len(r.stdout) == 300000 and set(r.stdout) == {"x"}
    assert len(chunks) >= 10  # <= 32 KiB per event


def test_environment_user_and_cwd(sbx, temp_user, workdir):
    r = sbx.commands.run('echo "$GLOBAL_VAR|$REQ|$HOME|$USER|$LOGNAME|$(id -un)|$(pwd)"', envs={"REQ": "r1"})
    assert r.stdout.strip() == "|".join(
        ["from-init", "r1", temp_user.home, temp_user.name, temp_user.name, temp_user.name, temp_user.home]
    )
    r = sbx.commands.run("pwd", cwd=workdir)
    assert r.stdout.strip() == workdir
    r = sbx.commands.run("id -un; echo $HOME", user="root")
    assert r.stdout.split() == ["root", "/root"]
    # request env overrides global env
    assert sbx.commands.run("echo $GLOBAL_VAR", envs={"GLOBAL_VAR": "mine"}).stdout == "mine\n"


def test_user_database_changes_apply_to_the_next_command(sbx):
    """envd keeps looked-up users between requests: a group added to a user, and a user removed,
    count from the next command on."""
    name, group = "aecache" + secrets.token_hex(3), "aegrp" + secrets.token_hex(3)
    subprocess.run(["useradd", "-M", "-s", "/bin/bash", "-d", "/", name], check=True, timeout=30, capture_output=True)
    try:
        assert group not in sbx.commands.run("id -Gn", user=name).stdout.split()
        subprocess.run(["groupadd", group], check=True, timeout=30, capture_output=True)
        subprocess.run(["usermod", "-aG", group, name], check=True, timeout=30, capture_output=True)
        assert group in sbx.commands.run("id -Gn", user=name).stdout.split()
        subprocess.run(["userdel", name], check=True, timeout=30, capture_output=True)
        with pytest.raises(AuthenticationException):
            sbx.commands.run("true", user=name)
    finally:
        subprocess.run(["userdel", name], timeout=30, capture_output=True)
        subprocess.run(["groupdel", group], timeout=30, capture_output=True)


def test_missing_cwd_is_invalid_argument(sbx):
    with pytest.raises(InvalidArgumentException, match="cwd '/definitely/not/here' does not exist"):
        sbx.commands.run("true", cwd="/definitely/not/here")


def test_unknown_user_is_unauthenticated(sbx):
    with pytest.raises(AuthenticationException):
        sbx.commands.run("true", user="no-such-user-xyz")


def test_background_stdin_close_and_list(sbx):
    h = sbx.commands.run("cat", background=True, stdin=True)
    assert h.pid in [p.pid for p in sbx.commands.list()]
    sbx.commands.send_stdin(h.pid, "hello\n")
    sbx.commands.send_stdin(h.pid, b"bytes\n")
    sbx.commands.close_stdin(h.pid)
    r = h.wait()
    assert r.stdout == "hello\nbytes\n"
    assert r.exit_code == 0
    assert h.pid not in [p.pid for p in sbx.commands.list()]


def test_kill_background_process(sbx):
    h = sbx.commands.run("sleep 60", background=True)
    listed = {p.pid: p for p in sbx.commands.list()}
    assert listed[h.pid].cmd == "/bin/bash" and listed[h.pid].args[-1] == "sleep 60"
    assert sbx.commands.kill(h.pid) is True
    with pytest.raises(CommandExitException) as exc:
        h.wait()
    assert exc.value.exit_code == -1
    assert exc.value.error == "signal: killed"
    assert sbx.commands.kill(h.pid) is False  # gone


def test_kill_takes_down_the_process_group(sbx, workdir):
    marker = os.path.join(workdir, "child.pid")
    h = sbx.commands.run(f"sleep 300 & echo $! > {marker}; wait", background=True)
    deadline = time.monotonic() + 5
    while not os.path.exists(marker) or not open(marker).read().strip():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int(open(marker).read())
    sbx.commands.kill(h.pid)
    with pytest.raises(CommandExitException):
        h.wait()
    deadline = time.monotonic() + 5
    while True:
        try:
            with open(f"/proc/{child}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            break
        if state == "Z":
            break
        assert time.monotonic() < deadline, "background child survived SIGKILL of the group"
        time.sleep(0.05)


def test_connect_to_running_and_recently_exited(sbx):
    h = sbx.commands.run("sleep 1; echo done", background=True)
    h.disconnect()  # client goes away: the process must keep running
    attached = sbx.commands.connect(h.pid)
    r = attached.wait()
    assert r.stdout == "done\n"
    # exited recently: start + end right away
    again = sbx.commands.connect(h.pid)
    assert again.wait().exit_code == 0


def test_disconnect_does_not_kill(sbx, workdir):
    out = os.path.join(workdir, "late.txt")
    h = sbx.commands.run(f"sleep 1; echo late > {out}", background=True)
    h.disconnect()
    deadline = time.monotonic() + 10
    while not os.path.exists(out):
        assert time.monotonic() < deadline, "process died with its client"
        time.sleep(0.1)


def test_timeout_kills_process(sbx):
    start = time.monotonic()
    with pytest.raises(Exception):
        sbx.commands.run("sleep 30", timeout=1)
    assert time.monotonic() - start < 10
    time.sleep(0.5)
    assert not [p for p in sbx.commands.list() if p.args and p.args[-1] == "sleep 30"]


def test_pty_create_input_resize(sbx):
    data = bytearray()
    h = sbx.pty.create(PtySize(rows=24, cols=80), envs={"PS1": "$ "}, timeout=30)
    try:
        sbx.pty.send_stdin(h.pid, b"echo $((6*7))\n")
        sbx.pty.resize(h.pid, PtySize(rows=33, cols=111))
        sbx.pty.send_stdin(h.pid, b"stty size; tty; exit\n")
        r = h.wait(on_pty=data.extend)
    finally:
        sbx.pty.kill(h.pid)
    text = data.decode(errors="replace")
    assert "42" in text
    assert "33 111" in text
    assert "/dev/pts/" in text
    assert r.exit_code == 0


async def test_async_stream_input_and_wait(asbx):
    h = await asbx.commands.run("cat", background=True, stdin=True)
    await asbx.commands.send_stdin(h.pid, "one\n")
    await asbx.commands.close_stdin(h.pid)
    r = await h.wait()
    assert r.stdout == "one\n"


def zombie_children(pid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if rest[0] == "Z" and int(rest[1]) == pid:
                out.append(int(name))
    return out


def test_orphans_are_reaped(sbx, envd, workdir):
    # The subshell exits at once, orphaning `sleep`; it is re-parented to envd (PID 1 in a sandbox,
    # a child subreaper here) and must not stay a zombie after it exits.
    marker = os.path.join(workdir, "orphan.pid")
    sbx.commands.run(f"(sleep 1 > /dev/null 2>&1 & echo $! > {marker}) ; exit 0")
    orphan = int(open(marker).read())
    try:
        with open(f"/proc/{orphan}/stat") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    except FileNotFoundError:
        pytest.skip("orphan already gone")
    if ppid != envd.proc.pid:
        pytest.skip("envd could not become a child subreaper here")
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{orphan}"):
        assert time.monotonic() < deadline, f"orphan {orphan} was not reaped (zombies: {zombie_children(envd.proc.pid)})"
        time.sleep(0.1)
    assert sbx.commands.run("echo still-fine").stdout == "still-fine\n"


def test_background_child_holding_stdout_does_not_block_end(sbx):
    start = time.monotonic()
    r = sbx.commands.run("echo main; sleep 3 &")
    assert r.stdout == "main\n"
    assert time.monotonic() - start < 2, "end waited for a background child's EOF"
