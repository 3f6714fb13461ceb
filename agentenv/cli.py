"""`agentenv` command line: serve, doctor, images, API keys, sandboxes, garbage collection."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from agentenv import __version__, cli_db, cli_sandbox, cli_timetravel
from agentenv.cli_cluster import cluster as cluster_group
from agentenv.config import Settings
from agentenv.hostsetup import setup_command
from agentenv.mcp_server import mcp_command

console = Console(stderr=True)


def _settings(data_dir: str | None = None, **kw) -> Settings:
    overrides = {k: v for k, v in kw.items() if v is not None}
    if data_dir:
        overrides["data_dir"] = Path(data_dir)
    return Settings(**overrides)


@contextlib.contextmanager
def _progress() -> Iterator:
    """A rich progress bar fed by the image store's (message, fraction) callbacks.

    Without a terminal (CI logs, systemd) a live bar renders nothing useful: print a line per
    stage and per 10 % step instead.
    """
    if not console.is_terminal:
        import time

        last: dict[str, float] = {}
        printed = {"at": 0.0, "message": ""}

        def plain(message: str, fraction: float | None) -> None:
            stage = message.split(":", 1)[0]
            step = -1.0 if fraction is None else int(fraction * 10) / 10
            now = time.monotonic()
            if last.get(stage) != step or (message != printed["message"] and now - printed["at"] > 5):
                last[stage] = step
                printed.update(at=now, message=message)
                pct = "" if fraction is None else f" [{fraction * 100:3.0f}%]"
                console.print(f"{message}{pct}", highlight=False, soft_wrap=True)

        yield plain
        return
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                  TimeElapsedColumn(), console=console, transient=False) as prog:
        tasks: dict[str, int] = {}
        state = {"current": None}

        def cb(message: str, fraction: float | None) -> None:
            stage = message.split(":", 1)[0] if ":" in message else message
            if state["current"] != stage or stage not in tasks:
                if state["current"] in tasks:
                    prog.update(tasks[state["current"]], completed=100)
                if stage not in tasks:
                    tasks[stage] = prog.add_task(stage, total=100)
                state["current"] = stage
            desc = message if len(message) < 70 else message[:67] + "..."
            if fraction is None:
                prog.update(tasks[stage], description=desc)
            else:
                prog.update(tasks[stage], description=desc, completed=max(0.0, min(1.0, fraction)) * 100)

        yield cb
        for t in tasks.values():
            prog.update(t, completed=100)


@contextlib.contextmanager
def server_lock(settings: Settings, *, wait: bool = False) -> Iterator[None]:
    """One server per data dir; `gc` refuses to run while a server holds the lock."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(settings.data_dir / "server.lock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            raise click.ClickException(f"another agentenv server is using {settings.data_dir}") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.close(fd)


@click.group()
@click.version_option(__version__)
@click.option("--log-level", default=os.environ.get("AGENTENV_LOG_LEVEL", "INFO"), show_default=True)
def main(log_level: str) -> None:
    """Self-hosted, E2B-compatible, forkable sandboxes."""
    from agentenv.server import setup_logging

    setup_logging(log_level)


# ---------------------------------------------------------------- serve


def _run_role(coro) -> None:
    """Run a server role to completion: Ctrl-C is a normal stop, a StartupError a clean message."""
    from agentenv.server import StartupError

    try:
        asyncio.run(coro)
    except KeyboardInterrupt:
        pass
    except StartupError as e:
        raise click.ClickException(str(e)) from None


@main.command()
@click.option("--host", default=None, help="listen address (AGENTENV_HOST, default 127.0.0.1)")
@click.option("--port", type=int, default=None, help="listen port (AGENTENV_PORT, default 3000)")
@click.option("--data-dir", default=None, help="everything the server keeps (AGENTENV_DATA_DIR)")
def serve(host: str | None, port: int | None, data_dir: str | None) -> None:
    """Run the single-node server (control API + sandbox traffic on one listener)."""
    from agentenv.server import serve as run

    settings = _settings(data_dir, host=host, port=port)
    _require_root()
    with server_lock(settings), _progress() as cb:
        _run_role(run(settings, progress=cb))


