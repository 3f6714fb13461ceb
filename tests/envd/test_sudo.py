"""sudo over envd (agentenv.envd.sudo): a real envd on the host serving the sudo socket at a temp path,
and the client run as temporary OS users (one in group `sudo`, one not)."""

from __future__ import annotations

import grp
import os
import pwd
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.envd import sudo as sudo_mod
from agentenv.envd.sudo import SECURE_PATH, UsageError, authorised, parse_args, shell_escape_join

ROOT = str(Path(__file__).resolve().parents[2])
CLIENT_CODE = (
    f"import sys; sys.path.insert(0, {ROOT!r}); from agentenv.envd.sudo import main; sys.exit(main())"
)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (users, setuid)")


# --- pure parts --------------------------------------------------------------------------------


def test_parse_plain_command():
    o = parse_args(["apt-get", "install", "-y", "x"])
    assert o.mode == "run" and o.command == ["apt-get", "install", "-y", "x"] and o.user is None


def test_parse_flags_stop_at_first_non_option():
    o = parse_args(["-nE", "-u", "nobody", "ls", "-l", "-u"])
    assert o.preserve_env and o.user == "nobody" and o.command == ["ls", "-l", "-u"]
    assert parse_args(["-unobody", "id"]).user == "nobody"
    assert parse_args(["--user=nobody", "id"]).user == "nobody"
    assert parse_args(["--", "-weird"]).command == ["-weird"]
    assert parse_args(["-S", "-p", "pw:", "-H", "true"]).set_home


def test_parse_assignments_login_shell_and_modes():
    o = parse_args(["FOO=bar", "X_1=", "env"])
    assert o.assign == {"FOO": "bar", "X_1": ""} and o.command == ["env"]
    assert parse_args(["-i"]).login and parse_args(["-s"]).shell
    assert parse_args(["-i", "whoami"]).command == ["whoami"]
    assert parse_args(["--preserve-env=A,B", "env"]).preserve_list == ["A", "B"]
    for flag, mode in (("-v", "validate"), ("-k", "kill"), ("-K", "kill"), ("-l", "list"), ("-V", "version"),
                       ("-h", "help")):
        assert parse_args([flag]).mode == mode


@pytest.mark.parametrize("argv", [["-x", "ls"], ["--bogus", "ls"], [], ["-u"], ["-i", "-s"], ["FOO=bar"]])
def test_parse_errors(argv):
    with pytest.raises(UsageError):
        parse_args(argv)


def test_shell_escape_like_sudo():
    assert shell_escape_join(["echo", "a b", "$HOME", "x;y"]) == "echo a\\ b $HOME x\\;y"


def test_authorised_by_sudoers_d_lines(tmp_path: Path):
    me = pwd.getpwuid(os.getuid())
    assert authorised(0, str(tmp_path))[0]
    nobody = pwd.getpwnam("nobody")
    assert authorised(nobody.pw_uid, str(tmp_path)) == (False, "nobody")
    (tmp_path / "nobody").write_text("# nobody ALL=(ALL) ALL\n")
    assert not authorised(nobody.pw_uid, str(tmp_path))[0]
    (tmp_path / "skipped.conf").write_text("nobody ALL=(ALL:ALL) NOPASSWD: ALL\n")  # '.' names are skipped
    assert not authorised(nobody.pw_uid, str(tmp_path))[0]
    (tmp_path / "nobody").write_text("nobody ALL=(ALL:ALL) NOPASSWD: ALL\n")
    assert authorised(nobody.pw_uid, str(tmp_path)) == (True, "nobody")
    (tmp_path / "nobody").unlink()
    group = grp.getgrgid(nobody.pw_gid).gr_name
    (tmp_path / "grp").write_text(f"%{group}   ALL = (ALL) ALL\n")
    assert authorised(nobody.pw_uid, str(tmp_path))[0]
    assert me  # (the current user is root in CI)


