"""Commands and PTY through the sync Python SDK (one shared sandbox)."""

from __future__ import annotations

import threading

import pytest
from e2b import CommandExitException, PtySize, Sandbox, SandboxException

from e2e_util import new_tag, wait_until


def test_run_stdout_stderr_exit_code(sbx: Sandbox):
    result = sbx.commands.run("echo out-line; echo err-line >&2; printf 'no newline'")
    assert result.exit_code == 0
    assert result.stdout == "out-line\nno newline"
    assert result.stderr == "err-line\n"
    assert not result.error


def test_non_zero_exit_raises(sbx: Sandbox):
    with pytest.raises(CommandExitException) as info:
        sbx.commands.run("echo partial; echo bad >&2; exit 7")
    assert info.value.exit_code == 7
    assert info.value.stdout == "partial\n"
    assert info.value.stderr == "bad\n"


def test_on_stdout_streams_before_the_command_ends(sbx: Sandbox):
    """The command blocks after its first line until the test reacts to that line.

    Without streaming the first chunk would only arrive after the command ended, which it can
    only do by giving up (exit 3) — so the test fails instead of hanging.
    """
    gate = f"/tmp/stream-gate-{new_tag()}"
    seen: list[str] = []

    def on_stdout(chunk: str) -> None:
        seen.append(chunk)
        if "first" in "".join(seen) and not any("opened" in s for s in seen):
            sbx.files.write(gate, "go")
            seen.append("<opened>")

    cmd = (
        "echo first; "
        f"for i in $(seq 600); do [ -e {gate} ] && break; sleep 0.1; done; "
        f"[ -e {gate} ] || {{ echo gave-up; exit 3; }}; echo second"
    )
    result = sbx.commands.run(cmd, on_stdout=on_stdout, timeout=120)
    assert result.stdout == "first\nsecond\n"
    joined = "".join(seen)
    assert joined.index("first") < joined.index("<opened>") < joined.index("second")


def test_on_stderr_callback(sbx: Sandbox):
    errs: list[str] = []
    result = sbx.commands.run("echo to-stderr >&2", on_stderr=errs.append)
    assert "".join(errs) == "to-stderr\n" == result.stderr


def test_cwd(sbx: Sandbox):
    assert sbx.commands.run("pwd").stdout == "/home/user\n"
    assert sbx.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
    sbx.files.make_dir("/home/user/cwd-test/inner")
    assert sbx.commands.run("pwd", cwd="/home/user/cwd-test/inner").stdout == "/home/user/cwd-test/inner\n"


def test_missing_cwd_is_an_error(sbx: Sandbox):
    with pytest.raises(SandboxException) as info:
        sbx.commands.run("pwd", cwd="/definitely/not/here")
    # rejected by envd (invalid_argument), not run and failed inside the sandbox
    assert not isinstance(info.value, CommandExitException)


def test_envs(sbx: Sandbox):
    result = sbx.commands.run('echo "$FOO|$BAR"', envs={"FOO": "foo value", "BAR": "b=a=r"})
    assert result.stdout == "foo value|b=a=r\n"
    # per-command envs do not leak into later commands
    assert sbx.commands.run('echo "[$FOO]"').stdout == "[]\n"


def test_users(sbx: Sandbox):
    assert sbx.commands.run("whoami").stdout == "user\n"
    assert sbx.commands.run("whoami", user="root").stdout == "root\n"
    assert sbx.commands.run("echo $HOME", user="root").stdout == "/root\n"
    assert sbx.commands.run("echo $HOME").stdout == "/home/user\n"


def test_background_wait(sbx: Sandbox):
    handle = sbx.commands.run("sleep 1; echo bg-done; exit 0", background=True)
    assert handle.pid > 0
    result = handle.wait()
    assert result.exit_code == 0
    assert result.stdout == "bg-done\n"


def test_background_kill(sbx: Sandbox):
    handle = sbx.commands.run("sleep 600", background=True)
    assert handle.pid in {p.pid for p in sbx.commands.list()}
    assert sbx.commands.kill(handle.pid) is True
    with pytest.raises(CommandExitException) as info:
        handle.wait()
    assert info.value.exit_code != 0
    assert handle.pid not in {p.pid for p in sbx.commands.list()}
    assert sbx.commands.kill(handle.pid) is False


