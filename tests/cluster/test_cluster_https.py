"""HTTPS at a cluster gateway: `E2B_DOMAIN` against the cluster, names resolved through real DNS.

A gateway replica serves HTTPS on <addr>:443 with AGENTENV_DOMAIN=<domain> and the local CA it
creates on first start (its HAProxy, `cluster/gateway_dataplane.py`, with HTTP/2); dnsmasq on <addr>:53 answers every name under
<domain> with <addr> (tests/dns_resolver.py). The Python SDK, with E2B_DOMAIN and no E2B_API_URL /
E2B_SANDBOX_URL, creates a sandbox through it (placed on a node by the scheduler) and runs
commands, files, a watch and a PTY over TLS, and so does the npm SDK; `get_host()` and the signed
download/upload URLs work with plain curl; a paused auto-resume sandbox is woken by an HTTPS request
to its host; a renewed certificate is served after SIGHUP without a restart.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import sys
import time
from pathlib import Path

import pytest
import requests
from e2b import Sandbox

from dns_resolver import Resolver
from serverproc import new_data_dir, remove_data_dir
from test_cluster_multinode import bindings

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

TESTS = Path(__file__).parent.parent
APP_PORT = 8000


def served_certificate(addr: str, domain: str) -> bytes:
    """The DER certificate the listener presents for api.<domain>."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    with socket.create_connection((addr, 443), timeout=10) as raw, \
            ctx.wrap_socket(raw, server_hostname=f"api.{domain}") as tls:
        return tls.getpeercert(binary_form=True)