def test_shim_install_is_idempotent_and_respects_foreign_files(tmp_path: Path):
    from agentenv.storage.images import SUDO_SHIM_PATH, ensure_sudo_shim, sudo_shim_text

    rootfs = tmp_path / "rootfs"
    ensure_sudo_shim(rootfs)
    shim = rootfs / SUDO_SHIM_PATH
    text = shim.read_text()
    assert text == sudo_shim_text() and text.startswith("#!/bin/sh\n")
    assert "-m agentenv.envd.sudo \"$@\"" in text and "/.agentenv/bin/python3 -I" in text
    assert shim.stat().st_mode & 0o777 == 0o755
    inode = shim.stat().st_ino
    ensure_sudo_shim(rootfs)
    assert shim.stat().st_ino == inode  # untouched when current
    # an outdated shim shared by hard link with another tree is replaced, not rewritten in place
    shim.write_text("#!/bin/sh\n# agentenv sudo shim: old\nexec false\n")
    twin = tmp_path / "twin"
    os.link(shim, twin)
    ensure_sudo_shim(rootfs)
    assert shim.read_text() == sudo_shim_text() and "old" in twin.read_text()
    # somebody else's /usr/local/bin/sudo stays
    shim.unlink()
    shim.write_text("#!/bin/sh\necho mine\n")
    ensure_sudo_shim(rootfs)
    assert shim.read_text() == "#!/bin/sh\necho mine\n"


# --- against a real envd -------------------------------------------------------------------------


def _client_python() -> str:
    """An interpreter the unprivileged test users can run (/root/... pyenv builds are not readable)."""
    for cand in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(cand):
            return cand
    pytest.skip("no system python3 for the unprivileged client")


def _make_user(prefix: str, groups: list[str]) -> pwd.struct_passwd:
    name = prefix + secrets.token_hex(3)
    cmd = ["useradd", "-m", "-s", "/bin/bash"]
    if groups:
        cmd += ["-G", ",".join(groups)]
    subprocess.run(cmd + [name], check=True, timeout=30, capture_output=True)
    return pwd.getpwnam(name)


def _remove_user(pw: pwd.struct_passwd) -> None:
    out = subprocess.run(["pgrep", "-u", pw.pw_name], capture_output=True, text=True, timeout=10)
    for pid in out.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    subprocess.run(["userdel", "-r", pw.pw_name], timeout=30, capture_output=True)


@pytest.fixture(scope="module")
def users() -> Iterator[dict[str, pwd.struct_passwd]]:
    if os.geteuid() != 0:
        pytest.skip("needs root (users, setuid)")
    try:
        grp.getgrnam("sudo")
    except KeyError:
        subprocess.run(["groupadd", "--system", "sudo"], check=True, timeout=30, capture_output=True)
    made: dict[str, pwd.struct_passwd] = {}
    try:
        made["sudoer"] = _make_user("aesudo", ["sudo"])
        made["plain"] = _make_user("aeplain", [])
        yield made
    finally:
        for pw in made.values():
            _remove_user(pw)


@pytest.fixture(scope="module")
def sock_dir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="aesudo-", dir="/tmp")
    os.chmod(d, 0o755)  # the unprivileged client must reach the socket
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def sudo_envd(envd_factory, sock_dir):
    path = os.path.join(sock_dir, f"sudo-{secrets.token_hex(3)}.sock")
    server = envd_factory({sudo_mod.SOCKET_ENV: path})
    deadline = time.monotonic() + 10
    while not os.path.exists(path):
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(0.05)
    assert os.stat(path).st_mode & 0o777 == 0o666
    server.sudo_socket = path
    return server


def _client(envd, pw: pwd.struct_passwd, args: list[str], *, env: dict | None = None, cwd: str | None = None,
            **kw) -> subprocess.Popen:
    base = {"PATH": "/usr/bin:/bin", "HOME": pw.pw_dir, "USER": pw.pw_name, "LANG": "C.UTF-8",
            sudo_mod.SOCKET_ENV: envd.sudo_socket}
    base.update(env or {})
    return subprocess.Popen(
        [_client_python(), "-I", "-c", CLIENT_CODE, *args], env=base, cwd=cwd or pw.pw_dir,
        user=pw.pw_uid, group=pw.pw_gid, extra_groups=os.getgrouplist(pw.pw_name, pw.pw_gid),
        stdout=kw.pop("stdout", subprocess.PIPE), stderr=kw.pop("stderr", subprocess.PIPE),
        stdin=kw.pop("stdin", subprocess.DEVNULL), text=True, **kw,
    )


