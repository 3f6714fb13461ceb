"""sudo over envd: a `sudo` replacement for sandboxes whose runtime forbids privilege elevation.

Why: gVisor (at least release 20221219) sets PR_SET_NO_NEW_PRIVS on every sandbox process and ignores
the OCI `noNewPrivileges: false`, so setuid binaries such as /usr/bin/sudo cannot elevate
(`sudo: The "no new privileges" flag is set, which prevents sudo from running as root.`).

How: envd (root, PID 1) listens on a Unix socket (`SOCKET_PATH`, mode 0666). The client
(`python -m agentenv.envd.sudo ARGS`, run by the tools layer's interpreter through the
/usr/local/bin/sudo shim that the base image installs) parses sudo's command line, connects, and sends
one JSON request line together with its stdin/stdout/stderr as SCM_RIGHTS fds and its identity as
SCM_CREDENTIALS (kernel-checked: an unprivileged process can only state its own pid/uid/gid). envd
authorises the caller by those credentials -- not SO_PEERCRED, which gVisor 20221219 answers with the
credentials of the asking task (envd = root), so it would let everybody in -- spawns the command as the target user with those fds as its stdio, and answers
`{"exit": N}` (128+signal if the command was killed by a signal); the client exits with N.
SIGINT/SIGTERM/SIGHUP/SIGQUIT received by the client are forwarded as `{"signal": N}` lines (delivered
to the command's process group). If the client goes away before the command ends (killed, timed out),
envd kills the command's process group.

Who may use it: uid 0; members of group `sudo` (per /etc/group); and users named by a line
`NAME ALL=...` (or `%GROUP ALL=...` for one of their groups) in a file under /etc/sudoers.d (files whose
name contains '.' or ends in '~' are skipped, like sudo's includedir). Nothing else of sudoers is
interpreted: an allowed user may run anything as anyone, and there is never a password prompt.

Differences from real sudo (documented limits):
  * the command runs in its own session (envd cannot join the caller's session); a TTY passed as stdio
    is used as-is but is not the command's controlling terminal (/dev/tty is unavailable to it);
  * only the absolute path /usr/bin/sudo still runs the real (setuid) sudo, which keeps failing under
    gVisor releases that force no_new_privs; on releases that honour `noNewPrivileges: false` it works;
  * supported options: -n -E -H -S -A -B -P -k -K -v -l -V -h -i -s -u USER -g GROUP -p PROMPT -D DIR,
    their long forms, --preserve-env=LIST, `--`, and leading VAR=value assignments.
    -n/-S/-A/-B/-P/-p are accepted and ignored (there is no password), -k/-K/-v do nothing and exit 0.

Environment (env_reset emulation): keeps TERM, COLORTERM, TZ, DISPLAY, XAUTHORITY, COLORS, LS_COLORS,
HOSTNAME, PS1, PS2, DPKG_COLORS, LANG, LANGUAGE and LC_*; sets PATH to SECURE_PATH, HOME/USER/LOGNAME/
SHELL/MAIL to the target user's, and SUDO_USER/SUDO_UID/SUDO_GID/SUDO_COMMAND. With -E the caller's
environment is kept (PATH still becomes SECURE_PATH, HOME is kept unless -H).

This module is imported by envd (`SudoServer`) and run as the client; it uses only the stdlib.
"""

from __future__ import annotations

import array
import errno
import grp
import json
import os
import pwd
import re
import signal
import socket
import struct
import sys
from dataclasses import dataclass, field
from typing import Any

