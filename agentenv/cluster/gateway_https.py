"""The gateway's own listeners when it runs without HAProxy (`data_plane = python`, or no haproxy
installed; with it, `gateway_dataplane` serves both): HTTPS for `E2B_DOMAIN` against a cluster
(docs/cluster.md, "HTTPS").

With `https_bind` and `domain` set, `agentenv gateway` serves, next to its plain listener, HTTPS on
`https_bind` with a certificate for `<domain>` and `*.<domain>`: the operator's (`tls_cert` +
`tls_key`), else a local CA it creates under `<data_dir>/tls` (printed at start, for clients to
trust), exactly as `agentenv serve` does (`proxy/tls.py`). The SDKs then reach the control API at
`https://api.<domain>` and envd at `https://49983-<id>.<domain>`; `get_host()` URLs and signed
`/files` URLs work from any client. The gateway's sandbox traffic then goes on to the owning node as
for any other request.

The TLS is Python's (the gateway is a Python process already); a renewed certificate (files changed,
every minute or on SIGHUP) is loaded into the listener's TLS context, so new connections get it and
open ones stay up. Several gateway replicas need the same certificate: the operator's, or one
`<data_dir>/tls` shared by all of them.
"""

from __future__ import annotations

import signal
import ssl

from aiohttp import web

from agentenv.config import Settings
from agentenv.proxy import tls as proxy_tls
from agentenv.proxy.dataplane import CertificateWatch


def split_bind(bind: str) -> tuple[str, int]:
    """"addr:port" (an IPv6 address in brackets) as (host, port)."""
    from agentenv.server import StartupError

    host, sep, port = bind.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise StartupError(f"https_bind must be addr:port (e.g. 0.0.0.0:443), got {bind!r}")
    return (host.strip("[]") or "0.0.0.0"), int(port)


def listener(settings: Settings):
    """The `listen` hook of `cluster._run.run_app` that opens the plain listener and the HTTPS one,
    and the local CA clients must trust (None: the operator's certificate); (None, None) without
    `https_bind`."""
    from agentenv.server import StartupError, on_signals

    if not settings.https_bind:
        return None, None
    if not settings.domain:
        raise StartupError("https_bind needs AGENTENV_DOMAIN (the certificate is for *.<domain>)")
    host, port = split_bind(settings.https_bind)
    try:
        files = proxy_tls.prepare(settings.data_dir / "tls", settings.domain, settings.tls_cert, settings.tls_key)
    except (OSError, ValueError) as e:
        raise StartupError(f"the HTTPS listener's certificate: {e}") from e
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["http/1.1"])
    ctx.load_cert_chain(files.pem)

    async def listen(runner: web.AppRunner):
        plain = web.TCPSite(runner, settings.host, settings.port, reuse_address=True)
        secure = web.TCPSite(runner, host, port, reuse_address=True, ssl_context=ctx)
        for site, where in ((plain, f"{settings.host}:{settings.port}"), (secure, settings.https_bind)):
            try:
                await site.start()
            except OSError as e:
                if site is secure:
                    await plain.stop()
                raise StartupError(f"cannot listen on {where}: {e.strerror or e}") from e

        async def install() -> None:
            ctx.load_cert_chain(files.pem)  # new handshakes get it; open connections keep theirs

        watch = CertificateWatch(settings, install, files.pem, served_by="the gateway's HTTPS listener")
        watch.start()
        on_signals((signal.SIGHUP,), watch.poke, ": reloading the TLS certificate")

        async def stop() -> None:
            await watch.stop()
            await secure.stop()

        return plain, stop

    return listen, files.ca


__all__ = ["listener", "split_bind"]
