"""`agentenv sandbox exec|shell|logs|files` and `agentenv template build`: the CLI for people.

Everything goes through the server's public HTTP API and envd behind its proxy
(`agentenv.client`), so it works against any agentenv server (or gateway) the API key opens.

Exit codes: 0 success; 1 an error the server or sandbox reported (or a failed build); 2 usage;
`exec`/`shell` pass the command's own exit code through (128 + N when signal N ended it) and use
124 when `exec --timeout` killed it, 125 when agentenv itself could not run it (server, sandbox or
envd error), 141 when our stdout was closed (the command is killed); 130 after Ctrl-C.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import click

from agentenv.client import ApiClient, ApiError, EnvdClient, EnvdError, connect_envd, resolve_endpoint

T = TypeVar("T")
EXIT_AGENTENV_ERROR = 125  # exec/shell: agentenv could not run the command (docker exec's convention)
EXIT_INTERRUPTED = 130
EXIT_TIMEOUT = 124  # exec --timeout elapsed (coreutils timeout's convention)
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE  # our stdout was closed: the command was ended, as a shell's SIGPIPE


def _echo_err(msg: str) -> None:
    click.echo(msg, err=True)


def endpoint_options(f: Callable) -> Callable:
    """--api-url / --api-key / --sandbox-url (defaults: E2B_API_URL, E2B_API_KEY, E2B_SANDBOX_URL)."""
    for opt in reversed([
        click.option("--api-url", default=None, help="server URL (default $E2B_API_URL, $AGENTENV_API_URL, "
                                                     "http://127.0.0.1:3000)"),
        click.option("--api-key", default=None, help="API key (default $E2B_API_KEY, $AGENTENV_API_KEY)"),
        click.option("--sandbox-url", default=None, help="envd traffic URL (default $E2B_SANDBOX_URL, "
                                                         "else the server URL)"),
    ]):
        f = opt(f)
    return f


def _run(fn: Callable[[ApiClient], Awaitable[T]], api_url: str | None, api_key: str | None,
         sandbox_url: str | None, *, error_code: int = 1) -> T:
    """Run `fn(api)`; server and envd errors become a message and `error_code`."""
    async def go() -> T:
        async with ApiClient(resolve_endpoint(api_url, api_key, sandbox_url)) as api:
            return await fn(api)

    try:
        return asyncio.run(go())
    except (ApiError, EnvdError) as e:
        _echo_err(f"Error: {e}")
        sys.exit(error_code)
    except KeyboardInterrupt:
        sys.exit(EXIT_INTERRUPTED)
    except BrokenPipeError:  # e.g. `files get ID f - | head`
        _quiet_stdout()
        sys.exit(EXIT_BROKEN_PIPE)


def _env_pairs(values: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for v in values:
        name, eq, value = v.partition("=")
        if not eq or not name:
            raise click.BadParameter(f"{v!r}: expected NAME=VALUE", param_hint="--env")
        out[name] = value
    return out


# ---------------------------------------------------------------- exec


def _write(fd: int, data: bytes) -> None:
    while data:
        n = os.write(fd, data)
        data = data[n:]


async def _reads(fd: int) -> AsyncIterator[bytes]:
    """What arrives on `fd` (a terminal or a pipe; a regular file is read in a thread) until EOF.

    Event-loop reads, not a blocked thread: a command that ends before its input does not leave
    the CLI waiting for a keystroke.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[bytes] = asyncio.Queue()

    def readable() -> None:
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            loop.remove_reader(fd)
        queue.put_nowait(data)

    try:
        loop.add_reader(fd, readable)
    except (PermissionError, OSError):  # epoll refuses regular files
        while data := await asyncio.to_thread(os.read, fd, 1 << 16):
            yield data
        return
    try:
        while data := await queue.get():
            while not queue.empty():  # several pending reads go on as one
                more = queue.get_nowait()
                if not more:
                    queue.put_nowait(more)
                    break
                data += more
            yield data
    finally:
        loop.remove_reader(fd)