@main.command()
@click.option("--host", default=None, help="listen address (AGENTENV_HOST)")
@click.option("--port", type=int, default=None, help="listen port (AGENTENV_PORT)")
@click.option("--data-dir", default=None, help="this node's data dir (AGENTENV_DATA_DIR)")
def node(host: str | None, port: int | None, data_dir: str | None) -> None:
    """Run a cluster node: sandboxes of this host (needs AGENTENV_DATABASE_URL, _CLUSTER_TOKEN, _NODE_URL)."""
    from agentenv.cluster.node import run_node

    settings = _settings(data_dir, host=host, port=port)
    _require_root()
    with server_lock(settings), _progress() as cb:
        _run_role(run_node(settings, progress=cb))


@main.command()
@click.option("--host", default=None, help="listen address (AGENTENV_HOST)")
@click.option("--port", type=int, default=None, help="listen port (AGENTENV_PORT)")
def gateway(host: str | None, port: int | None) -> None:
    """Run the cluster gateway: public API + sandbox traffic, routed to the nodes (no root needed)."""
    from agentenv.cluster.gateway import run_gateway

    _run_role(run_gateway(_settings(None, host=host, port=port)))


@main.command("data-plane")
@click.option("--role", type=click.Choice(["serve", "node", "gateway"]), default="node", show_default=True,
              help="the role whose HAProxy this runs (a gateway's files are per port)")
@click.option("--port", type=int, default=None, help="the gateway's listen port (AGENTENV_PORT)")
@click.option("--data-dir", default=None, help="the role's data dir, shared with it (AGENTENV_DATA_DIR)")
def data_plane(role: str, port: int | None, data_dir: str | None) -> None:
    """Run a role's HAProxy as a component of its own (the role has AGENTENV_HAPROXY_EXTERNAL=true)."""
    from agentenv.proxy import component, dataplane
    from agentenv.proxy.haproxy import haproxy_binary
    from agentenv.server import StopSignal

    settings = _settings(data_dir, port=port)
    binary = haproxy_binary(settings.haproxy_path)
    if binary is None:
        raise click.ClickException(f"{settings.haproxy_path!r} is not installed (apt-get install haproxy)")
    layout = dataplane.gateway_layout(settings) if role == "gateway" else dataplane.layout(settings)

    async def run() -> None:
        stop = StopSignal()
        await component.Component(binary, layout).run(stop.event)

    _run_role(run())


@main.command()
@click.option("--host", default=None, help="listen address (AGENTENV_HOST)")
@click.option("--port", type=int, default=None, help="listen port (AGENTENV_PORT)")
def scheduler(host: str | None, port: int | None) -> None:
    """Run the cluster scheduler: placement and node liveness (no root needed)."""
    from agentenv.cluster.scheduler import run_scheduler

    _run_role(run_scheduler(_settings(None, host=host, port=port)))


@main.command()
@click.option("--node-url", default=None, help="the node's URL (default AGENTENV_NODE_URL or http://127.0.0.1:<port>)")
@click.option("--undo", is_flag=True, help="accept new sandboxes again")
def drain(node_url: str | None, undo: bool) -> None:
    """Stop placing new sandboxes on a node (e.g. before maintenance or a pod's termination)."""
    from agentenv.cluster.internal import Client

    settings = _settings(None)
    url = (node_url or settings.node_url or settings.api_url()).rstrip("/")

    async def go() -> dict:
        client = Client.for_settings(settings, timeout=60)  # cluster TLS: the node's own certificate
        async with client.session as s, s.post(
                f"{url}/internal/drain", json={"draining": not undo}, headers=client.headers) as r:
            body = await r.json(content_type=None)
            if r.status >= 400:
                raise click.ClickException(f"{url}: {r.status} {body}")
            return body

    body = asyncio.run(go())
    click.echo(f"node {body.get('node_id')}: {body.get('state')} ({body.get('sandboxes')} active sandboxes)")


def _require_root() -> None:
    if os.geteuid() != 0:
        raise click.ClickException("agentenv needs root (network namespaces, mounts, runsc); run it as root")


# ---------------------------------------------------------------- doctor


