"""sudo inside sandboxes (sync Python SDK): `sudo` resolves to the sudo-over-envd shim, because gVisor's
forced no_new_privs stops the setuid /usr/bin/sudo from elevating (see agentenv/envd/sudo.py)."""

from __future__ import annotations

import secrets
import threading

import pytest
from e2b import CommandExitException, Sandbox

from e2e_util import new_tag, wait_until


def test_sudo_resolves_to_the_shim(sbx: Sandbox):
    assert sbx.commands.run("command -v sudo").stdout == "/usr/local/bin/sudo\n"
    assert sbx.commands.run("bash -lc 'command -v sudo'").stdout == "/usr/local/bin/sudo\n"


def test_sudo_runs_as_root(sbx: Sandbox):
    assert sbx.commands.run("whoami").stdout == "user\n"
    assert sbx.commands.run("sudo -n whoami").stdout == "root\n"
    assert sbx.commands.run("sudo whoami").stdout == "root\n"
    r = sbx.commands.run("sudo apt-get --version")
    assert r.exit_code == 0 and r.stdout.startswith("apt ")


def test_sudo_writes_root_owned_files(sbx: Sandbox):
    path = f"/etc/agentenv-sudo-{new_tag()}"
    sbx.commands.run(f"echo hello | sudo tee {path} >/dev/null")
    assert sbx.commands.run(f"stat -c '%U %s' {path}").stdout == "root 6\n"
    sbx.commands.run(f"sudo rm {path}")


def test_sudo_other_user_and_env(sbx: Sandbox):
    assert sbx.commands.run("sudo -u nobody id -u").stdout == "65534\n"
    out = sbx.commands.run("FOO=caller sudo env", envs={"BAR": "x"}).stdout
    env = dict(line.split("=", 1) for line in out.splitlines())
    assert "FOO" not in env and "BAR" not in env
    assert env["HOME"] == "/root" and env["USER"] == "root" and env["SUDO_USER"] == "user"
    assert sbx.commands.run("FOO=caller sudo -E sh -c 'echo $FOO'").stdout == "caller\n"
    assert sbx.commands.run("sudo FOO=assigned sh -c 'echo $FOO'").stdout == "assigned\n"
    assert sbx.commands.run("sudo -i pwd").stdout == "/root\n"
    assert sbx.commands.run("cd /tmp && sudo pwd").stdout == "/tmp\n"


def test_sudo_exit_code_propagates(sbx: Sandbox):
    with pytest.raises(CommandExitException) as info:
        sbx.commands.run("sudo sh -c 'exit 7'")
    assert info.value.exit_code == 7


def test_sudo_stdin_piping(sbx: Sandbox):
    assert sbx.commands.run("echo hi | sudo cat").stdout == "hi\n"


def test_sudo_flags(sbx: Sandbox):
    assert sbx.commands.run("sudo -v && sudo -k && echo ok").stdout == "ok\n"
    assert "may run the following commands" in sbx.commands.run("sudo -l").stdout
    with pytest.raises(CommandExitException) as info:
        sbx.commands.run("sudo --frobnicate true")
    assert info.value.exit_code == 1
    assert "unrecognized option" in info.value.stderr


def test_sudo_for_a_user_not_allowed(sbx: Sandbox):
    name = "nosudo" + new_tag()[:6]
    sbx.commands.run(f"useradd -m -s /bin/bash {name}", user="root")
    assert sbx.commands.run("whoami", user=name).stdout == f"{name}\n"
    with pytest.raises(CommandExitException) as info:
        sbx.commands.run("sudo whoami", user=name)
    assert info.value.exit_code == 1
    assert info.value.stdout == ""
    assert f"{name} is not in the sudoers file" in info.value.stderr
    # becoming allowed: a sudoers.d line (or membership of group sudo)
    sbx.commands.run(f"echo '{name} ALL=(ALL) NOPASSWD: ALL' > /etc/sudoers.d/{name}", user="root")
    assert sbx.commands.run("sudo whoami", user=name).stdout == "root\n"