async def _pump_stdin(envd: EnvdClient, pid: int) -> None:
    """Forward our stdin to the process's, then close it (EOF)."""
    async for data in _reads(sys.stdin.fileno()):
        await envd.send_input(pid, data)
    await envd.close_stdin(pid)


def _quiet_stdout() -> None:
    """After EPIPE: point stdout at /dev/null so the interpreter's final flush cannot complain."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


async def exec_command(api: ApiClient, sandbox_id: str, command: str, *, user: str | None, cwd: str | None,
                       envs: dict[str, str], stdin: bool, timeout: float | None) -> int:
    envd = await connect_envd(api, sandbox_id, user=user)
    async with envd.shell(command, envs=envs, cwd=cwd, stdin=stdin, timeout_s=timeout) as proc:
        feeder = asyncio.create_task(_pump_stdin(envd, proc.pid)) if stdin else None
        try:
            async for stream, data in proc:
                _write(2 if stream == "stderr" else 1, data)
        except BrokenPipeError:  # our reader went away (`exec ... | head`): end the command, as SIGPIPE would
            with contextlib.suppress(ApiError, EnvdError):
                await envd.kill(proc.pid)
            _quiet_stdout()
            return EXIT_BROKEN_PIPE
        except asyncio.CancelledError:
            with contextlib.suppress(ApiError, EnvdError):
                await asyncio.shield(envd.kill(proc.pid))
            raise
        finally:
            if feeder is not None:
                feeder.cancel()
                with contextlib.suppress(asyncio.CancelledError, EnvdError):
                    await feeder
    assert proc.end is not None
    return proc.end.shell_code


@click.command("exec")
@click.argument("sandbox_id")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option("--user", "-u", default=None, help="run as this user (default: the sandbox's, `user`)")
@click.option("--cwd", "-w", default=None, help="working directory (default: the user's home)")
@click.option("--env", "-e", "env", multiple=True, help="NAME=VALUE for the command (repeatable)")
@click.option("--stdin", "-i", "stdin", is_flag=True, help="forward this terminal's stdin (EOF closes it)")
@click.option("--timeout", type=float, default=None, help="kill the command after this many seconds")
@endpoint_options
def sandbox_exec(sandbox_id: str, command: tuple[str, ...], user: str | None, cwd: str | None,
                 env: tuple[str, ...], stdin: bool, timeout: float | None, api_url: str | None,
                 api_key: str | None, sandbox_url: str | None) -> None:
    """Run COMMAND in a sandbox; its output streams live and its exit code is ours.

    One argument is a shell command line (`exec ID -- 'ls | wc -l'`); several are quoted and joined
    (`exec ID -- ls -l /tmp`). It runs in bash as a login shell, like the SDKs' commands.run.
    Exit code: the command's, 128+N after signal N, 124 when --timeout killed it, 125 if agentenv
    could not run it.
    """
    import shlex

    line = command[0] if len(command) == 1 else shlex.join(command)
    envs = _env_pairs(env)

    async def go(api: ApiClient) -> int:
        try:
            return await exec_command(api, sandbox_id, line, user=user, cwd=cwd, envs=envs, stdin=stdin,
                                      timeout=timeout)
        except EnvdError as e:
            if e.code != "deadline_exceeded":
                raise
            _echo_err(f"agentenv: the command did not finish within {timeout:g}s and was killed")
            return EXIT_TIMEOUT

    sys.exit(_run(go, api_url, api_key, sandbox_url, error_code=EXIT_AGENTENV_ERROR))


# ---------------------------------------------------------------- shell


@contextlib.contextmanager
def _raw_terminal(fd: int) -> Iterator[None]:
    """Raw mode for the session; the terminal's settings come back however it ends."""
    import termios
    import tty

    saved = termios.tcgetattr(fd)
    try:
        tty.setraw(fd)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _terminal_size(fd: int) -> tuple[int, int]:
    try:
        size = os.get_terminal_size(fd)
        return size.columns or 80, size.lines or 24
    except OSError:
        return 80, 24


async def _forward_keys(envd: EnvdClient, pid: int, fd: int) -> None:
    """Our terminal's bytes to the PTY, in order; at EOF the shell goes on until it exits."""
    async for data in _reads(fd):
        await envd.send_input(pid, data, pty=True)


