"""`/metrics` for the cluster roles that run no sandboxes (gateway, scheduler).

Node agents serve the full single-node set (they are a single-node server plus an agent). The
gateway and the scheduler expose their process, which role they are, and the cluster's node registry
as they see it: nodes by state, and per node its capacity, active sandboxes, allocations, load and
heartbeat age. Node ids are labels here — bounded by the cluster's size, never by sandboxes.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from agentenv.observability.metrics import mount_metrics

NODE_STATES = ("active", "draining", "dead")


class NodeRegistryCollector(Collector):
    def __init__(self, role: str) -> None:
        self.role = role
        self.nodes: list[Any] = []
        self.refreshed = 0.0

    def describe(self) -> Iterator:
        return iter(())

    def collect(self) -> Iterator[GaugeMetricFamily]:
        info = GaugeMetricFamily("agentenv_role_info", "Which agentenv role this process is.", labels=["role"])
        info.add_metric([self.role], 1)
        yield info
        by_state = GaugeMetricFamily("agentenv_cluster_nodes", "Registered nodes by state.", labels=["state"])
        for st in NODE_STATES:
            by_state.add_metric([st], sum(1 for n in self.nodes if n.state == st))
        yield by_state
        fams = {
            "capacity": GaugeMetricFamily("agentenv_cluster_node_sandbox_capacity",
                                          "A node's admission limit (max_sandboxes).", labels=["node"]),
            "active": GaugeMetricFamily("agentenv_cluster_node_sandboxes_active",
                                        "Active sandboxes a node reported in its last heartbeat.", labels=["node"]),
            "cpu": GaugeMetricFamily("agentenv_cluster_node_allocated_cpus", "vCPUs allocated on a node.",
                                     labels=["node"]),
            "mem": GaugeMetricFamily("agentenv_cluster_node_allocated_memory_bytes", "Memory allocated on a node.",
                                     labels=["node"]),
            "load": GaugeMetricFamily("agentenv_cluster_node_load_per_cpu", "A node's load average per CPU.",
                                      labels=["node"]),
            "age": GaugeMetricFamily("agentenv_cluster_node_heartbeat_age_seconds",
                                     "Seconds since a node's last heartbeat.", labels=["node"]),
        }
        now = time.time()
        for n in self.nodes:
            if n.state == "dead":
                continue
            fams["capacity"].add_metric([n.node_id], n.max_sandboxes)
            fams["active"].add_metric([n.node_id], n.sandboxes)
            fams["cpu"].add_metric([n.node_id], n.alloc_cpu)
            fams["mem"].add_metric([n.node_id], n.alloc_memory_mb * 1024 * 1024)
            fams["load"].add_metric([n.node_id], n.load)
            fams["age"].add_metric([n.node_id], max(0.0, now - n.heartbeat_at.timestamp()))
        yield from fams.values()


def mount_role_metrics(app: web.Application, settings: Any, *, role: str,
                       list_nodes: Callable[[], Awaitable[list]] | None = None) -> CollectorRegistry:
    """Serve `/metrics` for a gateway or scheduler: process, role, and the node registry."""
    registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=registry)
    nodes = NodeRegistryCollector(role)
    registry.register(nodes)

    async def refresh() -> None:
        if list_nodes is not None and time.monotonic() - nodes.refreshed > 1.0:
            nodes.nodes = list(await list_nodes())
            nodes.refreshed = time.monotonic()

    mount_metrics(app, registry, bearer_token=getattr(settings, "metrics_bearer_token", None), before_scrape=refresh)
    return registry
