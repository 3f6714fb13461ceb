"""`agentenv sandbox checkpoint|rollback|checkpoints` and `agentenv checkpoint tree`: time travel from
the shell, over the server's public API (`agentenv.client.timetravel`). See docs/time-travel.md.

Exit codes: 0 success; 1 an error the server reported (its message on stderr); 2 usage.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import asdict

import click


def _client(api_url: str | None, api_key: str | None):
    from agentenv.client.api import ApiError, resolve_endpoint
    from agentenv.client.timetravel import TimeTravel

    try:
        ep = resolve_endpoint(api_url, api_key)
    except ApiError as e:
        raise click.ClickException(e.message) from e
    return TimeTravel(api_url=ep.api_url, api_key=ep.api_key)


def _run(fn: Callable):
    from agentenv.client.api import ApiError

    try:
        return fn()
    except ApiError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)


def _opts(f: Callable) -> Callable:
    for opt in reversed([click.option("--api-url", default=None, help="default $E2B_API_URL, $AGENTENV_API_URL"),
                         click.option("--api-key", default=None, help="default $E2B_API_KEY, $AGENTENV_API_KEY")]):
        f = opt(f)
    return f


@click.command("checkpoint")
@click.argument("sandbox_id")
@click.option("--name", default=None, help="a name the checkpoint can be found (and created from) by")
@click.option("--meta", "-m", multiple=True, help="KEY=VALUE label of the checkpoint (repeatable)")
@click.option("--json", "as_json", is_flag=True, help="print the API's answer")
@_opts
def sandbox_checkpoint(sandbox_id, name, meta, as_json, api_url, api_key) -> None:
    """Checkpoint a running sandbox (it keeps running); prints the checkpoint id."""
    labels = {}
    for m in meta:
        k, eq, v = m.partition("=")
        if not eq or not k:
            raise click.BadParameter(f"{m!r}: expected KEY=VALUE", param_hint="--meta")
        labels[k] = v
    tt = _client(api_url, api_key)
    c = _run(lambda: tt.checkpoint(sandbox_id, name=name, metadata=labels or None))
    click.echo(json.dumps(asdict(c)) if as_json else c.checkpoint_id)


@click.command("rollback")
@click.argument("sandbox_id")
@click.argument("checkpoint_id")
@_opts
def sandbox_rollback(sandbox_id, checkpoint_id, api_url, api_key) -> None:
    """Replace a running sandbox's memory, processes and files with a checkpoint's (same id, tokens)."""
    tt = _client(api_url, api_key)
    _run(lambda: tt.rollback(sandbox_id, checkpoint_id))
    click.echo(f"rolled {sandbox_id} back to {checkpoint_id}")


@click.command("checkpoints")
@click.argument("sandbox_id")
@click.option("--json", "as_json", is_flag=True, help="print the API's answer")
@_opts
def sandbox_checkpoints(sandbox_id, as_json, api_url, api_key) -> None:
    """The checkpoints taken of a sandbox, oldest first: id, parent, name, size."""
    tt = _client(api_url, api_key)
    cks = _run(lambda: tt.checkpoints(sandbox_id))
    if as_json:
        click.echo(json.dumps([asdict(c) for c in cks], indent=1))
        return
    for c in cks:
        click.echo(f"{c.checkpoint_id}  parent={c.parent_id or '-'}  {c.name or ''}  {c.size_bytes} bytes  {c.created_at}")


@click.command("tree")
@click.argument("checkpoint_id")
@click.option("--json", "as_json", is_flag=True, help="print the API's answer")
@_opts
def checkpoint_tree(checkpoint_id, as_json, api_url, api_key) -> None:
    """The whole checkpoint tree CHECKPOINT_ID belongs to, drawn with indentation."""
    tt = _client(api_url, api_key)
    tree = _run(lambda: tt.tree(checkpoint_id))
    if as_json:
        click.echo(json.dumps({"rootID": tree.root_id, "checkpoints": [asdict(c) for c in tree.checkpoints]},
                              indent=1))
        return

    def draw(cid: str | None, depth: int) -> None:
        for c in tree.children(cid):
            here = " *" if c.checkpoint_id == checkpoint_id or checkpoint_id == c.name else ""
            labels = " ".join(f"{k}={v}" for k, v in c.metadata.items())
            click.echo(f"{'  ' * depth}{c.checkpoint_id} {c.name or ''} {labels}{here}".rstrip())
            draw(c.checkpoint_id, depth + 1)

    draw(None, 0)


def register(sandbox: click.Group, main: click.Group) -> None:
    """`sandbox checkpoint|rollback|checkpoints` and the `checkpoint` group (`checkpoint tree`)."""
    for cmd in (sandbox_checkpoint, sandbox_rollback, sandbox_checkpoints):
        sandbox.add_command(cmd)

    @main.group("checkpoint")
    def checkpoint() -> None:
        """Checkpoint trees (time travel); checkpoints are deleted like snapshots."""

    checkpoint.add_command(checkpoint_tree)
