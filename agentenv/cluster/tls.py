"""Mutual TLS between the cluster roles: a cluster CA, certificates per role and node, the TLS
contexts, and who may call what.

`agentenv cluster ca init` makes a CA (or bring your own: any CA whose certificates carry the
role in the subject's OU); `agentenv cluster cert` issues a certificate for a role — `node`
(its CN is the node id), `gateway`, `scheduler` or `admin` (the operator's CLI) — usable as server
and as client certificate. With `cluster_ca_file`, `cluster_cert_file` and `cluster_key_file` set:

- nodes and schedulers listen on HTTPS and verify the client certificate of every request against
  the cluster CA: without one, every route but `/health` answers 401; a certificate of another CA
  fails the handshake. Each internal route names the roles it accepts (`ALLOWED`); a node's relayed
  heartbeat must come from that node's own certificate;
- gateways, schedulers and nodes call each other with their certificate and verify the peer's
  (its URL's host must be in the certificate's subject alternative names);
- certificates are short-lived (`DEFAULT_DAYS`) and re-read when their files change (`Reloader`),
  so renewing them (`agentenv cluster cert` again, e.g. from a timer) needs no restart;
- the shared cluster token is not needed (and not accepted in place of a certificate).

Uses `cryptography` (already needed by our TLS stack) to make keys and certificates.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web

from agentenv import pki
from agentenv.proxy.haproxy_conf import PEER_HEADER

log = logging.getLogger("agentenv.cluster.tls")

ROLES = ("node", "gateway", "scheduler", "admin")
DEFAULT_DAYS = 7
CA_DAYS = 3650

# Internal route (prefix) -> roles whose certificates may call it.
ALLOWED: dict[str, set[str]] = {
    "/internal/rpc/": {"gateway"},
    "/internal/events": {"gateway"},
    "/internal/drain": {"gateway", "admin", "node"},  # node: `agentenv drain` on the node, its own cert
    "/internal/status": {"scheduler", "gateway", "admin"},
    "/internal/place": {"gateway"},
    "/internal/release": {"gateway"},
    "/internal/nodes": {"gateway", "admin"},
    "/internal/heartbeat": {"node"},
}
# Everything else on a TLS listener (a node's public API and sandbox traffic: the gateway's hop;
# /metrics: Prometheus with an admin certificate).
OTHER_ROLES = {"gateway", "admin", "scheduler"}


# ---------------------------------------------------------------------- making certificates

def create_ca(directory: Path, *, name: str = "agentenv cluster CA", days: int = CA_DAYS) -> Path:
    """ca.crt + ca.key (0600) in `directory`; refuses to overwrite an existing CA."""
    from cryptography.x509.oid import NameOID

    directory = Path(directory)
    if (directory / "ca.key").exists():
        raise FileExistsError(f"{directory / 'ca.key'} exists: a cluster CA is there already")
    key, cert = pki.self_signed_ca([(NameOID.COMMON_NAME, name)], days=days, backdate=dt.timedelta(minutes=5))
    pki.write_private(directory / "ca.key", pki.pem_key(key))
    pki.write_public(directory / "ca.crt", pki.pem_cert(cert))
    return directory / "ca.crt"


def issue_cert(ca_dir: Path, role: str, name: str, out_dir: Path, *, hosts: list[str] = (),
               days: int = DEFAULT_DAYS, stem: str | None = None) -> tuple[Path, Path]:
    """A certificate + key for `role` (CN `name`, OU `role`), valid for `hosts` (IPs or DNS names),
    signed by the CA in `ca_dir`. Written (atomically, key 0600) as <out_dir>/<stem or name>.crt/.key."""
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}")
    ca_dir, out_dir = Path(ca_dir), Path(out_dir)
    ca_cert, ca_key = pki.load_ca(ca_dir / "ca.crt", ca_dir / "ca.key")
    key, cert = pki.leaf(ca_cert, ca_key, [(NameOID.COMMON_NAME, name), (NameOID.ORGANIZATIONAL_UNIT_NAME, role)],
                         sans=pki.san_entries(list(hosts)),
                         usages=[ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
                         days=days, backdate=dt.timedelta(minutes=5))
    crt_path, key_path = out_dir / f"{stem or name}.crt", out_dir / f"{stem or name}.key"
    # key first, then the certificate: a reloader that sees the new certificate finds its key
    pki.write_private(key_path, pki.pem_key(key))
    pki.write_public(crt_path, pki.pem_cert(cert))
    return crt_path, key_path


# ---------------------------------------------------------------------- contexts

def enabled(settings) -> bool:
    return bool(settings.cluster_ca_file and settings.cluster_cert_file and settings.cluster_key_file)


def check(settings) -> None:
    """All three files or none; they must be readable."""
    given = [settings.cluster_ca_file, settings.cluster_cert_file, settings.cluster_key_file]
    if any(given) and not all(given):
        raise ValueError("cluster TLS needs all of cluster_ca_file, cluster_cert_file and cluster_key_file")
    for p in filter(None, given):
        if not Path(p).is_file():
            raise ValueError(f"cluster TLS: {p} is not a readable file")


def server_context(settings) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(settings.cluster_cert_file, settings.cluster_key_file)
    ctx.load_verify_locations(settings.cluster_ca_file)
    # OPTIONAL: a certificate that is presented must verify (else the handshake fails); requests
    # without one reach the middleware, which refuses all but /health (probes of a supervisor).
    ctx.verify_mode = ssl.CERT_OPTIONAL
    return ctx


def client_context(settings) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=settings.cluster_ca_file)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(settings.cluster_cert_file, settings.cluster_key_file)
    return ctx


class Reloader:
    """Re-reads the certificate and key into the contexts when their files change (looked at every
    `cluster_cert_reload_s`)."""

    def __init__(self, settings, *contexts: ssl.SSLContext) -> None:
        self.settings = settings
        self.contexts = contexts
        self.on_reload: list[Callable[[], Awaitable[None]]] = []  # e.g. the node's HAProxy listener
        self.interval_s = settings.cluster_cert_reload_s
        self._stamp = self._mtime()
        self._task: asyncio.Task | None = None

    def _mtime(self) -> tuple[float, float]:
        try:
            return (os.stat(self.settings.cluster_cert_file).st_mtime, os.stat(self.settings.cluster_key_file).st_mtime)
        except OSError:
            return (0.0, 0.0)

    def check(self) -> bool:
        stamp = self._mtime()
        if stamp == self._stamp:
            return False
        try:
            for ctx in self.contexts:
                ctx.load_cert_chain(self.settings.cluster_cert_file, self.settings.cluster_key_file)
        except (OSError, ssl.SSLError) as e:  # half-written: try again next round
            log.warning("cluster certificate reload failed: %s", e)
            return False
        self._stamp = stamp
        log.info("cluster certificate reloaded from %s", self.settings.cluster_cert_file)
        return True

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if self.check():
                for hook in self.on_reload:
                    try:
                        await hook()
                    except Exception:  # noqa: BLE001 - the next change tries again
                        log.exception("cluster certificate reload hook failed")

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="cert-reload")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


def write_pem(settings, path: Path) -> Path:
    """The role's certificate and key in one file (0600), as HAProxy reads them."""
    data = Path(settings.cluster_cert_file).read_bytes().rstrip(b"\n") + b"\n" + \
        Path(settings.cluster_key_file).read_bytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    tmp.replace(path)
    return path