SOCKET_PATH = "/run/agentenv/sudo.sock"
SOCKET_ENV = "AGENTENV_ENVD_SUDO_SOCKET"
SUDO_GROUP = "sudo"
SUDOERS_DIR = "/etc/sudoers.d"
SECURE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
KEEP_ENV = {
    "TERM", "COLORTERM", "TZ", "DISPLAY", "XAUTHORITY", "COLORS", "LS_COLORS", "HOSTNAME", "PS1", "PS2",
    "DPKG_COLORS", "LANG", "LANGUAGE",
}
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
VERSION_TEXT = "Sudo version 1.9 (agentenv: sudo over envd)\n"
USAGE = (
    "usage: sudo -h | -K | -k | -V\n"
    "usage: sudo -v [-ABknS] [-g group] [-p prompt] [-u user]\n"
    "usage: sudo -l [-ABknS] [-g group] [-p prompt] [-U user] [-u user] [command [arg ...]]\n"
    "usage: sudo [-ABbEHnPS] [-D directory] [-g group] [-p prompt] [-u user] [VAR=value] [-i | -s] [command [arg ...]]\n"
)
MAX_REQUEST = 16 * 1024 * 1024
_ANC_SPACE = socket.CMSG_SPACE(8 * 4) + socket.CMSG_SPACE(3 * 4)
_ASSIGN_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_VAR_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def socket_path() -> str | None:
    """The socket path for envd and client: $AGENTENV_ENVD_SUDO_SOCKET if set (empty = disabled)."""
    value = os.environ.get(SOCKET_ENV)
    if value is None:
        return SOCKET_PATH
    return value or None


def server_socket_path() -> str | None:
    """envd serves sudo when told a path, or by default only as PID 1 (i.e. inside a sandbox):
    envd processes started on a host for tests must not fight over the host's /run/agentenv."""
    if SOCKET_ENV in os.environ:
        return os.environ[SOCKET_ENV] or None
    return SOCKET_PATH if os.getpid() == 1 else None


# --- command line ------------------------------------------------------------------------------


class UsageError(Exception):
    pass


@dataclass
class Options:
    mode: str = "run"  # run | list | validate | kill | version | help
    user: str | None = None
    group: str | None = None
    login: bool = False
    shell: bool = False
    preserve_env: bool = False
    preserve_list: list[str] = field(default_factory=list)
    set_home: bool = False
    chdir: str | None = None
    assign: dict[str, str] = field(default_factory=dict)
    command: list[str] = field(default_factory=list)


_NOARG = {
    "n": None, "S": None, "A": None, "B": None, "P": None, "b": "b",
    "E": "E", "H": "H", "i": "i", "s": "s", "k": "k", "K": "K", "v": "v", "l": "l", "V": "V", "h": "h",
}
_WITHARG = {"u", "g", "p", "D", "U", "C", "r", "t", "T", "R"}
_LONG_NOARG = {
    "non-interactive": "n", "stdin": "S", "askpass": "A", "bell": "B", "preserve-groups": "P",
    "background": "b", "set-home": "H", "login": "i", "shell": "s", "reset-timestamp": "k",
    "remove-timestamp": "K", "validate": "v", "list": "l", "version": "V", "help": "h",
    "preserve-env": "E",
}
_LONG_WITHARG = {"user": "u", "group": "g", "prompt": "p", "chdir": "D", "other-user": "U",
                 "close-from": "C", "role": "r", "type": "t", "command-timeout": "T", "chroot": "R",
                 "preserve-env": "E"}