def run_sudo(envd, pw, args, *, input: str | None = None, **kw) -> subprocess.CompletedProcess:
    p = _client(envd, pw, args, stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL, **kw)
    out, err = p.communicate(input, timeout=30)
    return subprocess.CompletedProcess(args, p.returncode, out, err)


@needs_root
def test_runs_as_root(sudo_envd, users):
    r = run_sudo(sudo_envd, users["sudoer"], ["whoami"])
    assert (r.returncode, r.stdout, r.stderr) == (0, "root\n", "")
    r = run_sudo(sudo_envd, users["sudoer"], ["-n", "id", "-u"])
    assert r.stdout == "0\n"


@needs_root
def test_other_target_user(sudo_envd, users):
    r = run_sudo(sudo_envd, users["sudoer"], ["-u", "nobody", "id", "-u"])
    assert (r.returncode, r.stdout) == (0, f"{pwd.getpwnam('nobody').pw_uid}\n"), r.stderr
    r = run_sudo(sudo_envd, users["sudoer"], ["-u", "nosuchuser" + secrets.token_hex(2), "true"])
    assert r.returncode == 1 and "unknown user" in r.stderr


@needs_root
def test_exit_codes_and_signals(sudo_envd, users):
    assert run_sudo(sudo_envd, users["sudoer"], ["sh", "-c", "exit 7"]).returncode == 7
    assert run_sudo(sudo_envd, users["sudoer"], ["sh", "-c", "kill -TERM $$"]).returncode == 128 + 15
    r = run_sudo(sudo_envd, users["sudoer"], ["no-such-command-" + secrets.token_hex(2)])
    assert r.returncode == 1 and "command not found" in r.stderr


@needs_root
def test_stdio_and_cwd(sudo_envd, users):
    pw = users["sudoer"]
    r = run_sudo(sudo_envd, pw, ["cat"], input="hi\n")
    assert r.stdout == "hi\n"
    r = run_sudo(sudo_envd, pw, ["sh", "-c", "echo out; echo err >&2; pwd"], cwd="/tmp")
    assert r.stdout == "out\n/tmp\n" and r.stderr == "err\n"
    r = run_sudo(sudo_envd, pw, ["-i", "pwd"], cwd="/tmp")
    assert r.stdout == "/root\n"


@needs_root
def test_tty_stdin_is_passed_through(sudo_envd, users):
    pw = users["sudoer"]
    master, slave = os.openpty()
    try:
        os.fchown(slave, pw.pw_uid, -1)
        p = _client(sudo_envd, pw, ["sh", "-c", "test -t 0 && echo tty"], stdin=slave)
        out, err = p.communicate(timeout=30)
    finally:
        os.close(slave)
        os.close(master)
    assert (p.returncode, out) == (0, "tty\n"), err


@needs_root
def test_environment_reset_and_preserve(sudo_envd, users):
    pw = users["sudoer"]
    extra = {"FOO": "caller", "LC_ALL": "C.UTF-8", "TERM": "xterm"}
    env = dict(line.split("=", 1) for line in run_sudo(sudo_envd, pw, ["env"], env=extra).stdout.splitlines())
    assert "FOO" not in env and env["LC_ALL"] == "C.UTF-8" and env["TERM"] == "xterm"
    assert env["HOME"] == "/root" and env["USER"] == env["LOGNAME"] == "root" and env["PATH"] == SECURE_PATH
    assert (env["SUDO_USER"], env["SUDO_UID"], env["SUDO_GID"]) == (pw.pw_name, str(pw.pw_uid), str(pw.pw_gid))
    env = dict(line.split("=", 1) for line in run_sudo(sudo_envd, pw, ["-E", "env"], env=extra).stdout.splitlines())
    assert env["FOO"] == "caller" and env["HOME"] == pw.pw_dir and env["USER"] == "root"
    r = run_sudo(sudo_envd, pw, ["-EH", "sh", "-c", "echo $HOME"], env=extra)
    assert r.stdout == "/root\n"
    r = run_sudo(sudo_envd, pw, ["BAR=value", "sh", "-c", "echo $BAR"])
    assert r.stdout == "value\n"


