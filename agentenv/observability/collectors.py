"""Scrape-time collectors: gauges computed from the live view of the node.

They read the orchestrator's in-memory records (no I/O, no awaits) plus numbers the resource
sampler refreshed in the background (cgroup totals, snapshot store size), so a scrape costs a
walk over the sandboxes of one node and nothing else.
"""

from __future__ import annotations

import os
import shutil
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from agentenv.observability.metrics import cap_labels

if TYPE_CHECKING:
    from agentenv.observability.sampler import ResourceSampler


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    out[key] = int(parts[0]) * (1024 if len(parts) > 1 else 1)
    except OSError:
        pass
    return out


class NodeCollector(Collector):
    """Sandboxes by state/runtime/template, capacity and use of this node, warm pool, snapshots."""

    def __init__(self, orchestrator, settings, sampler: "ResourceSampler | None" = None) -> None:
        self.orch = orchestrator
        self.settings = settings
        self.sampler = sampler

    def describe(self) -> Iterator:  # no describe at registration: collect() touches live state
        return iter(())

    def collect(self) -> Iterator[GaugeMetricFamily]:
        records = self.orch.records()
        by = Counter((r.state.value, r.runtime, r.template_id) for r in records if r.team_id)
        g = GaugeMetricFamily("agentenv_sandboxes", "Sandboxes on this node by lifecycle state, runtime and "
                              "template (or snapshot) they came from.", labels=["state", "runtime", "template"])
        for (state, runtime, tmpl), n in sorted(cap_labels(dict(by), 2).items()):
            g.add_metric([state, runtime, tmpl], n)
        yield g

        active = [r for r in records if r.team_id and r.state.value not in ("paused", "killed", "failed")]
        yield GaugeMetricFamily("agentenv_node_sandbox_capacity",
                                "Admission limit: sandboxes that may hold CPU and memory at once (max_sandboxes).",
                                value=self.settings.max_sandboxes)
        yield GaugeMetricFamily("agentenv_node_sandboxes_active",
                                "Sandboxes counting against the capacity (everything but paused, incl. "
                                "admitted starts).", value=self.orch.node_active())
        yield GaugeMetricFamily("agentenv_sandboxes_creating", "Sandbox starts in flight (creates, restores, "
                                "fork children).", value=self.orch.starting + sum(
                                    1 for r in records if r.state.value in ("creating", "resuming")))
        yield GaugeMetricFamily("agentenv_node_allocated_cpus", "vCPUs promised to active sandboxes.",
                                value=sum(r.cpu_count for r in active))
        yield GaugeMetricFamily("agentenv_node_allocated_memory_bytes", "Memory limits of active sandboxes.",
                                value=sum(r.memory_mb for r in active) * 1024 * 1024)
        yield GaugeMetricFamily("agentenv_node_cpus", "CPUs of this host.", value=os.cpu_count() or 0)
        mem = _meminfo()
        yield GaugeMetricFamily("agentenv_node_memory_bytes", "Memory of this host.", value=mem.get("MemTotal", 0))
        yield GaugeMetricFamily("agentenv_node_memory_available_bytes", "MemAvailable of this host.",
                                value=mem.get("MemAvailable", 0))
        try:
            load1 = os.getloadavg()[0]
        except OSError:
            load1 = 0.0
        yield GaugeMetricFamily("agentenv_node_load1", "1-minute load average of this host.", value=load1)
        try:
            du = shutil.disk_usage(self.settings.data_dir)
            yield GaugeMetricFamily("agentenv_node_data_disk_bytes", "Size of the data dir's filesystem.",
                                    value=du.total)
            yield GaugeMetricFamily("agentenv_node_data_disk_free_bytes", "Free space in the data dir's filesystem.",
                                    value=du.free)
        except OSError:
            pass

        warm = GaugeMetricFamily("agentenv_warm_pool_images", "Ready warm (pre-booted, checkpointed) images per "
                                 "template: creates restore them instead of booting.", labels=["template"])
        building = GaugeMetricFamily("agentenv_warm_pool_building", "Warm images being built per template.",
                                     labels=["template"])
        warm_dir = self.settings.paths.root / "warm"
        ready = {p.stem for p in warm_dir.glob("*.json")} if warm_dir.is_dir() else set()
        for t in sorted(ready)[:50]:
            warm.add_metric([t], 1)
        for t in sorted(self.orch.warm.building)[:50]:
            building.add_metric([t], 1)
        yield warm
        yield building

        pool = getattr(self.orch, "pool", None)  # a routing orchestrator (cluster gateway) has none
        if pool is not None:
            ready = GaugeMetricFamily("agentenv_sandbox_pool_ready", "Ready sandboxes in the pool per template: a "
                                      "create takes one and only runs envd's /init on it.", labels=["template"])
            for t, n in sorted(pool.ready_counts().items())[:50]:
                ready.add_metric([t], n)
            yield ready
            taken = CounterMetricFamily("agentenv_sandbox_pool_taken", "Creates served from the pool per "
                                        "template.", labels=["template"])
            for t, n in sorted(pool.taken.items())[:50]:
                taken.add_metric([t], n)
            yield taken

        s = self.sampler
        if s is not None:
            yield GaugeMetricFamily("agentenv_sandboxes_cpu_used_cores",
                                    "CPU the running sandboxes used over the last sample interval, in cores "
                                    "(sum over sandboxes; cgroup accounting).", value=s.totals.cpu_cores)
            yield GaugeMetricFamily("agentenv_sandboxes_memory_used_bytes",
                                    "Memory charged to running sandboxes' cgroups (sum).", value=s.totals.mem_used)
            yield GaugeMetricFamily("agentenv_sandboxes_disk_used_bytes",
                                    "Bytes in running sandboxes' writable layers (sum).", value=s.totals.disk_used)
            yield GaugeMetricFamily("agentenv_snapshots", "Snapshots in this node's catalog.",
                                    value=s.totals.snapshots)
            yield GaugeMetricFamily("agentenv_snapshot_store_bytes",
                                    "Sum of the sizes of the snapshots in the catalog (layers + memory; shared "
                                    "layers count once per snapshot).", value=s.totals.snapshot_bytes)