def parse_args(argv: list[str]) -> Options:
    """sudo's command line (options stop at the first non-option, like sudo's getopt "+")."""
    o = Options()
    i = 0
    flags: list[tuple[str, str | None]] = []
    while i < len(argv):
        a = argv[i]
        if a == "--":
            i += 1
            break
        if a.startswith("--"):
            name, eq, val = a[2:].partition("=")
            if name in _LONG_WITHARG and (eq or name not in _LONG_NOARG):
                if not eq:
                    i += 1
                    if i >= len(argv):
                        raise UsageError(f"option '--{name}' requires an argument")
                    val = argv[i]
                flags.append((_LONG_WITHARG[name], val))
            elif name in _LONG_NOARG and not eq:
                flags.append((_LONG_NOARG[name], None))
            else:
                raise UsageError(f"unrecognized option '{a}'")
            i += 1
            continue
        if a.startswith("-") and a != "-":
            j = 1
            while j < len(a):
                c = a[j]
                if c in _WITHARG:
                    val = a[j + 1:]
                    if not val:
                        i += 1
                        if i >= len(argv):
                            raise UsageError(f"option requires an argument -- '{c}'")
                        val = argv[i]
                    flags.append((c, val))
                    break
                if c in _NOARG:
                    flags.append((c, None))
                    j += 1
                    continue
                raise UsageError(f"invalid option -- '{c}'")
            i += 1
            continue
        break
    rest = argv[i:]
    for c, val in flags:
        if c == "u":
            o.user = val
        elif c == "g":
            o.group = val
        elif c == "D":
            o.chdir = val
        elif c == "E":
            if val is None:
                o.preserve_env = True
            else:
                o.preserve_list += [v for v in val.split(",") if v]
        elif c == "H":
            o.set_home = True
        elif c == "i":
            o.login = True
        elif c == "s":
            o.shell = True
        elif c in ("k", "K", "v", "l", "V", "h"):
            o.mode = {"k": "kill", "K": "kill", "v": "validate", "l": "list", "V": "version", "h": "help"}[c]
        elif c == "b":
            raise UsageError("-b (run in the background) is not supported by agentenv's sudo; use `sudo cmd &`")
        elif c in ("U", "C", "r", "t", "T", "R"):
            raise UsageError(f"option -{c} is not supported by agentenv's sudo")
        # n S A B P p: accepted, meaningless without passwords
    if o.login and o.shell:
        raise UsageError("you may not specify both the -i and -s options")
    while rest and _ASSIGN_RE.match(rest[0]):
        name, _, value = rest[0].partition("=")
        o.assign[name] = value
        rest = rest[1:]
    o.command = rest
    if o.mode == "run" and not o.command and not (o.login or o.shell):
        raise UsageError("")
    return o


# --- policy (envd side) -----------------------------------------------------------------------


def _groups_of(name: str, gid: int) -> set[str]:
    try:
        gids = os.getgrouplist(name, gid)
    except OSError:
        gids = [gid]
    names: set[str] = set()
    for g in gids:
        try:
            names.add(grp.getgrgid(g).gr_name)
        except KeyError:
            pass
    return names


def _sudoers_files(directory: str = SUDOERS_DIR) -> list[str]:
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    return [os.path.join(directory, n) for n in names if "." not in n and not n.endswith("~")]


def authorised(uid: int, sudoers_dir: str = SUDOERS_DIR) -> tuple[bool, str]:
    """(allowed, caller's name): uid 0, group `sudo`, or `NAME ALL=` / `%GROUP ALL=` in sudoers.d."""
    try:
        pw = pwd.getpwuid(uid)
    except KeyError:
        return uid == 0, str(uid)
    if uid == 0:
        return True, pw.pw_name
    groups = _groups_of(pw.pw_name, pw.pw_gid)
    if SUDO_GROUP in groups:
        return True, pw.pw_name
    subjects = {pw.pw_name} | {"%" + g for g in groups}
    for path in _sudoers_files(sudoers_dir):
        try:
            with open(path, errors="replace") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        for line in lines:
            line = line.split("#", 1)[0].strip()
            parts = line.split(None, 1)
            if len(parts) == 2 and parts[0] in subjects and re.match(r"ALL\s*=", parts[1]):
                return True, pw.pw_name
    return False, pw.pw_name


def shell_escape_join(args: list[str]) -> str:
    """sudo's quoting for -i/-s commands: backslash before every char but alnum, '_', '-', '$'."""
    return " ".join("".join(c if (c.isalnum() or c in "_-$") else "\\" + c for c in a) for a in args)


def build_env(
    caller_env: dict[str, str], caller: pwd.struct_passwd | None, caller_uid: int, caller_gid: int,
    target: pwd.struct_passwd, req: dict[str, Any], command: list[str],
) -> dict[str, str]:
    login = bool(req.get("login"))
    preserve = bool(req.get("preserve_env")) and not login
    if preserve:
        env = dict(caller_env)
    else:
        env = {k: v for k, v in caller_env.items() if k in KEEP_ENV or k.startswith("LC_")}
        for name in req.get("preserve_list") or []:
            if name in caller_env:
                env[name] = caller_env[name]
    if not preserve or req.get("set_home") or login:
        env["HOME"] = target.pw_dir or "/"
    shell = target.pw_shell or "/bin/sh"
    env["SHELL"] = shell
    env["USER"] = env["LOGNAME"] = target.pw_name
    env["MAIL"] = f"/var/mail/{target.pw_name}"
    env["PATH"] = SECURE_PATH
    env["SUDO_USER"] = caller.pw_name if caller else str(caller_uid)
    env["SUDO_UID"] = str(caller_uid)
    env["SUDO_GID"] = str(caller_gid)
    env["SUDO_COMMAND"] = " ".join(command)[:4096]
    for k, v in (req.get("assign") or {}).items():
        if _VAR_NAME_RE.match(str(k)):
            env[str(k)] = str(v)
    return env


