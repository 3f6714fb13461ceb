"""`agentenv sandbox exec` and `agentenv sandbox shell` against the real server.

exec: output streams while the command runs, stdout/stderr stay apart, the exit code passes
through (signals as 128+N), stdin is forwarded with -i. shell: a real PTY (pexpect) through envd,
typing, resize on SIGWINCH, Ctrl-C reaching the sandbox, the exit code, and the local terminal
restored afterwards.
"""

from __future__ import annotations

import hashlib
import os
import select
import signal
import subprocess
import time

import pexpect
import pytest

from cli_util import run_cli
from serverproc import agentenv_executable


def test_exec_streams_output_while_the_command_runs(server, sid):
    proc = subprocess.Popen([agentenv_executable(), "sandbox", "exec", sid, "--",
                             "echo first; sleep 4; echo second"],
                            env=server.sdk_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL)
    try:
        started = time.monotonic()
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready, "no output within 30 s"
        first = proc.stdout.readline()
        seen_at = time.monotonic() - started
        still_running = proc.poll() is None
        rest, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert first == b"first\n"
    assert still_running, f"the first line came only after the command ended ({seen_at:.1f}s)"
    assert rest == b"second\n", (rest, err)
    assert proc.returncode == 0


def test_exec_keeps_stdout_and_stderr_apart_and_passes_the_exit_code(server, sid):
    p = run_cli(server, "sandbox", "exec", sid, "--", "echo out; echo err >&2; exit 7", check=False)
    assert (p.returncode, p.stdout, p.stderr) == (7, b"out\n", b"err\n")
    assert run_cli(server, "sandbox", "exec", sid, "--", "false", check=False).returncode == 1
    assert run_cli(server, "sandbox", "exec", sid, "--", "true").returncode == 0


def test_exec_reports_a_signal_as_128_plus_its_number(server, sid):
    assert run_cli(server, "sandbox", "exec", sid, "--", "kill -9 $$", check=False).returncode == 137
    assert run_cli(server, "sandbox", "exec", sid, "--", "kill -TERM $$", check=False).returncode == 143


def test_exec_quotes_several_arguments_and_takes_user_cwd_env(server, sid):
    p = run_cli(server, "sandbox", "exec", sid, "--", "printf", "%s|", "a b", "$HOME", "c;d")
    assert p.stdout == b"a b|$HOME|c;d|"  # each argument verbatim: no word splitting, no expansion
    p = run_cli(server, "sandbox", "exec", "-u", "root", "-w", "/tmp", "-e", "GREETING=hi there", sid, "--",
                'echo "$GREETING|$(pwd)|$(whoami)"')
    assert p.stdout == b"hi there|/tmp|root\n"
    assert run_cli(server, "sandbox", "exec", sid, "--", "whoami").stdout == b"user\n"


def test_exec_forwards_stdin_with_i(server, sid):
    data = os.urandom(300_000)
    p = run_cli(server, "sandbox", "exec", "-i", sid, "--", "sha256sum", input=data)
    assert p.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest()
    # without -i the command reads /dev/null and ends
    p = run_cli(server, "sandbox", "exec", sid, "--", "wc -c", input=b"ignored")
    assert p.stdout.strip() == b"0"


def test_exec_timeout_kills_the_command_with_124(server, sid):
    t0 = time.monotonic()
    p = run_cli(server, "sandbox", "exec", "--timeout", "2", sid, "--", "echo started; sleep 60", check=False)
    assert p.returncode == 124, (p.stdout, p.stderr)
    assert p.stdout == b"started\n" and b"did not finish within 2s" in p.stderr
    assert time.monotonic() - t0 < 30


def _sigint_as_in_a_terminal() -> None:
    # A background job (CI runs the suite without a terminal) inherits SIGINT ignored, and Python
    # then installs no KeyboardInterrupt handler; a Ctrl-C in a terminal reaches a default handler.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_kills_the_remote_command_and_exits_130(server, sid):
    proc = subprocess.Popen([agentenv_executable(), "sandbox", "exec", sid, "--",
                             "echo started; exec sleep 1234"],
                            env=server.sdk_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, preexec_fn=_sigint_as_in_a_terminal)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready and proc.stdout.readline() == b"started\n"
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    # the pattern's brackets keep pgrep from matching this very command line
    left = run_cli(server, "sandbox", "exec", sid, "--", "pgrep -f '[s]leep 1234' || echo none").stdout
    assert left == b"none\n"


def test_exec_into_a_closed_pipe_ends_the_remote_command(server, sid):
    cmd = f"{agentenv_executable()} sandbox exec {sid} -- 'echo $$ > /tmp/yes.pid; exec yes' | head -2"
    p = subprocess.run(["/bin/bash", "-o", "pipefail", "-c", cmd], env=server.sdk_env(), capture_output=True,
                       timeout=120)
    assert p.stdout == b"y\ny\n" and b"Traceback" not in p.stderr, p.stderr
    assert p.returncode == 141  # 128 + SIGPIPE, as `yes | head` in a shell
    left = run_cli(server, "sandbox", "exec", sid, "--", "kill -0 $(cat /tmp/yes.pid) 2>/dev/null || echo gone")
    assert left.stdout == b"gone\n"


