"""The async Python SDK (AsyncSandbox): commands, PTY, files, streaming watch, list/connect."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time

import pytest
from e2b import (
    AsyncSandbox,
    CommandExitException,
    FilesystemEvent,
    FilesystemEventType,
    FileType,
    PtySize,
    SandboxQuery,
    SandboxState,
)

from e2e_util import new_tag


async def async_wait_until(predicate, what: str, limit: float = 60.0, interval: float = 0.1):
    """Poll ``predicate`` (sync) until truthy; fail after ``limit`` seconds (a hang guard)."""
    deadline = time.monotonic() + limit
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting for {what} after {limit:.0f}s")
        await asyncio.sleep(interval)


async def test_run_and_exit_codes(async_sbx: AsyncSandbox):
    result = await async_sbx.commands.run("echo async-out; echo async-err >&2")
    assert (result.exit_code, result.stdout, result.stderr) == (0, "async-out\n", "async-err\n")
    with pytest.raises(CommandExitException) as info:
        await async_sbx.commands.run("exit 42")
    assert info.value.exit_code == 42
    assert (await async_sbx.commands.run("whoami")).stdout == "user\n"
    assert (await async_sbx.commands.run("whoami", user="root")).stdout == "root\n"
    assert (await async_sbx.commands.run("pwd", cwd="/tmp")).stdout == "/tmp\n"
    assert (await async_sbx.commands.run("echo $X", envs={"X": "async-env"})).stdout == "async-env\n"


async def test_on_stdout_streams_before_the_command_ends(async_sbx: AsyncSandbox):
    gate = f"/tmp/async-gate-{new_tag()}"
    seen: list[str] = []

    async def on_stdout(chunk: str) -> None:
        seen.append(chunk)
        if "first" in "".join(seen) and "<opened>" not in seen:
            await async_sbx.files.write(gate, "go")
            seen.append("<opened>")

    cmd = (
        "echo first; "
        f"for i in $(seq 600); do [ -e {gate} ] && break; sleep 0.1; done; "
        f"[ -e {gate} ] || {{ echo gave-up; exit 3; }}; echo second"
    )
    result = await async_sbx.commands.run(cmd, on_stdout=on_stdout, timeout=120)
    assert result.stdout == "first\nsecond\n"
    joined = "".join(seen)
    assert joined.index("first") < joined.index("<opened>") < joined.index("second")


async def test_background_stdin_list_connect_kill(async_sbx: AsyncSandbox):
    handle = await async_sbx.commands.run("cat; exit 4", background=True, stdin=True)
    try:
        assert handle.pid in {p.pid for p in await async_sbx.commands.list()}
        await handle.send_stdin("line-1\n")
        await handle.disconnect()
        chunks: list[str] = []
        connected = await async_sbx.commands.connect(handle.pid, on_stdout=chunks.append)
        await async_sbx.commands.send_stdin(handle.pid, "line-2\n")
        await async_sbx.commands.close_stdin(handle.pid)
        with pytest.raises(CommandExitException) as info:
            await connected.wait()
    finally:
        await async_sbx.commands.kill(handle.pid)
    assert info.value.exit_code == 4
    # only output produced after connecting is delivered to the new stream
    assert "line-2\n" in info.value.stdout
    assert "".join(chunks) == info.value.stdout

    sleeper = await async_sbx.commands.run("sleep 600", background=True)
    assert await async_sbx.commands.kill(sleeper.pid) is True
    with pytest.raises(CommandExitException):
        await sleeper.wait()
    assert sleeper.pid not in {p.pid for p in await async_sbx.commands.list()}


async def test_pty(async_sbx: AsyncSandbox):
    out = bytearray()
    handle = await async_sbx.pty.create(PtySize(rows=30, cols=90), on_data=lambda d: out.extend(d))
    try:
        await async_sbx.pty.send_stdin(handle.pid, b"echo apty-$((7*6)); stty size\n")
        await async_wait_until(lambda: b"apty-42" in out and b"30 90" in out, "PTY output")
        await async_sbx.pty.resize(handle.pid, PtySize(rows=33, cols=111))
        await async_sbx.pty.send_stdin(handle.pid, b"stty size\n")
        await async_wait_until(lambda: b"33 111" in out, "stty size after resize")
        await async_sbx.pty.send_stdin(handle.pid, b"exit 0\n")
        result = await asyncio.wait_for(handle.wait(), timeout=60)
        assert result.exit_code == 0
    finally:
        await async_sbx.pty.kill(handle.pid)


async def test_files(async_sbx: AsyncSandbox):
    d = f"/home/user/async-{new_tag()}"
    assert await async_sbx.files.make_dir(d) is True
    await async_sbx.files.write(f"{d}/t.txt", "async text")
    data = os.urandom(3 * 1024 * 1024)
    await async_sbx.files.write(f"{d}/b.bin", data)
    assert await async_sbx.files.read(f"{d}/t.txt") == "async text"
    back = await async_sbx.files.read(f"{d}/b.bin", format="bytes")
    assert hashlib.sha256(back).digest() == hashlib.sha256(data).digest()
    entries = {e.name: e for e in await async_sbx.files.list(d)}
    assert set(entries) == {"t.txt", "b.bin"}
    assert entries["b.bin"].size == len(data)
    assert (await async_sbx.files.get_info(f"{d}/t.txt")).type == FileType.FILE
    await async_sbx.files.rename(f"{d}/t.txt", f"{d}/u.txt")
    assert await async_sbx.files.exists(f"{d}/t.txt") is False
    assert await async_sbx.files.exists(f"{d}/u.txt") is True
    await async_sbx.files.remove(d)
    assert await async_sbx.files.exists(d) is False


async def test_watch_dir_streaming(async_sbx: AsyncSandbox):
    d = f"/home/user/async-watch-{new_tag()}"
    await async_sbx.files.make_dir(d)
    events: list[FilesystemEvent] = []
    exits: list[object] = []
    handle = await async_sbx.files.watch_dir(d, on_event=events.append, on_exit=exits.append, timeout=0)

    def has(name: str, *kinds: FilesystemEventType) -> bool:
        return any(e.name == name and e.type in kinds for e in events)

    try:
        await async_sbx.files.write(f"{d}/one.txt", "1")
        await async_wait_until(
            lambda: has("one.txt", FilesystemEventType.CREATE, FilesystemEventType.WRITE), "create event"
        )
        await async_sbx.commands.run(f"mv {d}/one.txt {d}/two.txt")
        await async_wait_until(lambda: has("one.txt", FilesystemEventType.RENAME), "rename event")
        await async_sbx.files.remove(f"{d}/two.txt")
        await async_wait_until(lambda: has("two.txt", FilesystemEventType.REMOVE), "remove event")
    finally:
        await handle.stop()
    assert exits == [None]


async def test_list_connect_info(async_sbx: AsyncSandbox):
    info = await async_sbx.get_info()
    assert info.sandbox_id == async_sbx.sandbox_id
    assert info.state == SandboxState.RUNNING
    paginator = AsyncSandbox.list(query=SandboxQuery(metadata={"module": "test_e2e_async_sdk"}))
    found = []
    while paginator.has_next:
        found.extend(await paginator.next_items())
    assert async_sbx.sandbox_id in {s.sandbox_id for s in found}

    again = await AsyncSandbox.connect(async_sbx.sandbox_id)
    path = f"/tmp/async-connect-{new_tag()}"
    await again.files.write(path, "via connect")
    assert await async_sbx.files.read(path) == "via connect"
    assert await again.is_running() is True


async def test_create_with_envs_and_kill(server):
    tag = new_tag()
    sbx = await AsyncSandbox.create(metadata={"suite": "e2e", "async-kill": tag}, envs={"AENV": tag}, timeout=300)
    try:
        assert (await sbx.commands.run("echo $AENV")).stdout == f"{tag}\n"
    finally:
        killed = await sbx.kill()
    assert killed is True
    assert await sbx.is_running() is False
    assert await AsyncSandbox.kill(sbx.sandbox_id) is False