def _resolve_user(spec: str) -> pwd.struct_passwd:
    try:
        if spec.startswith("#") and spec[1:].isdigit():
            return pwd.getpwuid(int(spec[1:]))
        return pwd.getpwnam(spec)
    except KeyError:
        raise RequestError(f"unknown user {spec}") from None


def _resolve_group(spec: str) -> int:
    try:
        if spec.startswith("#") and spec[1:].isdigit():
            return int(spec[1:])
        return grp.getgrnam(spec).gr_gid
    except KeyError:
        raise RequestError(f"unknown group {spec}") from None


class RequestError(Exception):
    pass


@dataclass
class Plan:
    argv: list[str]
    env: dict[str, str]
    cwd: str
    uid: int
    gid: int
    groups: list[int]
    umask: int


def plan_command(req: dict[str, Any], caller_uid: int, caller_gid: int) -> Plan:
    """What to run for a request from an authorised caller (pure except for passwd/group lookups)."""
    target = _resolve_user(str(req.get("user") or "root"))
    gid = _resolve_group(str(req["group"])) if req.get("group") else target.pw_gid
    try:
        groups = os.getgrouplist(target.pw_name, gid)
    except OSError:
        groups = [gid]
    try:
        caller = pwd.getpwuid(caller_uid)
    except KeyError:
        caller = None
    command = [str(a) for a in (req.get("command") or [])]
    caller_env = {str(k): str(v) for k, v in (req.get("env") or {}).items()}
    if req.get("login"):
        shell = target.pw_shell or "/bin/sh"
        argv = [shell, "-l"] + (["-c", shell_escape_join(command)] if command else [])
    elif req.get("shell"):
        shell = caller_env.get("SHELL") or target.pw_shell or "/bin/sh"
        argv = [shell] + (["-c", shell_escape_join(command)] if command else [])
    else:
        if not command:
            raise RequestError("no command given")
        argv = command
    env = build_env(caller_env, caller, caller_uid, caller_gid, target, req, argv)
    if req.get("chdir"):
        cwd = str(req["chdir"])
        if not os.path.isdir(cwd):
            raise RequestError(f"unable to change directory to {cwd}: No such file or directory")
    elif req.get("login"):
        cwd = target.pw_dir if target.pw_dir and os.path.isdir(target.pw_dir) else "/"
    else:
        cwd = str(req.get("cwd") or "/")
        if not os.path.isdir(cwd):
            cwd = "/"
    try:
        umask = int(req.get("umask", 0o022)) | 0o022
    except (TypeError, ValueError):
        umask = 0o022
    return Plan(argv, env, cwd, target.pw_uid, gid, list(groups), umask & 0o777)


# --- envd server ------------------------------------------------------------------------------