async def _follow_resizes(envd: EnvdClient, pid: int, fd: int) -> None:
    loop = asyncio.get_running_loop()
    changed = asyncio.Event()
    loop.add_signal_handler(signal.SIGWINCH, changed.set)
    try:
        while True:
            await changed.wait()
            changed.clear()
            cols, rows = _terminal_size(fd)
            with contextlib.suppress(EnvdError):
                await envd.resize(pid, cols, rows)
    finally:
        loop.remove_signal_handler(signal.SIGWINCH)


async def shell_session(api: ApiClient, sandbox_id: str, *, user: str | None, cwd: str | None,
                        shell: str, envs: dict[str, str]) -> int:
    fd_in, fd_out = sys.stdin.fileno(), sys.stdout.fileno()
    envd = await connect_envd(api, sandbox_id, user=user)
    cols, rows = _terminal_size(fd_in)
    term = {"TERM": os.environ.get("TERM") or "xterm-256color", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", **envs}
    async with envd.start(shell, ["-i", "-l"], envs=term, cwd=cwd, pty=(cols, rows)) as proc:
        with _raw_terminal(fd_in):
            tasks = [asyncio.create_task(_forward_keys(envd, proc.pid, fd_in)),
                     asyncio.create_task(_follow_resizes(envd, proc.pid, fd_in))]
            try:
                async for _, data in proc:
                    _write(fd_out, data)
            finally:
                for t in tasks:
                    t.cancel()
                results = await asyncio.gather(*tasks, return_exceptions=True)
        for r in results:
            if isinstance(r, EnvdError | ApiError):
                _echo_err(f"agentenv: {r}")
    assert proc.end is not None
    return proc.end.shell_code


@click.command("shell")
@click.argument("sandbox_id")
@click.option("--user", "-u", default=None, help="log in as this user (default: the sandbox's, `user`)")
@click.option("--cwd", "-w", default=None, help="start in this directory")
@click.option("--shell", "shell", default="/bin/bash", show_default=True, help="the shell to start (-i -l)")
@click.option("--env", "-e", "env", multiple=True, help="NAME=VALUE for the shell (repeatable)")
@endpoint_options
def sandbox_shell(sandbox_id: str, user: str | None, cwd: str | None, shell: str, env: tuple[str, ...],
                  api_url: str | None, api_key: str | None, sandbox_url: str | None) -> None:
    """An interactive shell in a sandbox: a PTY through envd, resized with this terminal.

    The terminal is in raw mode while the shell runs (Ctrl-C, Ctrl-D and Ctrl-Z go to the
    sandbox) and is restored when it ends; exit code: the shell's, 125 if it could not start.
    """
    if not os.isatty(sys.stdin.fileno()):
        raise click.UsageError("`sandbox shell` needs a terminal; use `sandbox exec` for commands")
    envs = _env_pairs(env)
    code = _run(lambda api: shell_session(api, sandbox_id, user=user, cwd=cwd, shell=shell, envs=envs),
                api_url, api_key, sandbox_url, error_code=EXIT_AGENTENV_ERROR)
    sys.exit(code)


# ---------------------------------------------------------------- logs


def _ms(timestamp: str) -> int:
    return int(datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp() * 1000)


def _print_log(entry: dict, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(entry))
        return
    fields = entry.get("fields") or {}
    extra = " ".join(f"{k}={v}" for k, v in fields.items() if k not in ("source",))
    click.echo(f"{entry.get('timestamp')} {entry.get('level', 'info'):5} {entry.get('message')}"
               + (f"  [{extra}]" if extra else ""))


def _ended(entry: dict) -> bool:
    fields = entry.get("fields") or {}
    return fields.get("source") == "lifecycle" and fields.get("type") == "killed"


async def show_logs(api: ApiClient, sandbox_id: str, *, follow: bool, level: str | None, as_json: bool,
                    interval: float = 1.0) -> None:
    seen: set[tuple[str, str]] = set()
    cursor: int | None = None
    while True:
        entries = await api.logs(sandbox_id, cursor=cursor, level=level)
        done = False
        for e in entries:
            key = (str(e.get("timestamp")), str(e.get("message")))
            if key in seen:
                continue  # the cursor is inclusive: the last millisecond comes back
            seen.add(key)
            _print_log(e, as_json)
            done = done or _ended(e)
        if entries:
            cursor = _ms(entries[-1]["timestamp"])
        if not follow or done:
            return
        await asyncio.sleep(interval)


@click.command("logs")
@click.argument("sandbox_id")
@click.option("--follow", "-f", is_flag=True, help="keep printing new entries until the sandbox is killed")
@click.option("--level", type=click.Choice(["debug", "info", "warn", "error"]), default=None,
              help="minimum level")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per line (the API's entries)")
@endpoint_options
def sandbox_logs(sandbox_id: str, follow: bool, level: str | None, as_json: bool, api_url: str | None,
                 api_key: str | None, sandbox_url: str | None) -> None:
    """A sandbox's log: its lifecycle events and the server's records about it (GET /v2/sandboxes/{id}/logs).

    Readable for a while after the sandbox ended. With -f, polls every second; Ctrl-C stops.
    """
    try:
        _run(lambda api: show_logs(api, sandbox_id, follow=follow, level=level, as_json=as_json),
             api_url, api_key, sandbox_url)
    except SystemExit as e:
        if e.code == EXIT_INTERRUPTED and follow:
            sys.exit(0)  # Ctrl-C is how a follow ends
        raise


# ---------------------------------------------------------------- files


@click.group("files")
def sandbox_files() -> None:
    """Copy files between this machine and a sandbox (envd /files, streamed)."""


async def _get(api: ApiClient, sandbox_id: str, remote: str, local: str, user: str | None) -> int:
    envd = await connect_envd(api, sandbox_id, user=user)
    if local == "-":
        out = sys.stdout.buffer
        n = await envd.download(remote, out.write)
        out.flush()
        return n
    tmp = Path(local).with_name(f".{Path(local).name}.agentenv-part")
    try:
        with open(tmp, "wb") as f:
            n = await envd.download(remote, f.write)
        os.replace(tmp, local)
    finally:
        tmp.unlink(missing_ok=True)
    return n


@sandbox_files.command("get")
@click.argument("sandbox_id")
@click.argument("remote")
@click.argument("local", required=False)
@click.option("--user", "-u", default=None, help="read as this user (relative paths: their home)")
@endpoint_options
def files_get(sandbox_id: str, remote: str, local: str | None, user: str | None, api_url: str | None,
              api_key: str | None, sandbox_url: str | None) -> None:
    """Download REMOTE from a sandbox to LOCAL (default: its base name here; `-` = stdout)."""
    target = local or os.path.basename(remote.rstrip("/")) or "download"
    if target != "-" and os.path.isdir(target):
        target = os.path.join(target, os.path.basename(remote.rstrip("/")))
    n = _run(lambda api: _get(api, sandbox_id, remote, target, user), api_url, api_key, sandbox_url)
    if target != "-":
        _echo_err(f"{remote} -> {target} ({n} bytes)")


async def _local_chunks(local: str) -> AsyncIterator[bytes]:
    if local == "-":
        async for data in _reads(sys.stdin.fileno()):
            yield data
        return
    with open(local, "rb") as f:
        while data := await asyncio.to_thread(f.read, 1 << 20):
            yield data


async def _put(api: ApiClient, sandbox_id: str, local: str, remote: str, user: str | None) -> list[dict]:
    envd = await connect_envd(api, sandbox_id, user=user)
    return await envd.upload(remote, _local_chunks(local))


@sandbox_files.command("put")
@click.argument("sandbox_id")
@click.argument("local")
@click.argument("remote")
@click.option("--user", "-u", default=None, help="write as this user (owner of the file)")
@click.option("--json", "as_json", is_flag=True, help="print envd's answer (the written entries)")
@endpoint_options
def files_put(sandbox_id: str, local: str, remote: str, user: str | None, as_json: bool, api_url: str | None,
              api_key: str | None, sandbox_url: str | None) -> None:
    """Upload LOCAL (`-` = stdin) to REMOTE in a sandbox (parents created, an existing file replaced)."""
    if local != "-" and not os.path.isfile(local):
        raise click.BadParameter(f"{local}: not a file", param_hint="LOCAL")
    entries = _run(lambda api: _put(api, sandbox_id, local, remote, user), api_url, api_key, sandbox_url)
    if as_json:
        click.echo(json.dumps(entries))
    else:
        for e in entries:
            click.echo(e.get("path", remote))


# ---------------------------------------------------------------- template build


def _print_build_log(entry: dict) -> None:
    level = entry.get("level", "info")
    _echo_err(f"{level.upper():5} {entry.get('message', '')}" if level != "info" else entry.get("message", ""))


@click.command("build")
@click.argument("context", type=click.Path(exists=True, file_okay=False), default=".")
@click.option("--file", "-f", "file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Dockerfile, or the SDK's Template.to_json() output (*.json); default CONTEXT/Dockerfile")
@click.option("--name", "-n", required=True, help="template name, optionally name:tag")
@click.option("--start-cmd", default=None, help="command left running in the template's snapshot "
                                                "(default: the Dockerfile's CMD/ENTRYPOINT)")
@click.option("--ready-cmd", default=None, help="polled until it exits 0 before the snapshot is taken")
@click.option("--cpu", "cpu_count", type=click.IntRange(1, 64), default=None)
@click.option("--memory-mb", type=click.IntRange(128, 262144), default=None)
@click.option("--build-arg", "build_args", multiple=True, help="NAME=VALUE for an ARG (repeatable)")
@click.option("--no-cache", is_flag=True, help="run every step again (the SDK's force)")
@click.option("--json", "as_json", is_flag=True, help="print the final build status as JSON")
@endpoint_options
def template_build(context: str, file: str | None, name: str, start_cmd: str | None, ready_cmd: str | None,
                   cpu_count: int | None, memory_mb: int | None, build_args: tuple[str, ...], no_cache: bool,
                   as_json: bool, api_url: str | None, api_key: str | None, sandbox_url: str | None) -> None:
    """Build a template on the server from a Dockerfile (FROM/RUN/COPY/ADD/ENV/ARG/WORKDIR/USER/CMD).

    COPY sources are read from CONTEXT and uploaded (only when the server lacks them). Build logs
    go to stderr; the template's name goes to stdout. Exit code 1 when the build fails.
    """
    from agentenv.client.template_build import DockerfileError, build, load_plan

    ctx = Path(context)
    path = Path(file) if file else ctx / "Dockerfile"
    if not path.is_file():
        raise click.BadParameter(f"{path} not found", param_hint="--file")
    try:
        plan = load_plan(path, ctx, _env_pairs(build_args))
    except DockerfileError as e:
        raise click.ClickException(f"{path}: {e}") from None
    for w in plan.warnings:
        _echo_err(f"warning: {path}: {w}")

    result: dict[str, Any] = _run(
        lambda api: build(api, plan, name, ctx, cpu_count=cpu_count, memory_mb=memory_mb, force=no_cache,
                          ready_cmd=ready_cmd, start_cmd=start_cmd, on_log=_print_build_log, note=_echo_err),
        api_url, api_key, sandbox_url)
    ok = result.get("status") == "ready"
    if as_json:
        click.echo(json.dumps({k: v for k, v in result.items() if k not in ("logs", "logEntries")}))
    elif ok:
        click.echo(name)
    if not ok:
        reason = (result.get("reason") or {}).get("message", "unknown reason")
        _echo_err(f"Error: build {result.get('buildID')} failed: {reason}")
        sys.exit(1)


def register(sandbox: click.Group, templates: click.Group) -> None:
    """Add these commands to the CLI's `sandbox` and `templates` groups."""
    for cmd in (sandbox_exec, sandbox_shell, sandbox_logs, sandbox_files):
        sandbox.add_command(cmd)
    templates.add_command(template_build)