# ---------------------------------------------------------------------- who is calling

def peer(request: web.Request) -> tuple[str, str] | None:
    """(role, name) of the verified client certificate of `request`, or None.

    Behind a node's HAProxy (the request came over the root-only unix socket only HAProxy connects
    to) HAProxy verified the certificate and says whose it was in `PEER_HEADER`, which it removes
    from every request it receives."""
    transport = request.transport
    if transport is not None and isinstance(transport.get_extra_info("sockname"), str):
        role, _, name = request.headers.get(PEER_HEADER, "").partition("/")
        return (role, name) if role in ROLES and name else None
    cert = transport.get_extra_info("peercert") if transport is not None else None
    if not cert:
        return None
    fields = {k: v for rdn in cert.get("subject", ()) for k, v in rdn}
    role, name = fields.get("organizationalUnitName"), fields.get("commonName")
    if role not in ROLES or not name:
        return None
    return role, name


def allowed_roles(path: str) -> set[str]:
    for prefix, roles in ALLOWED.items():
        if path.startswith(prefix):
            return roles
    return OTHER_ROLES


def require_peer(is_sandbox_traffic: Callable[[web.Request], bool] | None = None):
    """Middleware for the HTTPS listeners of nodes and schedulers. `/health` is open (supervisors'
    probes), but not a sandbox's own `/health` (`is_sandbox_traffic`: a node's traffic proxy)."""

    @web.middleware
    async def check_peer(request: web.Request, handler):
        if request.path == "/health" and not (is_sandbox_traffic is not None and is_sandbox_traffic(request)):
            return await handler(request)
        who = peer(request)
        if who is None:
            return web.json_response({"code": 401, "message": "a client certificate of the cluster CA is required"},
                                     status=401)
        roles = allowed_roles(request.path)
        if who[0] not in roles:
            return web.json_response({"code": 403, "message": f"a {who[0]} certificate may not call {request.path} "
                                      f"(allowed: {', '.join(sorted(roles))})"}, status=403)
        request["cluster_peer"] = who
        return await handler(request)

    return check_peer
