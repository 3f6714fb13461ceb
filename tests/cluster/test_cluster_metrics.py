"""Every cluster role serves /metrics: gateway and scheduler their view of the node registry, each
node the full single-node set (parsed with prometheus_client's parser)."""

from __future__ import annotations

import requests
from prometheus_client.parser import text_string_to_metric_families


def scrape(cluster, url: str) -> dict[str, list]:
    # nodes and the scheduler answer over mutual TLS (Prometheus scrapes them with a certificate)
    r = cluster.pki.request("GET", f"{url}/metrics", timeout=30) if url.startswith("https:") else \
        requests.get(f"{url}/metrics", timeout=30)
    assert r.status_code == 200, r.text
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def value(samples: dict, name: str, **labels) -> float:
    return sum(s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items()))


def test_every_role_serves_metrics(cluster):
    n_nodes = len(cluster.nodes)
    for role, proc in (("gateway", cluster.gateway), ("scheduler", cluster.scheduler)):
        s = scrape(cluster, proc.url)
        assert value(s, "agentenv_role_info", role=role) == 1
        assert value(s, "agentenv_cluster_nodes", state="active") >= 1
        assert value(s, "agentenv_cluster_nodes") >= n_nodes - 1  # a test may have killed one
        caps = {x.labels["node"]: x.value for x in s["agentenv_cluster_node_sandbox_capacity"]}
        assert caps and all(v > 0 for v in caps.values())
        assert "process_cpu_seconds_total" in s
    for name, node in cluster.nodes.items():
        if getattr(node, "killed", False):
            continue
        s = scrape(cluster, node.url)
        assert value(s, "agentenv_node_sandbox_capacity") > 0, name
        assert "agentenv_sandbox_operation_duration_seconds_count" in s
