"""`agentenv cluster ...`: the cluster's certificate authority and the roles' certificates
(mutual TLS of the internal traffic, docs/cluster.md "Internal traffic")."""

from __future__ import annotations

from pathlib import Path

import click


@click.group()
def cluster() -> None:
    """Cluster setup: the internal certificate authority and certificates."""


@cluster.group()
def ca() -> None:
    """The cluster CA that signs the roles' certificates."""


@ca.command("init")
@click.option("--dir", "directory", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="where ca.crt and ca.key (mode 0600) go; keep ca.key off the nodes")
@click.option("--days", default=3650, show_default=True, type=click.IntRange(1, 36500))
def ca_init(directory: Path, days: int) -> None:
    """Create a new cluster CA (refuses to overwrite one)."""
    from agentenv.cluster import tls

    try:
        crt = tls.create_ca(directory, days=days)
    except FileExistsError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"cluster CA: {crt} (AGENTENV_CLUSTER_CA_FILE on every role)")


@cluster.command("cert")
@click.option("--ca-dir", required=True, type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.option("--role", required=True, type=click.Choice(["node", "gateway", "scheduler", "admin"]))
@click.option("--name", default=None, help="the certificate's name; a node's is its node id (default: the role)")
@click.option("--host", "hosts", multiple=True,
              help="an IP address or DNS name the role is reached at (repeatable; a node's and a scheduler's "
                   "URL host must be one)")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--stem", default=None, help="file names <stem>.crt/.key (default: the name)")
@click.option("--days", default=7, show_default=True, type=click.IntRange(1, 3650),
              help="validity: short-lived; issue again before it ends (the roles reload renewed files)")
def cert(ca_dir: Path, role: str, name: str | None, hosts: tuple[str, ...], out_dir: Path, stem: str | None,
         days: int) -> None:
    """Issue a certificate + key for one role, signed by the cluster CA."""
    from agentenv.cluster import tls

    if role == "node" and not name:
        raise click.ClickException("a node certificate needs --name <node id>")
    crt, key = tls.issue_cert(ca_dir, role, name or role, out_dir, hosts=list(hosts), days=days, stem=stem)
    click.echo(f"{role} certificate: {crt}, key: {key} (AGENTENV_CLUSTER_CERT_FILE, AGENTENV_CLUSTER_KEY_FILE)")