def test_gateway_serves_e2b_domain_over_https(cluster, tmp_path: Path) -> None:
    for tool in ("dnsmasq", "unshare", "curl"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is not installed: run scripts/setup.sh --test")
    addr = f"127.{secrets.randbelow(180) + 60}.{secrets.randbelow(250) + 1}.1"
    domain = f"gw{secrets.token_hex(3)}.test"
    data_dir = new_data_dir("gateway-https")
    resolver = Resolver(addr, domain, data_dir)
    gateway = None
    created: list[str] = []
    try:
        resolver.wait_ready()
        gateway = cluster.start_gateway({"AGENTENV_DOMAIN": domain, "AGENTENV_HTTPS_BIND": f"{addr}:443",
                                         "AGENTENV_DATA_DIR": str(data_dir)})
        ca = data_dir / "tls" / "ca.pem"
        deadline = time.monotonic() + 30
        while f"E2B_DOMAIN={domain}" not in gateway.log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        banner = gateway.log_path.read_text()
        assert f"E2B_DOMAIN={domain}" in banner and str(ca) in banner, banner[-3000:]

        # ---- the Python SDK by domain only
        env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
        env.update(E2B_DOMAIN=domain, E2B_API_KEY=cluster.api_key, SSL_CERT_FILE=str(ca))
        r = resolver.run([sys.executable, str(TESTS / "proxy" / "https_sdk_client.py")], env=env)
        assert r.returncode == 0, f"{r.stdout[-2000:]}\n{r.stderr[-4000:]}\n{gateway.log_path.read_text()[-3000:]}"
        out = json.loads(r.stdout.strip().splitlines()[-1])
        sandbox_id = out["id"]
        created.append(sandbox_id)
        assert out["stdout"] == "hello-42\n" and out["read"] == "data-over-tls"
        assert "new.txt" in out["watched"] and "pty-42" in out["pty"]
        assert out["host"] == f"{APP_PORT}-{sandbox_id}.{domain}"
        assert bindings(cluster)[sandbox_id][0] in cluster.nodes  # placed on a node, served through the gateway

        # ---- the npm SDK by domain only
        node = shutil.which("node")
        assert node, "node is not installed: run scripts/setup.sh"
        r = resolver.run([node, str(TESTS / "js" / "https_domain.mjs")], env={**env, "NODE_EXTRA_CA_CERTS": str(ca)},
                         cwd=TESTS / "js")
        assert r.returncode == 0, f"{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
        js = json.loads(r.stdout.strip().splitlines()[-1])
        created.append(js["id"])
        assert js["stdout"] == "js-42\n" and js["read"] == "js-over-tls"
        assert "new.txt" in js["watched"] and "pty-42" in js["pty"]

        # ---- get_host(): a user's app in the sandbox, reached by name with curl
        def start_app(box: Sandbox) -> None:
            box.files.write("/home/user/app.py", (TESTS / "proxy" / "sandbox_app.py").read_text())
            box.commands.run(f"setsid nohup python3 /home/user/app.py {APP_PORT} >/tmp/app.log 2>&1 </dev/null &")
            route = {"E2b-Sandbox-Id": box.sandbox_id, "E2b-Sandbox-Port": str(APP_PORT)}
            deadline = time.monotonic() + 60
            while requests.get(f"{cluster.gateway.url}/hello", headers=route, timeout=30).status_code != 200:
                assert time.monotonic() < deadline, box.commands.run("cat /tmp/app.log").stdout
                time.sleep(0.2)

        def curl(*args: str):
            return resolver.run(["curl", "-sS", "--cacert", str(ca), "--max-time", "60", *args], timeout=90)

        sbx = Sandbox.connect(sandbox_id, **cluster.sdk_opts())
        start_app(sbx)
        r = curl("-f", f"https://{out['host']}/hello?via=curl")
        assert r.returncode == 0, r.stderr
        hello = json.loads(r.stdout)
        headers = {k.lower(): v for k, v in hello["headers"]}
        assert hello["path"] == "/hello?via=curl"
        assert headers["x-forwarded-proto"] == "https" and headers["host"] == out["host"]
        # HTTP/2 where the client offers it (ALPN), on the gateway's HAProxy
        r = curl("-o", "/dev/null", "-w", "%{http_version}", "--http2", f"https://{out['host']}/hello?via=h2")
        assert r.returncode == 0 and r.stdout == "2", (r.stdout, r.stderr)

        # ---- signed URLs with plain curl; a forged signature is refused
        r = curl("-f", out["download_url"])
        assert r.returncode == 0 and r.stdout == "data-over-tls", r.stderr
        payload = tmp_path / "up.txt"
        payload.write_text("uploaded-through-the-gateway")
        r = curl("-f", "-F", f"file=@{payload}", out["upload_url"])
        assert r.returncode == 0, r.stderr + r.stdout
        assert sbx.files.read("/home/user/uploaded.txt") == "uploaded-through-the-gateway"
        forged = out["download_url"].replace("signature=", "signature=v1_forged", 1)
        r = curl("-o", "/dev/null", "-w", "%{http_code}", forged)
        assert r.stdout in ("401", "403"), r.stdout

        # ---- a paused auto-resume sandbox, woken by an HTTPS request to its host (its node wakes it)
        auto = Sandbox.create(timeout=300, lifecycle={"on_timeout": "pause", "auto_resume": True},
                              **cluster.sdk_opts())
        created.append(auto.sandbox_id)
        start_app(auto)
        auto.pause()
        assert bindings(cluster)[auto.sandbox_id][1] == "paused"
        r = curl("-f", f"https://{APP_PORT}-{auto.sandbox_id}.{domain}/hello?woken=1")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["path"] == "/hello?woken=1"
        owner, state = bindings(cluster)[auto.sandbox_id]
        assert state == "running"
        assert f"woke sandbox {auto.sandbox_id} on traffic" in cluster.nodes[owner].log_tail(400)

        # ---- a renewed certificate is served after SIGHUP, without a restart
        before = served_certificate(addr, domain)
        (data_dir / "tls" / "server.pem").unlink()  # the next check issues a new leaf from the same CA
        gateway.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while served_certificate(addr, domain) == before:
            assert time.monotonic() < deadline, gateway.log_path.read_text()[-3000:]
            time.sleep(0.3)
        assert gateway.proc.poll() is None
        r = curl("-f", f"https://{out['host']}/hello?after=renewal")
        assert r.returncode == 0 and json.loads(r.stdout)["path"] == "/hello?after=renewal", r.stderr
    finally:
        try:
            for sid in created:
                try:
                    Sandbox.kill(sid, **cluster.sdk_opts())
                except Exception:  # noqa: BLE001 - best effort; the fixture's gc removes the rest
                    pass
            if gateway is not None:
                gateway.stop()
        finally:
            resolver.stop()
            remove_data_dir(data_dir)
