"""What the people-facing CLI commands do (cli_sandbox.py holds their click definitions).

Kept apart so the CLI starts without the HTTP client: this module (and aiohttp) is imported only
when a sandbox command runs.
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
from typing import TypeVar

import click

from agentenv.client import ApiClient, ApiError, EnvdClient, EnvdError, connect_envd, resolve_endpoint

T = TypeVar("T")
EXIT_AGENTENV_ERROR = 125  # exec/shell: agentenv could not run the command (docker exec's convention)
EXIT_INTERRUPTED = 130
EXIT_TIMEOUT = 124  # exec --timeout elapsed (coreutils timeout's convention)
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE  # our stdout was closed: the command was ended, as a shell's SIGPIPE
EXIT_TERMINATED = 128 + signal.SIGTERM  # SIGTERM/SIGHUP: the command was ended, the terminal restored


def echo_err(msg: str) -> None:
    click.echo(msg, err=True)


def run(fn: Callable[[ApiClient], Awaitable[T]], api_url: str | None, api_key: str | None,
         sandbox_url: str | None, *, error_code: int = 1) -> T:
    """Run `fn(api)`; server and envd errors become a message and `error_code`."""
    async def go() -> T:
        async with ApiClient(resolve_endpoint(api_url, api_key, sandbox_url)) as api:
            return await fn(api)

    try:
        return asyncio.run(go())
    except (ApiError, EnvdError) as e:
        echo_err(f"Error: {e}")
        sys.exit(error_code)
    except KeyboardInterrupt:
        sys.exit(EXIT_INTERRUPTED)
    except asyncio.CancelledError:  # SIGTERM / SIGHUP (see ending_on)
        sys.exit(EXIT_TERMINATED)
    except BrokenPipeError:  # e.g. `files get ID f - | head`
        quiet_stdout()
        sys.exit(EXIT_BROKEN_PIPE)


@contextlib.contextmanager
def ending_on(*signals: signal.Signals) -> Iterator[None]:
    """These signals cancel the running task instead of killing the process, so its cleanup runs
    (the remote command is killed, the terminal restored); `run` then exits EXIT_TERMINATED."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    for sig in signals:
        loop.add_signal_handler(sig, task.cancel)
    try:
        yield
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


def write_all(fd: int, data: bytes) -> None:
    while data:
        n = os.write(fd, data)
        data = data[n:]


async def reads(fd: int) -> AsyncIterator[bytes]:
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


async def pump_stdin(envd: EnvdClient, pid: int) -> None:
    """Forward our stdin to the process's, then close it (EOF)."""
    async for data in reads(sys.stdin.fileno()):
        await envd.send_input(pid, data)
    await envd.close_stdin(pid)


def quiet_stdout() -> None:
    """After EPIPE: point stdout at /dev/null so the interpreter's final flush cannot complain."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


async def exec_command(api: ApiClient, sandbox_id: str, command: str, *, user: str | None, cwd: str | None,
                       envs: dict[str, str], stdin: bool, timeout: float | None) -> int:
    """`sandbox exec`: output to ours as it comes; the command's exit code (or EXIT_TIMEOUT/BROKEN_PIPE)."""
    try:
        with ending_on(signal.SIGTERM, signal.SIGHUP):
            return await _exec(api, sandbox_id, command, user=user, cwd=cwd, envs=envs, stdin=stdin,
                               timeout=timeout)
    except EnvdError as e:
        if e.code != "deadline_exceeded":
            raise
        echo_err(f"agentenv: the command did not finish within {timeout:g}s and was killed")
        return EXIT_TIMEOUT


async def _exec(api: ApiClient, sandbox_id: str, command: str, *, user: str | None, cwd: str | None,
                envs: dict[str, str], stdin: bool, timeout: float | None) -> int:
    envd = await connect_envd(api, sandbox_id, user=user)
    async with envd.shell(command, envs=envs, cwd=cwd, stdin=stdin, timeout_s=timeout) as proc:
        feeder = asyncio.create_task(pump_stdin(envd, proc.pid)) if stdin else None
        try:
            async for stream, data in proc:
                write_all(2 if stream == "stderr" else 1, data)
        except BrokenPipeError:  # our reader went away (`exec ... | head`): end the command, as SIGPIPE would
            with contextlib.suppress(ApiError, EnvdError):
                await envd.kill(proc.pid)
            quiet_stdout()
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