@main.command()
@click.option("--data-dir", default=None)
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def doctor(data_dir: str | None, as_json: bool) -> None:
    """Check the host: runsc, debootstrap, netns, cgroups, overlayfs, KVM, runtimes (and auto's pick), disk."""
    from agentenv.doctor import run_checks

    settings = _settings(data_dir)
    results = run_checks(settings)
    if as_json:
        click.echo(json.dumps([r.__dict__ for r in results], indent=1))
        if any(r.status == "fail" for r in results):
            sys.exit(1)
        return
    if not sys.stdout.isatty():   # plain lines for logs and pipes (a table would wrap every cell)
        for r in results:
            click.echo(f"{r.name}: {r.status}: {r.detail}" + (f" (fix: {r.fix})" if r.fix else ""))
        if any(r.status == "fail" for r in results):
            sys.exit(1)
        return
    table = Table(title="agentenv doctor")
    for col in ("check", "status", "detail", "how to fix"):
        table.add_column(col)
    colors = {"ok": "green", "warn": "yellow", "fail": "red", "info": "cyan"}
    for r in results:
        table.add_row(r.name, f"[{colors[r.status]}]{r.status}[/]", r.detail, r.fix or "")
    Console().print(table)
    if any(r.status == "fail" for r in results):
        sys.exit(1)


# ---------------------------------------------------------------- images


@main.group()
def image() -> None:
    """Base images and the tools layer."""


@image.command("build")
@click.option("--data-dir", default=None)
@click.option("--vm/--no-vm", default=None,
              help="Also build the microVM guest image (kernel, initramfs, drives); default: when the "
                   "configured runtime is a VM runtime.")
def image_build(data_dir: str | None, vm: bool | None) -> None:
    """Build (or verify the cache of) the base image and the tools layer (+ the VM guest image)."""
    from agentenv.storage.images import ImageStore

    _require_root()
    settings = _settings(data_dir)
    store = ImageStore(settings)
    if vm is None:
        vm = settings.runtime in ("qemu", "firecracker")

    async def go() -> tuple[Path, Path, dict]:
        with _progress() as cb:
            base = await store.ensure_base(cb)
            tools = await store.ensure_tools(cb)
            guest_parts: dict = {}
            if vm:
                from agentenv.storage.guest import build_guest_image

                guest_parts = await build_guest_image(store.images_dir, base, tools, settings.default_disk_mb, cb)
        return base, tools, guest_parts

    base, tools, guest_parts = asyncio.run(go())
    click.echo(f"base image:  {base}")
    click.echo(f"tools layer: {tools}")
    for name, p in guest_parts.items():
        click.echo(f"guest {name + ':':8} {p}")


@image.command("list")
@click.option("--data-dir", default=None)
@click.option("--json", "as_json", is_flag=True, help="One JSON array (for scripts).")
def image_list(data_dir: str | None, as_json: bool) -> None:
    """List built images."""
    from agentenv.storage.images import ImageStore

    store = ImageStore(_settings(data_dir))
    rows = store.list_images()
    if as_json:
        click.echo(json.dumps(rows, default=str))
        return
    table = Table()
    cols = list(rows[0].keys()) if rows else ["name"]
    for c in cols:
        table.add_column(str(c))
    for r in rows:
        table.add_row(*(str(r.get(c, "")) for c in cols))
    Console().print(table)


@image.command("import")
@click.argument("source", type=click.Path(exists=True))
@click.option("--name", "ref", required=True, help="Image reference templates use in fromImage, e.g. alpine:3.20")
@click.option("--data-dir", default=None)
def image_import(source: str, ref: str, data_dir: str | None) -> None:
    """Import an OCI image (OCI layout dir, OCI archive or `docker save` tarball) for fromImage."""
    from agentenv.storage import oci
    from agentenv.storage.images import ImageStore

    store = ImageStore(_settings(data_dir))
    try:
        name = oci.import_image(store, Path(source), ref,
                                progress=lambda msg, _f: click.echo(msg, err=True))
    except oci.ImageFormatError as e:
        raise click.ClickException(e.message) from None
    m = store.manifest(name)
    click.echo(f"imported {m['ref']} as image {name} ({m['os'].get('pretty_name', 'unknown OS')})")


# ---------------------------------------------------------------- API keys


@main.group()
def keys() -> None:
    """API keys (stored hashed in the state store)."""


async def _with_auth(settings: Settings, fn):
    from agentenv.api.auth import ApiKeyAuth
    from agentenv.state import store_for

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    store = store_for(settings)  # AGENTENV_DATABASE_URL: the cluster's keys and teams
    await store.open()
    try:
        return await fn(ApiKeyAuth(store))
    finally:
        await store.close()