def test_killing_sudo_kills_the_command(sbx: Sandbox):
    token = f"41.{secrets.randbelow(10**8):08d}"  # a unique argument to find the process by
    handle = sbx.commands.run(f"sudo sleep {token}", background=True)

    def running() -> bool:
        return sbx.commands.run(f"pgrep -f '^sleep {token}' || true").stdout.strip() != ""

    wait_until(running, "the sudo'd sleep to start", limit=30)
    assert handle.kill() is True
    with pytest.raises(CommandExitException):
        handle.wait()
    wait_until(lambda: not running(), "the sudo'd sleep to die", limit=30)


def test_sudo_in_a_pty(sbx: Sandbox):
    """Interactive use: the terminal is the command's stdio (this gVisor's PTYs deliver no Ctrl-C
    SIGINT at all, so signal forwarding is tested with kill below)."""
    from e2b import PtySize

    chunks: list[bytes] = []
    lock = threading.Lock()

    def text() -> str:
        with lock:
            return b"".join(chunks).decode("utf-8", "replace")

    def add(chunk: bytes) -> None:
        with lock:
            chunks.append(bytes(chunk))

    handle = sbx.pty.create(PtySize(rows=24, cols=80))
    errors: list[BaseException] = []

    def read() -> None:
        try:
            handle.wait(on_pty=add)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        sbx.pty.send_stdin(handle.pid, b"sudo sh -c 'test -t 0 && test -t 1 && echo tty-$(id -u)-ok'\n")
        wait_until(lambda: "tty-0-ok" in text(), "sudo output in the PTY", limit=30)
        sbx.pty.send_stdin(handle.pid, b"sudo sh -c 'read x; echo got-$x-$(id -u)'\n")
        wait_until(lambda: sbx.commands.run("pgrep -f '^sh -c read x' || true").stdout.strip(),
                   "the sudo'd shell to start", limit=30)
        sbx.pty.send_stdin(handle.pid, b"typed\n")
        wait_until(lambda: "got-typed-0" in text(), "sudo reading the terminal", limit=30)
        sbx.pty.send_stdin(handle.pid, b"exit 0\n")
        reader.join(timeout=60)
        assert not reader.is_alive() and not errors, errors
    finally:
        if reader.is_alive():
            sbx.pty.kill(handle.pid)
            reader.join(timeout=30)


def test_signals_to_sudo_reach_the_command(sbx: Sandbox):
    token = f"43.{secrets.randbelow(10**8):08d}"
    handle = sbx.commands.run(f"sudo sleep {token}", background=True)
    wait_until(lambda: sbx.commands.run(f"pgrep -f '^sleep {token}' || true").stdout.strip(),
               "the sudo'd sleep to start", limit=30)
    sbx.commands.run(f"pkill -INT -f 'agentenv.envd.sudo sleep {token}'")
    with pytest.raises(CommandExitException) as info:
        handle.wait()
    assert info.value.exit_code == 128 + 2
    assert sbx.commands.run(f"pgrep -f '^sleep {token}' || true").stdout == ""


def test_sudo_survives_pause_and_resume(sandbox_factory):
    """envd's listening Unix socket (and sockets of finished sudo calls) must not block a checkpoint."""
    sbx = sandbox_factory.create()
    assert sbx.commands.run("sudo whoami").stdout == "root\n"
    assert sbx.pause() is True
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=600)
    assert resumed.commands.run("sudo whoami").stdout == "root\n"
    assert resumed.commands.run("echo again | sudo cat").stdout == "again\n"


def test_pause_with_a_sudo_command_running(sandbox_factory):
    sbx = sandbox_factory.create()
    token = f"44.{secrets.randbelow(10**8):08d}"
    handle = sbx.commands.run(f"sudo sh -c 'sleep {token}; exit 5'", background=True)
    wait_until(lambda: sbx.commands.run(f"pgrep -f '^sleep {token}' || true").stdout.strip(),
               "the sudo'd sleep to start", limit=30)
    pid = handle.pid
    handle.disconnect()
    assert sbx.pause() is True
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=600)
    assert resumed.commands.run(f"pgrep -f '^sleep {token}' || true").stdout.strip()
    resumed.commands.run(f"sudo pkill -f '^sleep {token}'")
    with pytest.raises(CommandExitException) as info:
        resumed.commands.connect(pid).wait()
    assert info.value.exit_code == 5
