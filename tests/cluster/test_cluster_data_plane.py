"""A cluster node's listener is HAProxy (the data plane of `agentenv serve`, docs/proxy.md) in the
cluster's mutual TLS: sandbox traffic from the gateway, or from an admin certificate, goes from
HAProxy straight into the sandbox (its statistics count it), while the same request without a
client certificate, or with a node's, never reaches the sandbox (401 / 403 from the node's server
behind HAProxy, which learns the verified caller from HAProxy alone)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
from pathlib import Path

import pytest
import requests
from e2b import Sandbox
from leftovers import haproxy_master, parent_of
from serverproc import agentenv_executable, free_port
from test_cluster_multinode import bindings

from agentenv.constants import ENVD_PORT
from agentenv.proxy.haproxy import RuntimeApi, backend_stats, sock_dir_for

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]


def envd_answers(node) -> int:
    """2xx answers HAProxy's envd backend of `node` gave (its runtime API, `show stat`)."""
    stats = asyncio.run(backend_stats(RuntimeApi(sock_dir_for(node.data_dir) / "admin.sock")))
    assert "sandbox_envd" in stats, f"no sandbox_envd backend in haproxy's statistics: {stats}"
    return stats["sandbox_envd"]["hrsp_2xx"]


def test_node_listener_is_haproxy_with_mutual_tls(cluster, tmp_path):
    if shutil.which("haproxy") is None:
        pytest.skip("haproxy is not installed (apt-get install haproxy): nodes use the Python proxy")
    sbx = Sandbox.create(**cluster.sdk_opts())
    try:
        node = cluster.nodes[bindings(cluster)[sbx.sandbox_id][0]]
        assert "data plane: haproxy" in node.log_tail(400)
        before = envd_answers(node)
        for _ in range(5):  # the admin certificate, on the node's own listener
            assert node.sandbox_status(sbx.sandbox_id) // 100 == 2
        assert sbx.commands.run("echo through-the-gateway").stdout == "through-the-gateway\n"
        served = envd_answers(node) - before
        assert served >= 6, f"HAProxy answered {served} of the 5 + the command's requests"

        # Callers that may not reach sandboxes on a node: refused by the server behind HAProxy
        url = f"{node.url}/health"
        hdrs = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": str(ENVD_PORT)}
        ca = str(cluster.pki.ca)
        r = requests.get(url, headers=hdrs, verify=ca, timeout=10)
        assert r.status_code == 401 and "client certificate" in r.json()["message"], r.text
        forged = {**hdrs, "X-Agentenv-Cluster-Peer": "admin/admin"}  # not a credential: HAProxy drops it
        assert requests.get(url, headers=forged, verify=ca, timeout=10).status_code == 401
        node_cert = tuple(map(str, cluster.pki.issue("node", "b", out=tmp_path)))
        r = requests.get(url, headers=hdrs, cert=node_cert, verify=ca, timeout=10)
        assert r.status_code == 403, r.text
        assert envd_answers(node) - before == served, "a refused caller reached the sandbox"
        # and the node's own routes still work for a permitted caller afterwards
        assert node.sandbox_status(sbx.sandbox_id) // 100 == 2
    finally:
        sbx.kill()


def served_certificate(node) -> bytes:
    """The certificate a node's listener presents (DER)."""
    ctx = ssl.create_default_context(cafile=str(node.pki.ca))
    with socket.create_connection((node.address, int(node.url.rsplit(":", 1)[1])), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname=node.address) as s:
            return s.getpeercert(binary_form=True)


def test_a_renewed_node_certificate_is_served_without_a_restart(cluster):
    """Node certificates are short-lived: a renewal (new files) reaches HAProxy's listener within a
    reload round (`cluster_cert_reload_s`: 5 s here), with no restart, and the renewed node keeps serving the gateway."""
    if shutil.which("haproxy") is None:
        pytest.skip("haproxy is not installed (apt-get install haproxy): nodes use the Python proxy")
    node = cluster.nodes["a"]
    before = served_certificate(node)
    pid = node.proc.pid
    cluster.pki.issue("node", "a", (node.address,))  # the files node a reads
    deadline = time.monotonic() + 75
    while served_certificate(node) == before:
        assert time.monotonic() < deadline, f"node a still serves its old certificate:\n{node.log_tail(40)}"
        time.sleep(2)
    assert node.proc.pid == pid and node.proc.poll() is None
    assert "cluster certificate reloaded into haproxy" in node.log_tail(400)
    r = cluster.pki.request("GET", f"{node.url}/internal/status", timeout=10)
    assert r.status_code == 200 and r.json()["node_id"] == "a"