@keys.command("create")
@click.option("--name", default="default", show_default=True)
@click.option("--team", default="default", show_default=True)
@click.option("--data-dir", default=None)
@click.option("--json", "as_json", is_flag=True, help="{key, keyID, name, teamID} (the key is shown only here)")
def keys_create(name: str, team: str, data_dir: str | None, as_json: bool) -> None:
    """Create an API key; prints it once (only its hash is stored)."""
    key, rec = asyncio.run(_with_auth(_settings(data_dir), lambda a: a.create_key(name, team_id=team)))
    if as_json:
        click.echo(json.dumps({"key": key, **_key_json(rec)}))
        return
    click.echo(key)
    console.print(f"key id {rec.key_id} (team {rec.team_id}); export E2B_API_KEY={key}")


def _key_json(r) -> dict:
    return {"keyID": r.key_id, "name": r.name, "teamID": r.team_id,
            "createdAt": r.created_at.isoformat(timespec="seconds"), "revoked": r.revoked}


@keys.command("list")
@click.option("--team", default=None, help="Only this team's keys.")
@click.option("--data-dir", default=None)
@click.option("--json", "as_json", is_flag=True, help="One JSON array (for scripts).")
def keys_list(team: str | None, data_dir: str | None, as_json: bool) -> None:
    recs = asyncio.run(_with_auth(_settings(data_dir), lambda a: a.list_keys(team_id=team)))
    if as_json:
        click.echo(json.dumps([_key_json(r) for r in recs]))
        return
    table = Table()
    for c in ("id", "name", "team", "created", "revoked"):
        table.add_column(c)
    for r in recs:
        table.add_row(r.key_id, r.name, r.team_id, r.created_at.isoformat(timespec="seconds"), str(r.revoked))
    Console().print(table)


@keys.command("revoke")
@click.argument("key_id")
@click.option("--data-dir", default=None)
def keys_revoke(key_id: str, data_dir: str | None) -> None:
    asyncio.run(_with_auth(_settings(data_dir), lambda a: a.revoke(key_id)))
    click.echo(f"revoked {key_id}")


# ---------------------------------------------------------------- teams


@main.group()
def teams() -> None:
    """Teams (tenants): each API key belongs to one; a team sees only its own sandboxes and snapshots."""


def _quota(value: str) -> int | None:
    if value == "default":
        return None
    try:
        n = int(value)
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected a number of sandboxes or 'default'") from None
    if n < 0:
        raise click.BadParameter("must not be negative")
    return n


@teams.command("create")
@click.argument("team_id")
@click.option("--name", default=None, help="Display name (default: the id).")
@click.option("--max-sandboxes", default=None, help="Concurrent-sandbox quota, or 'default'.")
@click.option("--data-dir", default=None)
@click.option("--json", "as_json", is_flag=True, help="The team as JSON.")
def teams_create(team_id: str, name: str | None, max_sandboxes: str | None, data_dir: str | None,
                 as_json: bool) -> None:
    """Create a team (idempotent); `agentenv keys create --team ID` then issues its keys."""
    async def go(a):
        await a.ensure_team(team_id, name)
        if max_sandboxes is not None:
            await a.set_team_quota(team_id, _quota(max_sandboxes))
        return await a.get_team(team_id)

    team = _run_auth(data_dir, go)
    click.echo(json.dumps(_team_json(team)) if as_json else team.team_id)


def _team_json(t) -> dict:
    return {"teamID": t.team_id, "name": t.name, "maxSandboxes": t.max_sandboxes,
            "createdAt": t.created_at.isoformat(timespec="seconds")}


@teams.command("list")
@click.option("--data-dir", default=None)
@click.option("--json", "as_json", is_flag=True, help="One JSON array (maxSandboxes null = the default).")
def teams_list(data_dir: str | None, as_json: bool) -> None:
    settings = _settings(data_dir)
    recs = _run_auth(data_dir, lambda a: a.list_teams())
    if as_json:
        click.echo(json.dumps([_team_json(t) for t in recs]))
        return
    table = Table()
    for c in ("team", "name", "max sandboxes", "created"):
        table.add_column(c)
    for t in recs:
        quota = f"{settings.max_sandboxes_per_team} (default)" if t.max_sandboxes is None else str(t.max_sandboxes)
        table.add_row(t.team_id, t.name, quota, t.created_at.isoformat(timespec="seconds"))
    Console().print(table)


@teams.command("set-quota")
@click.argument("team_id")
@click.argument("max_sandboxes")
@click.option("--data-dir", default=None)
def teams_set_quota(team_id: str, max_sandboxes: str, data_dir: str | None) -> None:
    """Set TEAM_ID's concurrent-sandbox limit (a number, or 'default'); a running server sees it at once."""
    team = _run_auth(data_dir, lambda a: a.set_team_quota(team_id, _quota(max_sandboxes)))
    click.echo(f"team {team.team_id}: max sandboxes "
               f"{'default' if team.max_sandboxes is None else team.max_sandboxes}")


