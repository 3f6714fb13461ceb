"""HTTPS with wildcard sandbox host names, resolved through real DNS, as in production.

A server of its own serves HTTPS on <addr>:443 (HAProxy, the data plane) with
AGENTENV_DOMAIN=<domain> and the local CA it creates on first start. dnsmasq on <addr>:53 answers
every name under <domain> with <addr>. Clients run in a mount namespace whose /etc/resolv.conf names
that dnsmasq (what `ip netns exec` does for a netns, without leaving the host's network), so the
Python and npm SDKs, curl and headless Chromium resolve `api.<domain>` and `<port>-<id>.<domain>`
through DNS and verify the certificate, with E2B_DOMAIN and no E2B_API_URL / E2B_SANDBOX_URL.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from e2b import Sandbox

from dns_resolver import Resolver
from serverproc import ExtraServer, new_data_dir, remove_data_dir, start_extra_server

pytestmark = pytest.mark.timeout(600)

HERE = Path(__file__).parent
TESTS = HERE.parent
APP_PORT = 8000
APP_SOURCE = (HERE / "sandbox_app.py").read_text()
CHROMIUM = os.environ.get("AGENTENV_TEST_CHROMIUM", "/usr/bin/chromium")


@pytest.fixture(scope="module")
def tls_env() -> Iterator[tuple[ExtraServer, Resolver, Path]]:
    for tool in ("haproxy", "dnsmasq", "unshare", "curl"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is not installed: run scripts/setup.sh --test")
    addr = f"127.{secrets.randbelow(180) + 60}.{secrets.randbelow(250) + 1}.1"
    domain = f"sbx{secrets.token_hex(3)}.test"
    data_dir = new_data_dir("https")
    resolver = Resolver(addr, domain, data_dir)
    srv = None
    try:
        resolver.wait_ready()
        srv = start_extra_server(data_dir, env={"AGENTENV_DOMAIN": domain, "AGENTENV_HTTPS_BIND": f"{addr}:443",
                                                "AGENTENV_DATA_PLANE": "haproxy"})
        ca = data_dir / "tls" / "ca.pem"
        assert ca.is_file(), srv.log_tail()
        # the banner follows the data plane's start, so /health can answer a moment before it is printed
        deadline = time.monotonic() + 30
        while f"E2B_DOMAIN={domain}" not in srv.log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert f"E2B_DOMAIN={domain}" in srv.log_path.read_text() and str(ca) in srv.log_path.read_text()
        yield srv, resolver, ca
    finally:
        try:
            if srv is not None:
                srv.stop()
        finally:
            resolver.stop()
            remove_data_dir(data_dir)


def client_env(srv: ExtraServer, resolver: Resolver, ca: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update(E2B_DOMAIN=resolver.domain, E2B_API_KEY=srv.api_key, SSL_CERT_FILE=str(ca),
               NODE_EXTRA_CA_CERTS=str(ca), **extra)
    return env


def curl(resolver: Resolver, ca: Path, *args: str) -> subprocess.CompletedProcess:
    return resolver.run(["curl", "-sS", "--cacert", str(ca), "--max-time", "60", *args], timeout=90)


def start_app(srv: ExtraServer, sbx: Sandbox, token: str | None = None) -> None:
    sbx.files.write("/home/user/app.py", APP_SOURCE)
    sbx.commands.run(f"setsid nohup python3 /home/user/app.py {APP_PORT} >/tmp/app.log 2>&1 </dev/null &")
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": str(APP_PORT)}
    if token:
        headers["E2B-Traffic-Access-Token"] = token
    deadline = time.monotonic() + 60
    while requests.get(f"{srv.url}/hello", headers=headers, timeout=30).status_code != 200:
        assert time.monotonic() < deadline, sbx.commands.run("cat /tmp/app.log").stdout
        time.sleep(0.2)


@pytest.fixture(scope="module")
def sdk_run(tls_env) -> Iterator[dict]:
    """The Python SDK's session by domain only; its sandbox then serves the app for the other tests."""
    srv, resolver, ca = tls_env
    r = resolver.run([sys.executable, str(HERE / "https_sdk_client.py")], env=client_env(srv, resolver, ca))
    assert r.returncode == 0, f"{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    out = json.loads(r.stdout.strip().splitlines()[-1])
    sbx = Sandbox.connect(out["id"], **srv.sdk_opts())
    srv.known_ids.add(out["id"])
    try:
        start_app(srv, sbx)
        out["sbx"] = sbx
        yield out
    finally:
        sbx.kill()


def test_python_sdk_with_e2b_domain_only(sdk_run) -> None:
    assert sdk_run["stdout"] == "hello-42\n"
    assert sdk_run["read"] == "data-over-tls"
    assert "new.txt" in sdk_run["watched"]
    assert "pty-42" in sdk_run["pty"]
    assert re.fullmatch(rf"{APP_PORT}-{sdk_run['id']}\.sbx[0-9a-f]+\.test", sdk_run["host"])
    assert sdk_run["download_url"].startswith(f"https://49983-{sdk_run['id']}.")