# ---------------------------------------------------------------------- the gateway's data plane

APP_PORT = 8000
TESTS = Path(__file__).parent.parent


def hop_answers(data_dir: Path, gateway) -> int:
    """2xx answers the node_hop backend of a gateway's HAProxy gave (its runtime API)."""
    base = data_dir / "gateway-haproxy" / gateway.url.rsplit(":", 1)[1]
    stats = asyncio.run(backend_stats(RuntimeApi(sock_dir_for(base) / "admin.sock"), ("node_hop",)))
    assert "node_hop" in stats, f"no node_hop backend in haproxy's statistics: {stats}"
    return stats["node_hop"]["hrsp_2xx"]


def gateway_routes(data_dir: Path, gateway) -> dict[str, str]:
    """The routes map (sandbox id -> node id) a gateway's HAProxy has now."""
    base = data_dir / "gateway-haproxy" / gateway.url.rsplit(":", 1)[1]
    out = asyncio.run(RuntimeApi(sock_dir_for(base) / "admin.sock").run([f"show map {base / 'routes.map'}"]))
    return {line.split()[1]: line.split()[2] for line in "\n".join(out).splitlines() if len(line.split()) == 3}


def test_gateway_hop_is_haproxy_and_private_sandboxes_keep_their_token(cluster, tmp_path):
    """A gateway's sandbox traffic goes from its HAProxy straight to the sandbox's node (mutual TLS,
    the node verified by its id); a private sandbox's token is checked on the node for traffic
    through either kind of gateway (HAProxy's hop, or the Python hop that now passes the token on);
    a killed sandbox's route is gone at once; a renewed gateway certificate reaches the hop."""
    if shutil.which("haproxy") is None:
        pytest.skip("haproxy is not installed (apt-get install haproxy): gateways use the Python proxy")
    hp_dir, py_dir = tmp_path / "gw-haproxy", tmp_path / "gw-python"
    gw = cluster.start_gateway({"AGENTENV_DATA_DIR": str(hp_dir)})
    py_gw = cluster.start_gateway({"AGENTENV_DATA_DIR": str(py_dir), "AGENTENV_DATA_PLANE": "python"})
    sbx = None
    try:
        assert "data plane: haproxy" in gw.log_path.read_text()
        assert "data plane: the gateway's Python proxy" in py_gw.log_path.read_text()
        sbx = Sandbox.create(timeout=300, network={"allow_public_traffic": False}, **cluster.sdk_opts())
        token = sbx.traffic_access_token
        assert token
        sbx.files.write("/home/user/app.py", (TESTS / "proxy" / "sandbox_app.py").read_text())
        sbx.commands.run(f"setsid nohup python3 /home/user/app.py {APP_PORT} >/tmp/app.log 2>&1 </dev/null &")
        route = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": str(APP_PORT)}
        deadline = time.monotonic() + 60
        while requests.get(f"{gw.url}/hello", headers={**route, "E2b-Traffic-Access-Token": token},
                           timeout=30).status_code != 200:
            assert time.monotonic() < deadline, sbx.commands.run("cat /tmp/app.log").stdout
            time.sleep(0.2)
        deadline = time.monotonic() + 3  # on the gateway's fast path: its node's event, or the hop's lookup
        while gateway_routes(hp_dir, gw).get(sbx.sandbox_id) is None:
            assert time.monotonic() < deadline, gateway_routes(hp_dir, gw)
            time.sleep(0.1)

        before = hop_answers(hp_dir, gw)
        for g in (gw, py_gw):
            r = requests.get(f"{g.url}/hello", headers=route, timeout=30)
            assert r.status_code == 403 and "Missing" in r.json()["message"], (g.url, r.status_code, r.text)
            r = requests.get(f"{g.url}/hello", headers={**route, "E2b-Traffic-Access-Token": "wrong"}, timeout=30)
            assert r.status_code == 403 and "Invalid" in r.json()["message"], (g.url, r.status_code, r.text)
            for i in range(5):
                r = requests.get(f"{g.url}/hello?n={i}", headers={**route, "E2b-Traffic-Access-Token": token},
                                 timeout=30)
                assert r.status_code == 200 and r.json()["path"] == f"/hello?n={i}", (g.url, r.status_code, r.text)
        # the HAProxy gateway's five went over its hop; the Python gateway has no HAProxy
        assert hop_answers(hp_dir, gw) - before >= 5
        sdk = Sandbox.connect(sbx.sandbox_id, api_key=cluster.api_key, api_url=gw.url, sandbox_url=gw.url)
        assert sdk.commands.run("echo via-haproxy-hop").stdout == "via-haproxy-hop\n"

        # a sandbox killed through the gateway leaves its routes before its node hears of it
        Sandbox.kill(sbx.sandbox_id, api_key=cluster.api_key, api_url=gw.url)
        killed, sbx = sbx.sandbox_id, None
        r = requests.get(f"{gw.url}/hello", headers={**route, "E2b-Traffic-Access-Token": token}, timeout=30)
        assert r.status_code == 502 and r.json()["sandboxId"] == killed, r.text
        assert killed not in gateway_routes(hp_dir, gw)

        # a renewed gateway certificate reaches HAProxy's hop without a restart (reload round: 5 s here)
        cluster.pki.issue("gateway", "gateway")
        deadline = time.monotonic() + 75
        while "cluster certificate reloaded into haproxy" not in gw.log_path.read_text():
            assert time.monotonic() < deadline, gw.log_path.read_text()[-3000:]
            time.sleep(1)
        other = Sandbox.create(timeout=120, **cluster.sdk_opts())  # through the other gateway
        try:
            # its node's `created` event puts it on this gateway's fast path at once (the store is
            # only read every 10 s), before any request for it reached this gateway
            owner = bindings(cluster)[other.sandbox_id][0]
            deadline = time.monotonic() + 3
            while gateway_routes(hp_dir, gw).get(other.sandbox_id) != owner:
                assert time.monotonic() < deadline, gateway_routes(hp_dir, gw)
                time.sleep(0.1)
            box = Sandbox.connect(other.sandbox_id, api_key=cluster.api_key, api_url=gw.url, sandbox_url=gw.url)
            before = hop_answers(hp_dir, gw)
            assert box.commands.run("echo renewed").stdout == "renewed\n"
            assert hop_answers(hp_dir, gw) > before
        finally:
            other.kill()
        assert gw.proc.poll() is None
    finally:
        if sbx is not None:
            sbx.kill()
        gw.stop()
        py_gw.stop()
    assert not (hp_dir / "gateway-haproxy").exists() or not any((hp_dir / "gateway-haproxy").iterdir())