def test_handle_kill(sbx: Sandbox):
    handle = sbx.commands.run("sleep 600", background=True)
    assert handle.kill() is True
    with pytest.raises(CommandExitException):
        handle.wait()


def test_send_stdin(sbx: Sandbox):
    handle = sbx.commands.run("cat", background=True, stdin=True)
    try:
        sbx.commands.send_stdin(handle.pid, "hello\n")
        handle.send_stdin("world\n")
        sbx.commands.close_stdin(handle.pid)
        result = handle.wait()
    finally:
        sbx.commands.kill(handle.pid)
    assert result.stdout == "hello\nworld\n"


def test_list_shows_running_commands(sbx: Sandbox):
    marker = new_tag()
    handle = sbx.commands.run(f"sleep 600 # {marker}", background=True, envs={"MARK": marker}, cwd="/tmp")
    try:
        procs = {p.pid: p for p in sbx.commands.list()}
        assert handle.pid in procs
        info = procs[handle.pid]
        assert info.cmd == "/bin/bash"
        assert any(marker in a for a in info.args)
        assert info.envs.get("MARK") == marker
        assert info.cwd == "/tmp"
    finally:
        sbx.commands.kill(handle.pid)


def test_connect_to_running_command(sbx: Sandbox):
    handle = sbx.commands.run("cat; echo cat-ended; exit 5", background=True, stdin=True)
    try:
        handle.disconnect()
        # the process keeps running after the first stream is gone
        assert handle.pid in {p.pid for p in sbx.commands.list()}
        connected = sbx.commands.connect(handle.pid)
        assert connected.pid == handle.pid
        sbx.commands.send_stdin(handle.pid, "after-connect\n")
        sbx.commands.close_stdin(handle.pid)
        with pytest.raises(CommandExitException) as info:
            connected.wait()
    finally:
        sbx.commands.kill(handle.pid)
    assert info.value.exit_code == 5
    assert info.value.stdout == "after-connect\ncat-ended\n"


def test_connect_to_unknown_pid_fails(sbx: Sandbox):
    with pytest.raises(SandboxException):
        sbx.commands.connect(999_999).wait()


class PtyReader:
    """Collects PTY output of a sync PTY handle in a background thread."""

    def __init__(self, handle) -> None:
        self.handle = handle
        self._chunks: list[bytes] = []
        self._lock = threading.Lock()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.handle.wait(on_pty=self._add)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def _add(self, chunk: bytes) -> None:
        with self._lock:
            self._chunks.append(bytes(chunk))

    def text(self) -> str:
        with self._lock:
            return b"".join(self._chunks).decode("utf-8", "replace")


def test_pty_input_and_resize(sbx: Sandbox):
    handle = sbx.pty.create(PtySize(rows=24, cols=80))
    reader = PtyReader(handle)
    try:
        # the terminal echoes input; "$((6*7))" only becomes 42 when the shell runs it
        sbx.pty.send_stdin(handle.pid, b"echo pty-$((6*7))-ok; stty size\n")
        wait_until(lambda: "pty-42-ok" in reader.text(), "PTY command output")
        wait_until(lambda: "24 80" in reader.text(), "stty size 24 80")
        sbx.pty.resize(handle.pid, PtySize(rows=40, cols=123))
        sbx.pty.send_stdin(handle.pid, b"stty size; tty\n")
        wait_until(lambda: "40 123" in reader.text(), "stty size after resize")
        wait_until(lambda: "/dev/pts/" in reader.text(), "tty naming the PTY")  # may arrive in a later chunk
        sbx.pty.send_stdin(handle.pid, b"exit 0\n")
        reader.thread.join(timeout=60)
        assert not reader.thread.is_alive(), "PTY did not end after exit"
        assert reader.error is None, reader.error
    finally:
        if reader.thread.is_alive():
            sbx.pty.kill(handle.pid)
            reader.thread.join(timeout=30)


def test_pty_kill(sbx: Sandbox):
    handle = sbx.pty.create(PtySize(rows=10, cols=40))
    reader = PtyReader(handle)
    assert sbx.pty.kill(handle.pid) is True
    reader.thread.join(timeout=60)
    assert not reader.thread.is_alive()
    assert handle.pid not in {p.pid for p in sbx.commands.list()}