def test_js_sdk_with_e2b_domain_only(tls_env) -> None:
    srv, resolver, ca = tls_env
    node = shutil.which("node")
    assert node, "node is not installed: run scripts/setup.sh"
    r = resolver.run([node, str(TESTS / "js" / "https_domain.mjs")], env=client_env(srv, resolver, ca),
                     cwd=TESTS / "js")
    assert r.returncode == 0, f"{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    out = json.loads(r.stdout.strip().splitlines()[-1])
    srv.known_ids.add(out["id"])
    assert out["stdout"] == "js-42\n" and out["read"] == "js-over-tls"
    assert "new.txt" in out["watched"] and "pty-42" in out["pty"]


def test_get_host_with_curl_over_http2(tls_env, sdk_run) -> None:
    _, resolver, ca = tls_env
    r = curl(resolver, ca, "-w", "\n%{http_version}", f"https://{sdk_run['host']}/hello?via=curl")
    assert r.returncode == 0, r.stderr
    body, version = r.stdout.rsplit("\n", 1)
    assert version == "2" and json.loads(body)["path"] == "/hello?via=curl"
    headers = {k.lower(): v for k, v in json.loads(body)["headers"]}
    assert headers["x-forwarded-proto"] == "https" and headers["host"] == sdk_run["host"]


def test_get_host_in_a_browser(tls_env, sdk_run) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    srv, resolver, ca = tls_env
    node = shutil.which("node")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} not installed (apt-get install chromium; scripts/setup.sh --test does it)")
    leaf = x509.load_pem_x509_certificate((srv.data_dir / "tls" / "server.pem").read_bytes())
    spki = leaf.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    env = dict(os.environ, URL=f"https://{sdk_run['host']}/hello?via=browser", CHROMIUM=CHROMIUM,
               SPKI_HASH=base64.b64encode(hashlib.sha256(spki).digest()).decode())
    r = resolver.run([node, str(TESTS / "console" / "https_host_check.mjs")], env=env, cwd=TESTS / "console")
    assert r.returncode == 0, f"{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["status"] == 200 and json.loads(out["body"])["path"] == "/hello?via=browser"
    assert out["protocol"] == "h2"


def test_signed_urls_with_plain_curl(tls_env, sdk_run, tmp_path: Path) -> None:
    _, resolver, ca = tls_env
    r = curl(resolver, ca, "-f", sdk_run["download_url"])
    assert r.returncode == 0 and r.stdout == "data-over-tls", r.stderr
    payload = tmp_path / "up.txt"
    payload.write_text("uploaded-by-curl")
    r = curl(resolver, ca, "-f", "-F", f"file=@{payload}", sdk_run["upload_url"])
    assert r.returncode == 0, r.stderr + r.stdout
    assert sdk_run["sbx"].files.read("/home/user/uploaded.txt") == "uploaded-by-curl"
    # A URL with a forged signature is refused by envd.
    forged = re.sub(r"signature=[^&]+", "signature=v1_forged", sdk_run["download_url"])
    r = curl(resolver, ca, "-o", "/dev/null", "-w", "%{http_code}", forged)
    assert r.stdout in ("401", "403"), r.stdout


WS_SSE_CLIENT = r"""
import asyncio, json, sys, aiohttp
host = sys.argv[1]
async def main():
    async with aiohttp.ClientSession() as s:
        async with s.ws_connect(f"wss://{host}/ws") as ws:
            await ws.send_str("tls")
            echo = (await ws.receive(timeout=30)).data
        events = []
        async with s.get(f"https://{host}/sse?n=3&key=k1") as r:
            while len(events) < 3:
                line = await asyncio.wait_for(r.content.readline(), 30)
                if line.startswith(b"id: "):
                    events.append(int(line[4:]))
                    async with s.get(f"https://{host}/ack?key=k1&i={events[-1]}") as ack:
                        assert ack.status == 200
        print(json.dumps({"echo": echo, "events": events}))
asyncio.run(main())
"""


def test_websocket_and_sse_over_tls(tls_env, sdk_run) -> None:
    srv, resolver, ca = tls_env
    r = resolver.run([sys.executable, "-c", WS_SSE_CLIENT, sdk_run["host"]], env=client_env(srv, resolver, ca))
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"echo": "echo:tls", "events": [0, 1, 2]}


def test_paused_auto_resume_sandbox_woken_by_https_request_to_its_host(tls_env) -> None:
    srv, resolver, ca = tls_env
    sbx = Sandbox.create(timeout=300, lifecycle={"on_timeout": "pause", "auto_resume": True}, **srv.sdk_opts())
    srv.known_ids.add(sbx.sandbox_id)
    try:
        start_app(srv, sbx)
        sbx.pause()
        assert Sandbox.get_info(sbx.sandbox_id, **srv.sdk_opts()).state.value == "paused"
        r = curl(resolver, ca, "-f", f"https://{sbx.get_host(APP_PORT)}/hello")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["path"] == "/hello"
        assert f"woke sandbox {sbx.sandbox_id} on traffic" in srv.log_path.read_text()
    finally:
        sbx.kill()