@needs_root
def test_shell_modes(sudo_envd, users):
    pw = users["sudoer"]
    r = run_sudo(sudo_envd, pw, ["-s", "echo", "a  b"])
    assert r.stdout == "a  b\n", r.stderr
    r = run_sudo(sudo_envd, pw, ["-i"], input="id -u\nexit 3\n")
    assert (r.returncode, r.stdout) == (3, "0\n"), r.stderr


@needs_root
def test_noop_and_info_flags(sudo_envd, users):
    pw = users["sudoer"]
    for flags in (["-v"], ["-k"], ["-K"], ["-nv"]):
        assert run_sudo(sudo_envd, pw, flags).returncode == 0
    r = run_sudo(sudo_envd, pw, ["-l"])
    assert r.returncode == 0 and f"User {pw.pw_name} may run" in r.stdout
    r = run_sudo(sudo_envd, pw, ["-y", "true"])
    assert r.returncode == 1 and "invalid option -- 'y'" in r.stderr and "usage:" in r.stderr
    assert run_sudo(sudo_envd, pw, []).returncode == 1


@needs_root
def test_user_not_allowed(sudo_envd, users):
    pw = users["plain"]
    r = run_sudo(sudo_envd, pw, ["whoami"])
    assert r.returncode == 1 and r.stdout == ""
    assert f"{pw.pw_name} is not in the sudoers file" in r.stderr
    r = run_sudo(sudo_envd, pw, ["-l"])
    assert r.returncode == 1 and "not in the sudoers file" in r.stderr


def _wait_for_proc(token: str, present: bool, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while True:
        out = subprocess.run(["pgrep", "-f", token], capture_output=True, text=True).stdout.split()
        if bool(out) == present:
            return
        assert time.monotonic() < deadline, f"process {token!r} present={bool(out)}"
        time.sleep(0.05)


@needs_root
def test_signals_are_forwarded(sudo_envd, users):
    token = f"37.{secrets.randbelow(10**8):08d}"
    p = _client(sudo_envd, users["sudoer"], ["sleep", token])
    try:
        _wait_for_proc(f"^sleep {token}", True)
        p.send_signal(signal.SIGINT)
        p.wait(timeout=10)
        assert p.returncode == 128 + signal.SIGINT
        _wait_for_proc(f"^sleep {token}", False)
    finally:
        p.kill()
        p.communicate()


@needs_root
def test_killed_client_takes_the_command_along(sudo_envd, users):
    token = f"38.{secrets.randbelow(10**8):08d}"
    p = _client(sudo_envd, users["sudoer"], ["sh", "-c", f"sleep {token}; true"])
    try:
        _wait_for_proc(f"^sleep {token}", True)
        p.kill()
        p.wait(timeout=10)
        _wait_for_proc(f"^sleep {token}", False)
    finally:
        p.kill()
        p.communicate()


@needs_root
def test_concurrent_requests(sudo_envd, users):
    procs = [_client(sudo_envd, users["sudoer"], ["sh", "-c", f"sleep 0.3; echo {i}"]) for i in range(8)]
    outs = [p.communicate(timeout=30)[0] for p in procs]
    assert outs == [f"{i}\n" for i in range(8)]
    assert all(p.returncode == 0 for p in procs)


@needs_root
def test_envd_without_socket_setting_on_host_serves_no_sudo(envd):
    # the session envd (not PID 1, no AGENTENV_ENVD_SUDO_SOCKET) must not touch the host's /run/agentenv
    assert "sudo service" not in envd.log_tail(200)
    assert re.search(r"envd listening", envd.log_tail(200))