def _run_auth(data_dir: str | None, fn):
    from agentenv.errors import AgentEnvError

    try:
        return asyncio.run(_with_auth(_settings(data_dir), fn))
    except AgentEnvError as e:
        raise click.ClickException(e.message) from None


# ---------------------------------------------------------------- templates (runtime per template)


@main.group()
def templates() -> None:
    """Templates: build one on a running server (`build`); list, create and set the runtime of
    templates in this host's state store (`list`, `create`, `set-runtime`)."""


def _run_store(data_dir: str | None, fn):
    from agentenv.errors import AgentEnvError
    from agentenv.state import store_for

    async def go():
        settings = _settings(data_dir)
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        store = store_for(settings)
        await store.open()
        try:
            return await fn(store)
        finally:
            await store.close()

    try:
        return asyncio.run(go())
    except AgentEnvError as e:
        raise click.ClickException(e.message) from None


def _runtime_choice(value: str) -> str | None:
    from agentenv.runtimes import select

    try:
        name = select.normalise(value)
    except select.RuntimeUnavailable as e:
        raise click.BadParameter(e.message) from None
    return None if name == "auto" else name


def _template_json(t) -> dict:
    return {"templateID": t.template_id, "aliases": t.aliases, "image": t.image, "runtime": t.runtime,
            "cpuCount": t.cpu_count, "memoryMB": t.memory_mb, "teamID": t.team_id}


@templates.command("list")
@click.option("--json", "as_json", is_flag=True, help="One JSON array (for scripts).")
@click.option("--data-dir", default=None)
def templates_list(as_json: bool, data_dir: str | None) -> None:
    recs = _run_store(data_dir, lambda st: st.list_templates())
    if as_json:
        click.echo(json.dumps([_template_json(t) for t in recs]))
        return
    table = Table()
    for c in ("template", "aliases", "image", "runtime", "cpu", "memory MiB", "team"):
        table.add_column(c)
    for t in recs:
        table.add_row(t.template_id, ", ".join(t.aliases), t.image, t.runtime or "(node default)", str(t.cpu_count),
                      str(t.memory_mb), t.team_id or "(built in)")
    Console().print(table)


@templates.command("create")
@click.argument("name")
@click.option("--image", default="base", show_default=True, help="Image in the image store (`agentenv image list`).")
@click.option("--runtime", "runtime", default="auto", show_default=True,
              help="auto (the node default) | gvisor | firecracker | qemu")
@click.option("--cpu", "cpu_count", type=click.IntRange(1, 64), default=None)
@click.option("--memory-mb", type=click.IntRange(128, 262144), default=None)
@click.option("--data-dir", default=None)
@click.option("--json", "as_json", is_flag=True, help="The template as JSON.")
def templates_create(name: str, image: str, runtime: str, cpu_count: int | None, memory_mb: int | None,
                     data_dir: str | None, as_json: bool) -> None:
    """A built-in template NAME (visible to every team) of IMAGE, whose sandboxes run under RUNTIME."""
    from agentenv.models import TemplateRecord
    from agentenv.orchestrator.templates import new_template_id

    settings = _settings(data_dir)
    rt = _runtime_choice(runtime)
    if not (settings.paths.images / image).is_dir():
        raise click.ClickException(f"no image {image!r} in {settings.paths.images} (see `agentenv image list`)")

    async def go(st):
        if await st.get_template(name) is not None:
            raise click.ClickException(f"template {name!r} exists; change its runtime with `templates set-runtime`")
        rec = TemplateRecord(template_id=new_template_id(), aliases=[name],
                             cpu_count=cpu_count or settings.default_cpu_count,
                             memory_mb=memory_mb or settings.default_memory_mb, disk_mb=settings.default_disk_mb,
                             image=image, runtime=rt)
        await st.put_template(rec)
        return rec

    rec = _run_store(data_dir, go)
    if as_json:
        click.echo(json.dumps(_template_json(rec)))
        return
    click.echo(f"template {name} ({rec.template_id}): image {image}, runtime {rt or 'node default'}")