def test_exec_resumes_a_paused_sandbox(server, sandboxes):
    paused = sandboxes.create()
    run_cli(server, "sandbox", "exec", paused, "--", "echo kept > state.txt")
    run_cli(server, "sandbox", "pause", paused)
    assert run_cli(server, "sandbox", "exec", paused, "--", "cat state.txt").stdout == b"kept\n"


def test_exec_on_a_missing_sandbox_exits_125_with_the_reason(server):
    p = run_cli(server, "sandbox", "exec", "nosuchsandbox0000000", "--", "true", check=False)
    assert p.returncode == 125
    assert b"404" in p.stderr and b"Traceback" not in p.stderr


def test_exec_without_a_command_is_a_usage_error(server, sid):
    assert run_cli(server, "sandbox", "exec", sid, check=False).returncode == 2


# ---------------------------------------------------------------- shell


def _spawn_shell(server, sid: str, rows: int = 24, cols: int = 80) -> pexpect.spawn:
    env = server.sdk_env()
    env["TERM"] = "xterm"
    child = pexpect.spawn(agentenv_executable(), ["sandbox", "shell", sid], env=env, dimensions=(rows, cols),
                          timeout=60)
    child.expect(r"\$ ")  # the sandbox's bash prompt
    return child


def test_shell_typing_resize_ctrl_c_and_exit_code(server, sid):
    child = _spawn_shell(server, sid, rows=24, cols=80)
    try:
        child.sendline("echo hi-$((6*7))")
        child.expect("hi-42")  # computed by the sandbox's shell: the typed text reads hi-$((6*7))
        child.sendline("stty size")
        child.expect(r"[\r\n]24 80\r\n")
        child.setwinsize(41, 123)  # SIGWINCH to the CLI, which resizes the sandbox's PTY
        deadline = time.monotonic() + 20
        while True:
            child.sendline("stty size")
            i = child.expect([r"[\r\n]41 123\r\n", r"[\r\n]24 80\r\n"])
            if i == 0:
                break
            assert time.monotonic() < deadline, "the sandbox's PTY never got the new size"
            time.sleep(0.3)
        child.sendline("tput cols")
        child.expect(r"[\r\n]123\r\n")

        child.sendline("sleep 100; echo after-sleep-$?")
        time.sleep(1.0)
        t0 = time.monotonic()
        child.sendcontrol("c")  # raw mode: Ctrl-C is a byte for the sandbox's terminal, not our SIGINT
        child.expect(r"\$ ")
        assert time.monotonic() - t0 < 10
        assert child.isalive(), "Ctrl-C ended the CLI instead of the sandbox's sleep"
        child.sendline("echo still-$((1+1))")
        child.expect("still-2")

        child.sendline("exit 3")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 3


def _shell_between_stty(server, sid, before, after) -> pexpect.spawn:
    """`agentenv sandbox shell` in a local /bin/sh that records the terminal's settings before and after
    it into `before` and `after`, and prints the CLI's exit code as `rc=N`."""
    env = server.sdk_env()
    env["TERM"] = "xterm"
    script = (f"stty -g > {before}; {agentenv_executable()} sandbox shell {sid}; echo rc=$?; "
              f"stty -g > {after}")
    return pexpect.spawn("/bin/sh", ["-c", script], env=env, dimensions=(24, 80), timeout=60)


def test_shell_restores_the_terminal(server, sid, tmp_path):
    before, after = tmp_path / "before", tmp_path / "after"
    child = _shell_between_stty(server, sid, before, after)
    try:
        child.expect(r"\$ ")
        child.sendline("exit")
        child.expect("rc=0")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert before.read_text() == after.read_text(), "the terminal's settings changed after the shell"
    assert "-icanon" not in before.read_text()


def test_shell_ended_by_sigterm_kills_the_remote_shell_and_restores_the_terminal(server, sid, tmp_path):
    before, after = tmp_path / "before", tmp_path / "after"
    child = _shell_between_stty(server, sid, before, after)
    try:
        child.expect(r"\$ ")
        child.sendline("echo $$ > /tmp/term-shell.pid")
        child.expect(r"\$ ")
        cli_pid = int(subprocess.check_output(["pgrep", "-P", str(child.pid)]).split()[0])
        os.kill(cli_pid, signal.SIGTERM)
        child.expect("rc=143")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert before.read_text() == after.read_text(), "SIGTERM left the terminal in raw mode"
    gone = run_cli(server, "sandbox", "exec", sid, "--", "kill -0 $(cat /tmp/term-shell.pid) 2>/dev/null || echo gone")
    assert gone.stdout == b"gone\n"


def test_shell_needs_a_terminal(server, sid):
    p = run_cli(server, "sandbox", "shell", sid, check=False)  # stdin is /dev/null
    assert p.returncode == 2 and b"needs a terminal" in p.stderr


@pytest.mark.parametrize("user", ["root"])
def test_shell_as_another_user(server, sid, user):
    env = server.sdk_env()
    child = pexpect.spawn(agentenv_executable(), ["sandbox", "shell", "-u", user, sid], env=env, timeout=60)
    try:
        child.expect(r"# ")
        child.sendline("echo me=$(whoami)")
        child.expect(f"me={user}")
        child.sendeof()  # Ctrl-D ends the login shell
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
