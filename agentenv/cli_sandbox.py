"""`agentenv sandbox exec|shell|logs|files` and `agentenv template build`: the CLI for people.

Everything goes through the server's public HTTP API and envd behind its proxy
(`agentenv.client`), so it works against any agentenv server (or gateway) the API key opens. What
the commands do is in cli_ops.py, imported when one runs.

Exit codes: 0 success; 1 an error the server or sandbox reported (or a failed build); 2 usage;
`exec`/`shell` pass the command's own exit code through (128 + N when signal N ended it) and use
124 when `exec --timeout` killed it, 125 when agentenv itself could not run it (server, sandbox or
envd error), 141 when our stdout was closed (the command is killed); 130 after Ctrl-C, 143 after
SIGTERM/SIGHUP (the remote command is killed and the terminal restored first).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click


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


def _env_pairs(values: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for v in values:
        name, eq, value = v.partition("=")
        if not eq or not name:
            raise click.BadParameter(f"{v!r}: expected NAME=VALUE", param_hint="--env")
        out[name] = value
    return out


# ---------------------------------------------------------------- exec


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

    from agentenv import cli_ops as ops

    line = command[0] if len(command) == 1 else shlex.join(command)
    envs = _env_pairs(env)
    sys.exit(ops.run(lambda api: ops.exec_command(api, sandbox_id, line, user=user, cwd=cwd, envs=envs,
                                                  stdin=stdin, timeout=timeout),
                     api_url, api_key, sandbox_url, error_code=ops.EXIT_AGENTENV_ERROR))


# ---------------------------------------------------------------- shell


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
    from agentenv import cli_ops as ops

    envs = _env_pairs(env)
    sys.exit(ops.run(lambda api: ops.shell_session(api, sandbox_id, user=user, cwd=cwd, shell=shell, envs=envs),
                     api_url, api_key, sandbox_url, error_code=ops.EXIT_AGENTENV_ERROR))


# ---------------------------------------------------------------- logs


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
    from agentenv import cli_ops as ops

    try:
        ops.run(lambda api: ops.show_logs(api, sandbox_id, follow=follow, level=level, as_json=as_json),
                api_url, api_key, sandbox_url)
    except SystemExit as e:
        if e.code == ops.EXIT_INTERRUPTED and follow:
            sys.exit(0)  # Ctrl-C is how a follow ends
        raise


# ---------------------------------------------------------------- files


@click.group("files")
def sandbox_files() -> None:
    """Copy files between this machine and a sandbox (envd /files, streamed)."""


@sandbox_files.command("get")
@click.argument("sandbox_id")
@click.argument("remote")
@click.argument("local", required=False)
@click.option("--user", "-u", default=None, help="read as this user (relative paths: their home)")
@endpoint_options
def files_get(sandbox_id: str, remote: str, local: str | None, user: str | None, api_url: str | None,
              api_key: str | None, sandbox_url: str | None) -> None:
    """Download REMOTE from a sandbox to LOCAL (default: its base name here; `-` = stdout)."""
    from agentenv import cli_ops as ops

    target = local or os.path.basename(remote.rstrip("/")) or "download"
    if target != "-" and os.path.isdir(target):
        target = os.path.join(target, os.path.basename(remote.rstrip("/")))
    n = ops.run(lambda api: ops.get_file(api, sandbox_id, remote, target, user), api_url, api_key, sandbox_url)
    if target != "-":
        ops.echo_err(f"{remote} -> {target} ({n} bytes)")


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
    from agentenv import cli_ops as ops

    if local != "-" and (not os.path.exists(local) or os.path.isdir(local)):  # FIFOs, /dev/fd/N are fine
        raise click.BadParameter(f"{local}: no such file", param_hint="LOCAL")
    entries = ops.run(lambda api: ops.put_file(api, sandbox_id, local, remote, user), api_url, api_key,
                      sandbox_url)
    if as_json:
        click.echo(json.dumps(entries))
    else:
        for e in entries:
            click.echo(e.get("path", remote))


# ---------------------------------------------------------------- template build


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
    from agentenv import cli_ops as ops
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
        ops.echo_err(f"warning: {path}: {w}")

    result: dict[str, Any] = ops.run(
        lambda api: build(api, plan, name, ctx, cpu_count=cpu_count, memory_mb=memory_mb, force=no_cache,
                          ready_cmd=ready_cmd, start_cmd=start_cmd, on_log=ops.print_build_log,
                          note=ops.echo_err),
        api_url, api_key, sandbox_url)
    ok = result.get("status") == "ready"
    if as_json:
        click.echo(json.dumps({k: v for k, v in result.items() if k not in ("logs", "logEntries")}))
    elif ok:
        click.echo(name)
    if not ok:
        reason = (result.get("reason") or {}).get("message", "unknown reason")
        ops.echo_err(f"Error: build {result.get('buildID')} failed: {reason}")
        sys.exit(1)


def register(sandbox: click.Group, templates: click.Group) -> None:
    """Add these commands to the CLI's `sandbox` and `templates` groups."""
    for cmd in (sandbox_exec, sandbox_shell, sandbox_logs, sandbox_files):
        sandbox.add_command(cmd)
    templates.add_command(template_build)