@templates.command("set-runtime")
@click.argument("template")
@click.argument("runtime")
@click.option("--data-dir", default=None)
def templates_set_runtime(template: str, runtime: str, data_dir: str | None) -> None:
    """Sandboxes of TEMPLATE (id or alias) run under RUNTIME (auto = the node default) from now on;
    a running server sees it at its next create. A built template's own memory image keeps the
    runtime that made it."""
    rt = _runtime_choice(runtime)

    async def go(st):
        rec = await st.get_template(template)
        if rec is None:
            raise click.ClickException(f"template {template!r} not found")
        rec.runtime = rt
        await st.put_template(rec)
        return rec

    rec = _run_store(data_dir, go)
    click.echo(f"template {rec.aliases[0] if rec.aliases else rec.template_id}: runtime {rt or 'node default'}")


# ---------------------------------------------------------------- sandboxes (through the API)


def _api(api_url: str | None, api_key: str | None) -> tuple[str, dict[str, str]]:
    from agentenv.client import ApiError, resolve_endpoint

    try:
        ep = resolve_endpoint(api_url, api_key)
    except ApiError as e:
        raise click.ClickException(e.message) from None
    return ep.api_url, {"X-API-KEY": ep.api_key}


def _call(method: str, url: str, headers: dict[str, str], body: dict | None = None):
    import aiohttp

    async def go():
        async with aiohttp.ClientSession() as http:
            async with http.request(method, url, headers=headers, json=body) as resp:
                text = await resp.text()
                data = json.loads(text) if text else None
                if resp.status >= 300:
                    msg = data.get("message") if isinstance(data, dict) else text
                    raise click.ClickException(f"HTTP {resp.status}: {msg}")
                return data

    return asyncio.run(go())


api_opts = [click.option("--api-url", default=None, help="default $E2B_API_URL, $AGENTENV_API_URL, "
                                                        "http://127.0.0.1:3000"),
            click.option("--api-key", default=None, help="default $E2B_API_KEY, $AGENTENV_API_KEY")]


def _with_api_opts(f):
    for opt in reversed(api_opts):
        f = opt(f)
    return f


@main.group()
def sandbox() -> None:
    """Create, list and kill sandboxes on a running server."""


@sandbox.command("list")
@click.option("--json", "as_json", is_flag=True, help="print the API's JSON (for scripts)")
@_with_api_opts
def sandbox_list(as_json, api_url, api_key) -> None:
    url, h = _api(api_url, api_key)
    rows = _call("GET", f"{url}/v2/sandboxes", h) or []
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        return
    table = Table()
    for c in ("sandboxID", "templateID", "state", "startedAt", "endAt", "metadata"):
        table.add_column(c)
    for r in rows:
        table.add_row(r["sandboxID"], r["templateID"], r["state"], r["startedAt"], r["endAt"],
                      json.dumps(r.get("metadata") or {}))
    Console().print(table)


@sandbox.command("create")
@click.option("--template", default="base", show_default=True)
@click.option("--timeout", type=int, default=300, show_default=True)
@click.option("--metadata", "-m", multiple=True, help="KEY=VALUE (repeatable)")
@click.option("--env", "-e", "env", multiple=True, help="NAME=VALUE for every process (repeatable)")
@click.option("--json", "as_json", is_flag=True, help="print the API's answer (sandboxID, envdAccessToken, ...)")
@_with_api_opts
def sandbox_create(template, timeout, metadata, env, as_json, api_url, api_key) -> None:
    """Create a sandbox from a template (or snapshot) and print its id."""
    url, h = _api(api_url, api_key)
    body: dict = {"templateID": template, "timeout": timeout}
    if metadata:
        body["metadata"] = _pairs(metadata, "--metadata")
    if env:
        body["envVars"] = _pairs(env, "--env")
    r = _call("POST", f"{url}/v2/sandboxes", h, body)
    click.echo(json.dumps(r) if as_json else r["sandboxID"])


def _pairs(values: tuple[str, ...], hint: str) -> dict[str, str]:
    out = {}
    for v in values:
        k, eq, val = v.partition("=")
        if not eq or not k:
            raise click.BadParameter(f"{v!r}: expected KEY=VALUE", param_hint=hint)
        out[k] = val
    return out


@sandbox.command("kill")
@click.argument("sandbox_ids", nargs=-1, required=True)
@_with_api_opts
def sandbox_kill(sandbox_ids, api_url, api_key) -> None:
    url, h = _api(api_url, api_key)
    for sid in sandbox_ids:
        _call("DELETE", f"{url}/sandboxes/{sid}", h)
        click.echo(f"killed {sid}")


