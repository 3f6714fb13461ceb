"""The tools of `agentenv mcp` (see mcp_server.py): an `MCPServer` bound to one agentenv endpoint.

The tools drive a running agentenv server through its public API and envd (`agentenv.client`)
with one API key, so an MCP client gets exactly what that key's team may do.
"""

from __future__ import annotations

import base64
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, Field

from agentenv.client import ApiClient, ApiError, Endpoint, EnvdError, connect_envd

T = TypeVar("T")
MAX_OUTPUT = 1 << 20        # bytes of stdout/stderr a run_command result keeps (the last ones)
MAX_READ = 10 << 20         # largest file read_file returns
DEFAULT_COMMAND_TIMEOUT = 60.0
INSTRUCTIONS = (
    "Isolated Linux sandboxes (Debian, gVisor) from an agentenv server, E2B-compatible. "
    "create_sandbox gives a sandbox id; run_command runs a bash command line in it (login shell, "
    "as user `user`, home /home/user) and returns exit code, stdout and stderr; read_file/write_file "
    "move file contents; fork_sandbox copies a running sandbox (memory, processes, files) into new "
    "ones; snapshot_sandbox saves it for later creates (pass the snapshot id as the template); "
    "kill_sandbox ends it. Sandboxes end by themselves after their timeout (seconds)."
)


class SandboxInfo(BaseModel):
    sandboxID: str
    templateID: str | None = None
    state: str | None = None
    startedAt: str | None = None
    endAt: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


class SandboxList(BaseModel):
    sandboxes: list[SandboxInfo]


class CommandResult(BaseModel):
    exitCode: int | None = Field(description="the command's exit code (128+N after signal N); null in background")
    stdout: str = ""
    stderr: str = ""
    truncated: bool = Field(False, description="output beyond 1 MiB per stream was dropped (the start)")
    pid: int | None = None


class FileWritten(BaseModel):
    path: str
    bytes: int


class ForkResult(BaseModel):
    children: list[str]
    errors: list[str] = Field(default_factory=list)


class SnapshotResult(BaseModel):
    snapshotID: str
    names: list[str] = Field(default_factory=list)


class Killed(BaseModel):
    sandboxID: str
    killed: bool = True


def _tail(chunks: list[bytes], size: int) -> tuple[str, bool]:
    data = b"".join(chunks)
    return data[-MAX_OUTPUT:].decode(errors="replace"), size > MAX_OUTPUT