def test_gateway_with_haproxy_as_its_own_component(cluster, tmp_path):
    """The deployment files' gateway: `haproxy_external` with `agentenv data-plane --role gateway`
    beside it. The hop to the nodes (mutual TLS, the cluster CA) runs in the component's HAProxy;
    a HAProxy killed -9 is started again and gets its routes back; the gateway stopping leaves it."""
    if shutil.which("haproxy") is None:
        pytest.skip("haproxy is not installed")
    data, port = tmp_path / "gw-external", free_port()
    data.mkdir()
    comp_log = tmp_path / "gw-data-plane.log"
    comp = subprocess.Popen([agentenv_executable(), "data-plane", "--role", "gateway", "--port", str(port),
                             "--data-dir", str(data)], stdout=open(comp_log, "ab"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    gw = sbx = None
    try:
        gw = cluster.start_gateway({"AGENTENV_DATA_DIR": str(data), "AGENTENV_HAPROXY_EXTERNAL": "true"}, port=port)
        config = data / "gateway-haproxy" / str(port) / "haproxy.cfg"
        master = haproxy_master(config)
        assert master is not None and parent_of(master) == comp.pid, comp_log.read_text()[-2000:]
        opts = dict(api_key=cluster.api_key, api_url=gw.url, sandbox_url=gw.url)
        sbx = Sandbox.create(timeout=300, **opts)
        deadline = time.monotonic() + 5
        while gateway_routes(data, gw).get(sbx.sandbox_id) is None:
            assert time.monotonic() < deadline, gateway_routes(data, gw)
            time.sleep(0.1)
        before = hop_answers(data, gw)
        assert sbx.commands.run("echo hop").stdout == "hop\n"
        assert hop_answers(data, gw) > before, "the command did not go through the component's HAProxy hop"

        os.kill(master, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while "is a new instance" not in gw.log_path.read_text() or \
                gateway_routes(data, gw).get(sbx.sandbox_id) is None:
            assert time.monotonic() < deadline, (gw.log_path.read_text()[-2000:], comp_log.read_text()[-2000:])
            time.sleep(0.2)
        assert sbx.commands.run("echo again").stdout == "again\n"
        assert hop_answers(data, gw) > 0

        gw.stop()
        gw = None
        assert comp.poll() is None and haproxy_master(config) is not None, "the data plane stopped with the gateway"
    finally:
        if sbx is not None:
            Sandbox.kill(sbx.sandbox_id, **cluster.sdk_opts())
        if gw is not None:
            gw.stop()
        comp.send_signal(signal.SIGTERM)
        comp.wait(30)
    assert "haproxy stopped" in comp_log.read_text()
    assert haproxy_master(config) is None
    assert not sock_dir_for(config.parent).exists(), "the shared socket dir outlived the gateway and its HAProxy"



def test_a_killed_gateways_haproxy_is_collected_and_a_running_ones_is_not(cluster, tmp_path):
    """A gateway killed -9 leaves its HAProxy running (as a killed server does: traffic goes on, the
    next gateway on the port takes it over). `agentenv gc --gateway` on its data dir stops that
    HAProxy and removes its files, and leaves a running gateway's alone (each holds its port's lock);
    a second gateway on a running one's port and data dir refuses to start."""
    if shutil.which("haproxy") is None:
        pytest.skip("haproxy is not installed")
    data = tmp_path / "gw-killed"
    env = {**os.environ, **cluster.extra["gateway_env"], "AGENTENV_DATA_DIR": str(data)}

    def gc() -> str:
        r = subprocess.run([agentenv_executable(), "gc", "--gateway", "--data-dir", str(data)], env=env,
                           capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout

    def port(gw) -> str:
        return gw.url.rsplit(":", 1)[1]

    def master(gw) -> int | None:
        return haproxy_master(data / "gateway-haproxy" / port(gw) / "haproxy.cfg")

    running = cluster.start_gateway({"AGENTENV_DATA_DIR": str(data)})
    killed = cluster.start_gateway({"AGENTENV_DATA_DIR": str(data)})
    try:
        running_pid, killed_pid = master(running), master(killed)
        assert running_pid is not None and killed_pid is not None
        second = subprocess.run([agentenv_executable(), "gateway", "--host", "127.0.0.1", "--port", port(running)],
                                env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        assert second.returncode != 0 and "another gateway runs on port" in second.stdout + second.stderr, \
            (second.returncode, (second.stdout + second.stderr)[-2000:])
        assert "gateway haproxy: removed 0" in gc()

        killed.proc.kill()
        killed.proc.wait(10)
        assert master(killed) == killed_pid
        assert requests.get(f"{killed.url}/health", timeout=10).status_code >= 500  # HAProxy, no gateway
        out = gc()
        assert f"port {port(killed)}: pid {killed_pid}" in out, out
        assert master(killed) is None
        assert not (data / "gateway-haproxy" / port(killed)).exists()
        assert not (data / "gateway-haproxy" / f"{port(killed)}.lock").exists()
        assert not sock_dir_for(data / "gateway-haproxy" / port(killed)).exists()
        # the running gateway kept its HAProxy and still serves
        assert master(running) == running_pid
        assert requests.get(f"{running.url}/health", timeout=10).ok
    finally:
        running.stop()
        killed.stop()
    assert list((data / "gateway-haproxy").iterdir()) == [], "a stopped gateway left files"