@contextlib.contextmanager
def raw_terminal(fd: int) -> Iterator[None]:
    """Raw mode for the session; the terminal's settings come back however it ends."""
    import termios
    import tty

    saved = termios.tcgetattr(fd)
    try:
        tty.setraw(fd)
        yield
    finally:
        with contextlib.suppress(termios.error, OSError):  # a terminal that went away (SIGHUP)
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def terminal_size(fd: int) -> tuple[int, int]:
    try:
        size = os.get_terminal_size(fd)
        return size.columns or 80, size.lines or 24
    except OSError:
        return 80, 24


async def forward_keys(envd: EnvdClient, pid: int, fd: int) -> None:
    """Our terminal's bytes to the PTY, in order; at EOF the shell goes on until it exits."""
    async for data in reads(fd):
        await envd.send_input(pid, data, pty=True)


async def follow_resizes(envd: EnvdClient, pid: int, fd: int) -> None:
    loop = asyncio.get_running_loop()
    changed = asyncio.Event()
    loop.add_signal_handler(signal.SIGWINCH, changed.set)
    try:
        while True:
            await changed.wait()
            changed.clear()
            cols, rows = terminal_size(fd)
            with contextlib.suppress(EnvdError):
                await envd.resize(pid, cols, rows)
    finally:
        loop.remove_signal_handler(signal.SIGWINCH)


async def shell_session(api: ApiClient, sandbox_id: str, *, user: str | None, cwd: str | None,
                        shell: str, envs: dict[str, str]) -> int:
    fd_in, fd_out = sys.stdin.fileno(), sys.stdout.fileno()
    envd = await connect_envd(api, sandbox_id, user=user)
    cols, rows = terminal_size(fd_in)
    term = {"TERM": os.environ.get("TERM") or "xterm-256color", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", **envs}
    async with envd.start(shell, ["-i", "-l"], envs=term, cwd=cwd, pty=(cols, rows)) as proc:
        with ending_on(signal.SIGTERM, signal.SIGHUP), raw_terminal(fd_in):
            tasks = [asyncio.create_task(forward_keys(envd, proc.pid, fd_in)),
                     asyncio.create_task(follow_resizes(envd, proc.pid, fd_in))]
            try:
                async for _, data in proc:
                    write_all(fd_out, data)
            except asyncio.CancelledError:  # SIGTERM/SIGHUP: no shell left waiting on a PTY nobody reads
                with contextlib.suppress(ApiError, EnvdError):
                    await asyncio.shield(envd.kill(proc.pid))
                raise
            finally:
                for t in tasks:
                    t.cancel()
                results = await asyncio.gather(*tasks, return_exceptions=True)
        for r in results:
            if isinstance(r, EnvdError | ApiError):
                echo_err(f"agentenv: {r}")
    assert proc.end is not None
    return proc.end.shell_code


def timestamp_ms(timestamp: str) -> int:
    return int(datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp() * 1000)


def print_log(entry: dict, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(entry))
        return
    fields = entry.get("fields") or {}
    extra = " ".join(f"{k}={v}" for k, v in fields.items() if k not in ("source",))
    click.echo(f"{entry.get('timestamp')} {entry.get('level', 'info'):5} {entry.get('message')}"
               + (f"  [{extra}]" if extra else ""))


def is_kill_entry(entry: dict) -> bool:
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
            print_log(e, as_json)
            done = done or is_kill_entry(e)
        if entries:
            cursor = timestamp_ms(entries[-1]["timestamp"])
        if not follow or done:
            return
        await asyncio.sleep(interval)


async def get_file(api: ApiClient, sandbox_id: str, remote: str, local: str, user: str | None) -> int:
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


async def local_chunks(local: str) -> AsyncIterator[bytes]:
    if local == "-":
        async for data in reads(sys.stdin.fileno()):
            yield data
        return
    with open(local, "rb") as f:
        while data := await asyncio.to_thread(f.read, 1 << 20):
            yield data


async def put_file(api: ApiClient, sandbox_id: str, local: str, remote: str, user: str | None) -> list[dict]:
    envd = await connect_envd(api, sandbox_id, user=user)
    return await envd.upload(remote, local_chunks(local))


def print_build_log(entry: dict) -> None:
    level = entry.get("level", "info")
    echo_err(f"{level.upper():5} {entry.get('message', '')}" if level != "info" else entry.get("message", ""))