def test_private_sandbox_refuses_a_request_without_its_token(tls_env) -> None:
    srv, resolver, ca = tls_env
    sbx = Sandbox.create(timeout=300, network={"allow_public_traffic": False}, **srv.sdk_opts())
    srv.known_ids.add(sbx.sandbox_id)
    try:
        token = sbx.traffic_access_token
        assert token
        start_app(srv, sbx, token)
        url = f"https://{sbx.get_host(APP_PORT)}/hello"
        r = curl(resolver, ca, "-w", "\n%{http_code}", url)
        body, code = r.stdout.rsplit("\n", 1)
        assert code == "403" and "missing e2b-traffic-access-token" in json.loads(body)["message"].lower()
        r = curl(resolver, ca, "-w", "\n%{http_code}", "-H", "e2b-traffic-access-token: wrong", url)
        assert r.stdout.rsplit("\n", 1)[1] == "403"
        r = curl(resolver, ca, "-f", "-H", f"e2b-traffic-access-token: {token}", url)
        assert r.returncode == 0 and json.loads(r.stdout)["path"] == "/hello", r.stderr
        headers = {k.lower() for k, _ in json.loads(r.stdout)["headers"]}
        assert "e2b-traffic-access-token" not in headers
    finally:
        sbx.kill()


def served_certificate(srv: ExtraServer, resolver: Resolver, ca: Path) -> str:
    """sha256 of the certificate a fresh handshake with api.<domain> gets (verified against `ca`)."""
    import socket
    import ssl

    addr = srv.env["AGENTENV_HTTPS_BIND"].rsplit(":", 1)[0]
    ctx = ssl.create_default_context(cafile=str(ca))
    with socket.create_connection((addr, 443), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname=f"api.{resolver.domain}") as tls:
            return hashlib.sha256(tls.getpeercert(binary_form=True)).hexdigest()


def file_certificate(path: Path) -> str:
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import Encoding

    return hashlib.sha256(x509.load_pem_x509_certificate(path.read_bytes()).public_bytes(Encoding.DER)).hexdigest()


def test_a_renewed_certificate_is_served_without_a_restart(tls_env) -> None:
    """SIGHUP (or the minute's check) hands HAProxy a certificate that changed on disk, here the
    local CA's leaf made anew; HAProxy is not restarted and HTTPS keeps working."""
    from test_data_plane import haproxy_pids

    srv, resolver, ca = tls_env
    leaf = srv.data_dir / "tls" / "server.pem"
    before = served_certificate(srv, resolver, ca)
    assert before == file_certificate(leaf)
    haproxy_before = haproxy_pids(srv.data_dir)
    leaf.unlink()  # as if it neared expiry: the next check signs a new one
    os.kill(srv.pid, signal.SIGHUP)
    deadline = time.monotonic() + 20
    while (now := served_certificate(srv, resolver, ca)) == before:
        assert time.monotonic() < deadline, srv.log_tail()
        time.sleep(0.2)
    assert now == file_certificate(leaf)
    assert haproxy_pids(srv.data_dir) == haproxy_before, "haproxy was restarted"
    assert srv.alive()
    r = curl(resolver, ca, "-o", "/dev/null", "-w", "%{http_code}", f"https://api.{resolver.domain}/health")
    assert r.stdout == "200", r.stderr
    assert "TLS certificate reloaded" in srv.log_path.read_text()


def test_template_upload_link_over_https_is_https(tls_env) -> None:
    """The upload link of a template's COPY files, asked for over HTTPS (TLS ends in HAProxy, the
    server behind it is reached over a unix socket), is an https:// link to the same host."""
    srv, resolver, ca = tls_env
    api = f"https://api.{resolver.domain}"
    auth = ("-H", f"X-API-KEY: {srv.api_key}", "-H", "Content-Type: application/json")
    r = curl(resolver, ca, "-f", *auth, "-d", json.dumps({"name": f"scheme-{secrets.token_hex(4)}"}),
             f"{api}/v3/templates")
    assert r.returncode == 0, r.stderr + r.stdout
    template_id = json.loads(r.stdout)["templateID"]
    try:
        r = curl(resolver, ca, "-f", *auth, f"{api}/templates/{template_id}/files/{'ab' * 32}")
        assert r.returncode == 0, r.stderr + r.stdout
        url = json.loads(r.stdout)["url"]
        assert url.startswith(f"{api}/template-files/{'ab' * 32}?"), url
    finally:
        curl(resolver, ca, *auth, "-X", "DELETE", f"{api}/templates/{template_id}")