class _Conn:
    def __init__(self, server: "SudoServer", sock: socket.socket) -> None:
        self.server = server
        self.sock = sock
        self.buf = b""
        self.fds: list[int] = []
        self.request: dict | None = None
        self.pid: int | None = None
        self.exited = False
        self.closed = False
        self.pending_signals: list[int] = []
        self.creds: tuple[int, int, int] | None = None  # (pid, uid, gid) the kernel vouched for

    def on_readable(self) -> None:
        try:
            data, ancdata, _flags, _addr = self.sock.recvmsg(65536, _ANC_SPACE, socket.MSG_CMSG_CLOEXEC)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, ancdata = b"", []
        fds: list[int] = []
        for level, kind, payload in ancdata:
            if level != socket.SOL_SOCKET:
                continue
            if kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", payload[: len(payload) - len(payload) % 4]))
            elif kind == socket.SCM_CREDENTIALS and len(payload) >= 12 and self.request is None:
                pid, uid, gid = struct.unpack("3i", payload[:12])
                if self.creds is None and pid > 0:  # pid 0: no explicit credentials (gVisor fills junk)
                    self.creds = (pid, uid, gid)
        if fds:
            if self.request is None and len(self.fds) < 3:
                self.fds.extend(fds)
            else:
                for fd in fds:
                    os.close(fd)
        if not data:
            self.on_eof()
            return
        self.buf += data
        if len(self.buf) > MAX_REQUEST:
            self.on_eof()
            return
        while b"\n" in self.buf and not self.closed:
            line, self.buf = self.buf.split(b"\n", 1)
            try:
                msg = json.loads(line)
            except ValueError:
                msg = None
            if not isinstance(msg, dict):
                self.on_eof()
                return
            self.on_message(msg)

    def on_message(self, msg: dict) -> None:
        if self.request is None:
            self.request = msg
            self.server.start_task(self)
        elif "signal" in msg:
            sig = msg.get("signal")
            if not isinstance(sig, int) or not 0 < sig < 65 or self.exited:
                return
            if self.pid is None:
                self.pending_signals.append(sig)  # delivered once the command is spawned
            else:
                self.server.signal_child(self.pid, sig)

    def on_eof(self) -> None:
        """Client gone (or misbehaving): a command still running dies with it."""
        if self.pid is not None and not self.exited:
            self.server.signal_child(self.pid, signal.SIGKILL)
        self.close()

    def take_fds(self) -> list[int]:
        fds, self.fds = self.fds, []
        return fds

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.server.conns.discard(self)
        for fd in self.take_fds():
            try:
                os.close(fd)
            except OSError:
                pass
        loop = self.server.loop
        if loop is not None:
            try:
                loop.remove_reader(self.sock.fileno())
            except (ValueError, OSError):
                pass
        self.sock.close()