def build_server(endpoint: Endpoint) -> Any:
    """The MCPServer with agentenv's tools, bound to one server endpoint and API key."""
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError
    from mcp_types import ToolAnnotations

    from agentenv import __version__

    server = MCPServer("agentenv", instructions=INSTRUCTIONS, version=__version__, log_level="WARNING")

    async def call(fn: Callable[[ApiClient], Awaitable[T]]) -> T:
        try:
            async with ApiClient(endpoint) as api:
                return await fn(api)
        except (ApiError, EnvdError) as e:
            raise ToolError(str(e)) from None

    read_only = ToolAnnotations(readOnlyHint=True, openWorldHint=False)
    changes = ToolAnnotations(readOnlyHint=False, destructiveHint=False, openWorldHint=False)
    destructive = ToolAnnotations(readOnlyHint=False, destructiveHint=True, openWorldHint=False)

    @server.tool(annotations=read_only)
    async def list_sandboxes(state: Literal["running", "paused"] | None = None) -> SandboxList:
        """The API key's sandboxes (running and paused, or only the given state)."""
        rows = await call(lambda api: api.list_sandboxes(state))
        return SandboxList(sandboxes=[SandboxInfo(**{k: r.get(k) for k in SandboxInfo.model_fields
                                                     if r.get(k) is not None}) for r in rows])

    @server.tool(annotations=changes)
    async def create_sandbox(template: str = "base", timeout: int = 300,
                             metadata: dict[str, str] | None = None,
                             env_vars: dict[str, str] | None = None) -> SandboxInfo:
        """Start a sandbox from a template (name or id) or a snapshot id; it is killed after
        `timeout` seconds unless killed earlier. `env_vars` are set for every command."""
        r = await call(lambda api: api.create_sandbox(template, timeout=timeout, metadata=metadata,
                                                      env_vars=env_vars))
        return SandboxInfo(sandboxID=r["sandboxID"], templateID=r.get("templateID"), state="running",
                           metadata=metadata or {})

    @server.tool(annotations=changes)
    async def run_command(sandbox_id: str, command: str, cwd: str | None = None, user: str | None = None,
                          env: dict[str, str] | None = None, timeout: float = DEFAULT_COMMAND_TIMEOUT,
                          background: bool = False) -> CommandResult:
        """Run a bash command line (login shell) in the sandbox and wait for it; returns its exit
        code, stdout and stderr. A non-zero exit is a normal result, not an error. `timeout`
        (seconds, 0 = none) kills the command; `background` starts it, returns its pid and leaves
        it running (e.g. a server)."""
        async def go(api: ApiClient) -> CommandResult:
            envd = await connect_envd(api, sandbox_id, user=user)
            out: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
            size = {"stdout": 0, "stderr": 0}
            async with envd.shell(command, envs=env, cwd=cwd, timeout_s=None if background else timeout or None) \
                    as proc:
                if background:
                    return CommandResult(exitCode=None, pid=proc.pid)
                async for stream, data in proc:
                    key = "stderr" if stream == "stderr" else "stdout"
                    out[key].append(data)
                    size[key] += len(data)
                    if size[key] > 2 * MAX_OUTPUT:  # keep memory bounded: only the tail is returned
                        kept = b"".join(out[key])[-MAX_OUTPUT:]
                        out[key] = [kept]
            assert proc.end is not None
            stdout, t1 = _tail(out["stdout"], size["stdout"])
            stderr, t2 = _tail(out["stderr"], size["stderr"])
            return CommandResult(exitCode=proc.end.shell_code, stdout=stdout, stderr=stderr, truncated=t1 or t2,
                                 pid=proc.pid)

        return await call(go)

    @server.tool(annotations=read_only)
    async def read_file(sandbox_id: str, path: str, encoding: Literal["utf-8", "base64"] = "utf-8") -> str:
        """A file's content (relative paths are under the user's home). Use encoding=base64 for
        binary files."""
        async def go(api: ApiClient) -> bytes:
            envd = await connect_envd(api, sandbox_id)
            parts: list[bytes] = []
            total = 0

            def sink(chunk: bytes) -> None:
                nonlocal total
                total += len(chunk)
                if total > MAX_READ:
                    raise ToolError(f"{path} is larger than {MAX_READ >> 20} MiB; read it in parts with "
                                    "run_command (e.g. head -c / tail -c)")
                parts.append(chunk)

            await envd.download(path, sink)
            return b"".join(parts)

        data = await call(go)
        if encoding == "base64":
            return base64.b64encode(data).decode()
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise ToolError(f"{path} is not UTF-8 text; read it with encoding=base64") from None

    @server.tool(annotations=changes)
    async def write_file(sandbox_id: str, path: str, content: str,
                         encoding: Literal["utf-8", "base64"] = "utf-8") -> FileWritten:
        """Create or replace a file (parent directories are created; relative paths are under the
        user's home). `content` is text, or base64 with encoding=base64."""
        try:
            data = base64.b64decode(content, validate=True) if encoding == "base64" else content.encode()
        except ValueError:
            raise ToolError("content is not valid base64") from None

        async def go(api: ApiClient) -> list[dict]:
            envd = await connect_envd(api, sandbox_id)
            return await envd.upload(path, data)

        entries = await call(go)
        return FileWritten(path=entries[0].get("path", path) if entries else path, bytes=len(data))

    @server.tool(annotations=changes)
    async def fork_sandbox(sandbox_id: str, count: int = 1, timeout: int | None = None) -> ForkResult:
        """Copy a running sandbox into `count` new sandboxes that continue from its exact state
        (memory, running processes, files); the source keeps running."""
        results = await call(lambda api: api.fork(sandbox_id, count, timeout))
        return ForkResult(children=[r["sandbox"]["sandboxID"] for r in results if r.get("sandbox")],
                          errors=[str((r.get("error") or {}).get("message")) for r in results if not r.get("sandbox")])

    @server.tool(annotations=changes)
    async def snapshot_sandbox(sandbox_id: str, name: str | None = None, memory: bool = True) -> SnapshotResult:
        """Save a sandbox's state (memory and files; files only with memory=false) as a snapshot;
        create_sandbox(template=<snapshotID or name>) starts new sandboxes from it."""
        r = await call(lambda api: api.snapshot(sandbox_id, name, memory))
        return SnapshotResult(snapshotID=r["snapshotID"], names=list(r.get("names") or []))

    @server.tool(annotations=destructive)
    async def kill_sandbox(sandbox_id: str) -> Killed:
        """End a sandbox now; its files and processes are gone."""
        await call(lambda api: api.kill(sandbox_id))
        return Killed(sandboxID=sandbox_id)

    return server
