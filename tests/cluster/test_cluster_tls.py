"""Internal traffic over mutual TLS: the cluster's nodes and scheduler refuse calls without a
client certificate of the cluster CA (the old shared-token header is no substitute), fail the
handshake for a certificate of another CA, refuse plain HTTP, and let each certificate do what its
role may only (a node heartbeats and drains for itself alone). The rest of the cluster tests run
over the same mutual TLS (gateway -> scheduler -> nodes, sandbox traffic included)."""

from __future__ import annotations

import pytest
import requests

from agentenv.cluster import tls

pytestmark = [pytest.mark.cluster]


def test_internal_calls_need_a_cluster_certificate(cluster, tmp_path):
    node, sched, ca = cluster.nodes["a"].url, cluster.scheduler.url, str(cluster.pki.ca)
    # the admin certificate may; /health is open (supervisors' probes)
    assert cluster.pki.request("GET", f"{node}/internal/status", timeout=10).json()["node_id"] == "a"
    assert requests.get(f"{node}/health", verify=ca, timeout=10).status_code == 200

    # no client certificate: refused, whatever else the request carries
    for url in (f"{node}/internal/status", f"{node}/metrics", f"{sched}/internal/nodes"):
        r = requests.get(url, verify=ca, timeout=10, headers={"X-Agentenv-Cluster-Token": "anything"})
        assert r.status_code == 401 and "client certificate" in r.json()["message"], (url, r.status_code, r.text)
    r = requests.post(f"{node}/internal/rpc/list_sandboxes", json={"team_id": "t"}, verify=ca, timeout=10)
    assert r.status_code == 401

    # a certificate of another CA: the handshake fails
    rogue_ca = tmp_path / "rogue"
    tls.create_ca(rogue_ca)
    rogue = tuple(map(str, tls.issue_cert(rogue_ca, "admin", "admin", tmp_path)))
    for url in (f"{node}/internal/status", f"{sched}/internal/nodes"):
        with pytest.raises(requests.exceptions.ConnectionError):  # SSLError is one
            requests.get(url, cert=rogue, verify=ca, timeout=10)

    # plain HTTP: nothing
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.get(node.replace("https:", "http:") + "/internal/status", timeout=10)

    # roles: a node's certificate cannot place, nor heartbeat or drain for another node
    node_a = tuple(map(str, cluster.pki.issue("node", "a", out=tmp_path)))  # not node a's own files
    r = requests.post(f"{sched}/internal/place", json={"kind": "create"}, cert=node_a, verify=ca, timeout=10)
    assert r.status_code == 403, r.text
    status_b = cluster.pki.request("GET", f"{cluster.nodes['b'].url}/internal/status", timeout=10).json()
    r = requests.post(f"{sched}/internal/heartbeat", json=status_b, cert=node_a, verify=ca, timeout=10)
    assert r.status_code == 403, r.text
    r = requests.post(f"{cluster.nodes['b'].url}/internal/drain", json={"draining": True}, cert=node_a, verify=ca,
                      timeout=10)
    assert r.status_code == 403, r.text
    assert cluster.node_status()["b"]["state"] == "active"