class SudoServer:
    """envd's privileged-exec endpoint on a Unix socket (runs on envd's asyncio loop)."""

    def __init__(self, path: str, sudoers_dir: str = SUDOERS_DIR) -> None:
        self.path = path
        self.sudoers_dir = sudoers_dir
        self.loop = None
        self.sock: socket.socket | None = None
        self.children: dict[int, _Conn] = {}
        self.spawning = 0  # the orphan reaper must leave our children alone (see envd.server)
        self.conns: set[_Conn] = set()
        self.tasks: set = set()

    def managed_pids(self) -> set[int]:
        return set(self.children)

    def start(self) -> None:
        import asyncio

        self.loop = asyncio.get_running_loop()
        os.makedirs(os.path.dirname(self.path) or ".", mode=0o755, exist_ok=True)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(self.path)
            os.chmod(self.path, 0o666)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            sock.listen(64)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.loop.add_reader(sock.fileno(), self._accept)

    def _accept(self) -> None:
        assert self.sock is not None and self.loop is not None
        while True:
            try:
                conn_sock, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                _log().warning("sudo socket accept failed: %s", exc)
                return
            conn_sock.setblocking(False)
            conn_sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            conn = _Conn(self, conn_sock)
            self.conns.add(conn)
            self.loop.add_reader(conn_sock.fileno(), conn.on_readable)

    def start_task(self, conn: _Conn) -> None:
        assert self.loop is not None
        task = self.loop.create_task(self._serve(conn))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def signal_child(self, pid: int, sig: int) -> None:
        """Signal the command's process group (it leads one: own session), like a terminal would;
        the command alone if that group is gone. Never both: a second SIGINT often means "force"."""
        try:
            os.killpg(pid, sig)
            return
        except (ProcessLookupError, PermissionError):
            pass
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    async def _reply(self, conn: _Conn, msg: dict) -> None:
        if conn.closed:
            return
        try:
            await self.loop.sock_sendall(conn.sock, json.dumps(msg).encode() + b"\n")  # type: ignore[union-attr]
        except OSError:
            pass

    async def _serve(self, conn: _Conn) -> None:
        req = conn.request or {}
        fds = conn.take_fds()
        try:
            try:
                if conn.creds is None:
                    raise RequestError("protocol error: the request carried no SCM_CREDENTIALS")
                _pid, uid, gid = conn.creds
                ok, name = authorised(uid, self.sudoers_dir)
                if not ok:
                    _log().info("sudo refused for uid %d (%s)", uid, name)
                    raise RequestError(
                        f"{name} is not in the sudoers file (agentenv allows uid 0, members of group "
                        f"'{SUDO_GROUP}' and users with a '{name} ALL=...' line in {SUDOERS_DIR}/)"
                    )
                if req.get("op") == "check":
                    await self._reply(conn, {"exit": 0, "user": name})
                    return
                if len(fds) != 3:
                    raise RequestError("protocol error: expected stdin, stdout and stderr fds")
                plan = plan_command(req, uid, gid)
                code = await self._run(conn, plan, fds, name)
                await self._reply(conn, {"exit": code})
            except RequestError as exc:
                await self._reply(conn, {"exit": 1, "error": str(exc)})
            except Exception as exc:  # noqa: BLE001
                _log().exception("sudo request failed")
                await self._reply(conn, {"exit": 1, "error": f"internal error: {exc}"})
        finally:
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass

    async def _run(self, conn: _Conn, plan: Plan, fds: list[int], caller: str) -> int:
        import asyncio

        loop = asyncio.get_running_loop()
        exited = asyncio.Event()

        class Proto(asyncio.SubprocessProtocol):
            def process_exited(self) -> None:
                exited.set()

        creds: dict[str, Any] = {}
        if os.geteuid() == 0:
            creds = {"user": plan.uid, "group": plan.gid, "extra_groups": plan.groups}
        elif plan.uid != os.geteuid():
            raise RequestError("envd is not running as root")
        self.spawning += 1
        try:
            transport, _ = await loop.subprocess_exec(
                Proto, *plan.argv, stdin=fds[0], stdout=fds[1], stderr=fds[2], cwd=plan.cwd, env=plan.env,
                start_new_session=True, umask=plan.umask, **creds,
            )
        except FileNotFoundError as exc:
            if exc.filename == plan.cwd:
                raise RequestError(f"unable to change directory to {plan.cwd}: {exc.strerror}") from None
            raise RequestError(f"{plan.argv[0]}: command not found") from None
        except PermissionError:
            raise RequestError(f"unable to execute {plan.argv[0]}: Permission denied") from None
        except OSError as exc:
            raise RequestError(f"unable to execute {plan.argv[0]}: {exc.strerror or exc}") from None
        finally:
            self.spawning -= 1
        pid = transport.get_pid()
        self.children[pid] = conn
        conn.pid = pid
        for fd in fds:  # the command holds them now; the client's EOF must not wait on our copies
            try:
                os.close(fd)
            except OSError:
                pass
        fds.clear()
        _log().info("sudo: %s runs pid %d as uid %d: %s", caller, pid, plan.uid, plan.argv)
        try:
            if conn.closed:  # client vanished while we were spawning
                self.signal_child(pid, signal.SIGKILL)
            for sig in conn.pending_signals:
                self.signal_child(pid, sig)
            conn.pending_signals.clear()
            await exited.wait()
        finally:
            conn.exited = True
            self.children.pop(pid, None)
            rc = transport.get_returncode()
            transport.close()
        if rc is None:
            return 1
        return rc if rc >= 0 else 128 - rc

    async def stop(self) -> None:
        if self.loop is not None and self.sock is not None:
            try:
                self.loop.remove_reader(self.sock.fileno())
            except (ValueError, OSError):
                pass
            self.sock.close()
            self.sock = None
            try:
                os.unlink(self.path)
            except OSError:
                pass
        for pid in list(self.children):
            self.signal_child(pid, signal.SIGKILL)
        for conn in list(self.conns):
            conn.close()
        self.conns.clear()


def _log():
    import logging

    return logging.getLogger("agentenv.envd")


