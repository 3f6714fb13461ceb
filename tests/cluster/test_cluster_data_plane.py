"""A cluster node's listener is HAProxy (the data plane of `agentenv serve`, docs/proxy.md) in the
cluster's mutual TLS: sandbox traffic from the gateway, or from an admin certificate, goes from
HAProxy straight into the sandbox (its statistics count it), while the same request without a
client certificate, or with a node's, never reaches the sandbox (401 / 403 from the node's server
behind HAProxy, which learns the verified caller from HAProxy alone)."""

from __future__ import annotations

import asyncio
import shutil
import socket
import ssl
import time

import pytest
import requests
from e2b import Sandbox
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
    reload round (30 s), with no restart, and the renewed node keeps serving the gateway."""
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