@sandbox.command("fork")
@click.argument("sandbox_id")
@click.option("--count", type=int, default=1, show_default=True, help="children to start from one capture")
@click.option("--timeout", type=int, default=None, help="children's TTL in seconds (server default if unset)")
@click.option("--json", "as_json", is_flag=True, help="print the API's answer (one result per child)")
@_with_api_opts
def sandbox_fork(sandbox_id, count, timeout, as_json, api_url, api_key) -> None:
    """Fork a running sandbox into COUNT children that continue from its exact state."""
    url, h = _api(api_url, api_key)
    body: dict = {"count": count}
    if timeout is not None:
        body["timeout"] = timeout
    results = _call("POST", f"{url}/sandboxes/{sandbox_id}/fork", h, body) or []
    if as_json:
        click.echo(json.dumps(results))
        sys.exit(1 if any(not r.get("sandbox") for r in results) else 0)
    failed = 0
    for r in results:
        if r.get("sandbox"):
            click.echo(r["sandbox"]["sandboxID"])
        else:
            failed += 1
            console.print(f"[red]child failed:[/] {r.get('error', {}).get('message')}")
    if failed:
        sys.exit(1)


@sandbox.command("pause")
@click.argument("sandbox_id")
@_with_api_opts
def sandbox_pause(sandbox_id, api_url, api_key) -> None:
    """Pause (checkpoint memory + filesystem, release CPU and memory)."""
    url, h = _api(api_url, api_key)
    _call("POST", f"{url}/sandboxes/{sandbox_id}/pause", h, {})
    click.echo(f"paused {sandbox_id}")


@sandbox.command("resume")
@click.argument("sandbox_id")
@click.option("--timeout", type=int, default=300, show_default=True)
@_with_api_opts
def sandbox_resume(sandbox_id, timeout, api_url, api_key) -> None:
    url, h = _api(api_url, api_key)
    _call("POST", f"{url}/v2/sandboxes/{sandbox_id}/connect", h, {"timeout": timeout})
    click.echo(f"running {sandbox_id}")


@main.group()
def snapshot() -> None:
    """Snapshots of sandboxes (memory + filesystem layers) on a running server."""


@snapshot.command("create")
@click.argument("sandbox_id")
@click.option("--name", default=None)
@click.option("--filesystem-only", is_flag=True, help="keep files only (sandboxes from it boot fresh)")
@click.option("--json", "as_json", is_flag=True, help="print the API's answer (snapshotID, names, sizes)")
@_with_api_opts
def snapshot_create(sandbox_id, name, filesystem_only, as_json, api_url, api_key) -> None:
    url, h = _api(api_url, api_key)
    body: dict = {"memory": not filesystem_only}
    if name:
        body["name"] = name
    r = _call("POST", f"{url}/sandboxes/{sandbox_id}/snapshots", h, body)
    click.echo(json.dumps(r) if as_json else r["snapshotID"])


@snapshot.command("list")
@click.option("--sandbox", "sandbox_id", default=None)
@click.option("--json", "as_json", is_flag=True, help="print the API's JSON (for scripts)")
@_with_api_opts
def snapshot_list(sandbox_id, as_json, api_url, api_key) -> None:
    url, h = _api(api_url, api_key)
    q = f"?sandboxID={sandbox_id}" if sandbox_id else ""
    if as_json:
        click.echo(json.dumps(_call("GET", f"{url}/snapshots{q}", h) or [], indent=1))
        return
    table = Table()
    for c in ("snapshotID", "names", "source", "sizeBytes", "createdAt"):
        table.add_column(c)
    for r in _call("GET", f"{url}/snapshots{q}", h) or []:
        table.add_row(r["snapshotID"], ", ".join(r.get("names") or []), str(r.get("sourceSandboxID") or ""),
                      str(r.get("sizeBytes", "")), str(r.get("createdAt", "")))
    Console().print(table)


@snapshot.command("delete")
@click.argument("snapshot_ids", nargs=-1, required=True)
@_with_api_opts
def snapshot_delete(snapshot_ids, api_url, api_key) -> None:
    url, h = _api(api_url, api_key)
    for sid in snapshot_ids:
        _call("DELETE", f"{url}/snapshots/{sid}", h)
        click.echo(f"deleted {sid}")


# ---------------------------------------------------------------- exec, shell, logs, files, template build