# --- client -------------------------------------------------------------------------------------


def _stdio_fds() -> list[int]:
    fds = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            fds.append(fd)
        except OSError:
            fds.append(os.open(os.devnull, os.O_RDWR))
    return fds


def _current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _err(msg: str) -> None:
    try:
        sys.stderr.write(f"sudo: {msg}\n")
        sys.stderr.flush()
    except OSError:
        pass


def _connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    return sock


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        opts = parse_args(args)
    except UsageError as exc:
        if str(exc):
            _err(str(exc))
        sys.stderr.write(USAGE)
        return 1
    if opts.mode == "help":
        sys.stdout.write("sudo - execute a command as another user (agentenv: sudo over envd)\n\n" + USAGE)
        return 0
    if opts.mode == "version":
        sys.stdout.write(VERSION_TEXT)
        return 0
    if opts.mode in ("kill", "validate"):
        return 0
    pending: list[int] = []  # signals that arrive before the request is sent are forwarded after it
    conn: list[socket.socket] = []

    def forward(signum: int, _frame: Any) -> None:
        if not conn:
            pending.append(signum)
            return
        try:
            conn[0].sendall(json.dumps({"signal": signum}).encode() + b"\n")
        except OSError:
            pass

    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, forward)
    try:
        return _run_client(opts, conn, pending)
    finally:
        for sig in FORWARDED_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)


def _run_client(opts: Options, conn: list[socket.socket], pending: list[int]) -> int:
    path = socket_path()
    if not path:
        _err(f"sudo over envd is disabled (${SOCKET_ENV} is empty)")
        return 1
    try:
        sock = _connect(path)
    except OSError as exc:
        _err(f"cannot reach envd's sudo service at {path}: {exc.strerror or exc}")
        return 1
    try:
        cwd = os.getcwd()
    except OSError:
        cwd = "/"
    req: dict[str, Any] = {
        "v": 1, "op": "check" if opts.mode == "list" else "exec",
        "command": opts.command, "cwd": cwd, "env": dict(os.environ), "user": opts.user,
        "group": opts.group, "login": opts.login, "shell": opts.shell, "preserve_env": opts.preserve_env,
        "preserve_list": opts.preserve_list, "set_home": opts.set_home, "chdir": opts.chdir,
        "assign": opts.assign, "umask": _current_umask(),
    }
    data = json.dumps(req).encode() + b"\n"
    fds = _stdio_fds() if req["op"] == "exec" else []

    try:
        # Our identity travels as SCM_CREDENTIALS, which the kernel checks (an unprivileged sender can
        # only state its own pid and uids/gids). SO_PEERCRED would be simpler, but gVisor 20221219
        # answers it with the credentials of the *asking* task, i.e. envd's own (root).
        anc = [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, struct.pack("3i", os.getpid(), os.getuid(), os.getgid()))]
        if fds:
            anc.append((socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes()))
        sent = sock.sendmsg([data[:65536]], anc)
        if sent < len(data):
            sock.sendall(data[sent:])
        for fd in fds:
            if fd > 2:
                os.close(fd)
        conn.append(sock)
        while pending:
            sock.sendall(json.dumps({"signal": pending.pop(0)}).encode() + b"\n")
        buf = b""
        while b"\n" not in buf:
            chunk = sock.recv(65536)
            if not chunk:
                _err("lost the connection to envd before the command finished")
                return 1
            buf += chunk
        reply = json.loads(buf.split(b"\n", 1)[0])
    except OSError as exc:
        if exc.errno == errno.EPIPE:
            _err("envd closed the connection")
        else:
            _err(f"talking to envd failed: {exc}")
        return 1
    if reply.get("error"):
        _err(str(reply["error"]))
    if opts.mode == "list" and not reply.get("error"):
        user = reply.get("user") or "?"
        sys.stdout.write(
            f"User {user} may run the following commands on {socket.gethostname()}:\n"
            "    (ALL : ALL) NOPASSWD: ALL\n"
        )
    code = reply.get("exit")
    return code if isinstance(code, int) and 0 <= code < 256 else 1


if __name__ == "__main__":
    sys.exit(main())