cli_sandbox.register(sandbox, templates)
cli_db.register(main, _settings)
cli_timetravel.register(sandbox, main)  # sandbox checkpoint|rollback|checkpoints, checkpoint tree
main.add_command(cluster_group)
main.add_command(templates, "template")  # `agentenv template build`, as E2B's CLI spells it
main.add_command(mcp_command)
main.add_command(setup_command)  # host packages (agentenv/hostsetup/host-packages.sh)


# ---------------------------------------------------------------- gc


@main.command()
@click.option("--data-dir", default=None)
@click.option("--store", "store_gc", is_flag=True,
              help="Collect the snapshot store instead (local dir or S3): remove blobs no snapshot, "
                   "sandbox, template build or catalog row references and older than the grace period. "
                   "Safe while servers run and publish.")
@click.option("--dry-run", is_flag=True, help="With --store: list what would be removed, remove nothing.")
@click.option("--grace", "grace_s", type=float, default=None,
              help="With --store: seconds an unreferenced blob is kept after its last write "
                   "(default: store_gc_grace_s, 3600).")
@click.option("--gateway", "gateways", is_flag=True,
              help="Only the HAProxy that killed cluster gateways of this data dir left running, and their "
                   "files (a gateway's data dir: no sandboxes, no store). Running gateways are left alone.")
def gc(data_dir: str | None, store_gc: bool, dry_run: bool, grace_s: float | None, gateways: bool) -> None:
    """Remove containers, netns, mounts and dirs of this data dir that no live sandbox owns, and the
    HAProxy a killed server or cluster gateway of this data dir left running.

    Refuses while a server runs on the data dir. Running sandboxes cannot outlive their server's
    state, so all of them are removed; paused sandboxes (kept on disk) are not touched.
    With --store: garbage-collect the snapshot store (docs/cluster.md, "Garbage collection").
    """
    from agentenv.server import build

    settings = _settings(data_dir)
    if store_gc:
        from agentenv.cli_store import collect_store

        collect_store(settings, dry_run=dry_run, grace_s=settings.store_gc_grace_s if grace_s is None else grace_s)
        return
    if dry_run or grace_s is not None:
        raise click.UsageError("--dry-run and --grace go with --store")
    if gateways:
        from agentenv.proxy import dataplane

        left = asyncio.run(dataplane.stop_leftover_gateways(settings))
        click.echo(f"gateway haproxy: removed {len(left)}" + (f" ({', '.join(left)})" if left else ""))
        return
    _require_root()

    async def go():
        from agentenv.runtimes._reaper import become_subreaper, reap_forever

        become_subreaper()
        reaper = asyncio.create_task(reap_forever())
        from agentenv.state.postgres import is_postgres_url

        store = None
        if is_postgres_url(settings.database_url):  # a cluster node: only this node's sandboxes
            from agentenv.cluster.node import NodeScopedStore
            from agentenv.state.postgres import PostgresStateStore

            store = NodeScopedStore(PostgresStateStore(settings.database_url), settings.node_id)
        c = await build(settings, store=store)
        try:
            from agentenv.models import SandboxState

            keep = set()
            for rec in await c.store.list_sandboxes():
                if rec.state == SandboxState.PAUSED:
                    keep.add(rec.sandbox_id)
                else:
                    await c.store.delete_sandbox(rec.sandbox_id)
            from agentenv.orchestrator.host import GcIncomplete
            from agentenv.proxy import dataplane
            from agentenv.proxy.haproxy import sweep_orphan_sock_dirs

            try:
                removed, failed = await c.orchestrator.gc(keep), []
            except GcIncomplete as e:
                removed, failed = e.removed, e.failed
            removed["haproxy"] = await dataplane.stop_leftover(settings)  # a crashed server's data plane
            removed["gateway haproxy"] = await dataplane.stop_leftover_gateways(settings)  # killed gateways'
            # socket dirs in the temp dir of other killed servers whose data dirs were deleted since
            removed["data plane socket dirs"] = await asyncio.to_thread(sweep_orphan_sock_dirs)
            c.orchestrator.captures.drop_kept_images()  # forks in flight ended with that server
            return removed, failed
        finally:
            reaper.cancel()
            await c.store.close()

    with server_lock(settings):
        removed, failed = asyncio.run(go())
    for kind, ids in removed.items():
        click.echo(f"{kind}: removed {len(ids)}" + (f" ({', '.join(ids)})" if ids else ""))
    if failed:
        raise click.ClickException("could not stop: " + "; ".join(failed))


if __name__ == "__main__":
    main()
