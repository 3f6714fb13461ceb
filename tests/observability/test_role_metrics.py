"""`mount_role_metrics` (gateway/scheduler) renders a node registry (the records a heartbeat stores).

The roles' real registry is the cluster's PostgreSQL store: tests/cluster/test_cluster_metrics.py
scrapes the running roles; here the records are given directly.
"""

from __future__ import annotations

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from agentenv.config import Settings
from agentenv.models import NodeRecord
from agentenv.observability.roles import mount_role_metrics


async def test_role_metrics_show_the_node_registry(tmp_path):
    nodes = [NodeRecord(node_id="n1", url="http://a", max_sandboxes=16, sandboxes=3, alloc_cpu=6,
                        alloc_memory_mb=3072, load=0.5),
             NodeRecord(node_id="n2", url="http://b", max_sandboxes=8, state="draining"),
             NodeRecord(node_id="n3", url="http://c", max_sandboxes=8, state="dead")]

    async def list_nodes():
        return nodes

    runner = None
    try:
        app = web.Application()
        mount_role_metrics(app, Settings(data_dir=tmp_path), role="scheduler", list_nodes=list_nodes)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{port}/metrics") as r:
                assert r.status == 200
                text = await r.text()
        samples = [x for f in text_string_to_metric_families(text) for x in f.samples]

        def v(name, **labels):
            return sum(x.value for x in samples if x.name == name and all(x.labels.get(k) == w for k, w in labels.items()))

        assert v("agentenv_role_info", role="scheduler") == 1
        assert v("agentenv_cluster_nodes", state="active") == 1 and v("agentenv_cluster_nodes", state="draining") == 1
        assert v("agentenv_cluster_node_sandbox_capacity", node="n1") == 16
        assert v("agentenv_cluster_node_sandboxes_active", node="n1") == 3
        assert v("agentenv_cluster_node_allocated_memory_bytes", node="n1") == 3072 * 1024 * 1024
        assert 0 <= v("agentenv_cluster_node_heartbeat_age_seconds", node="n2") < 60
        assert v("agentenv_cluster_nodes", state="dead") == 1
        assert not any(x.labels.get("node") == "n3" for x in samples)  # dead nodes leave the per-node series
    finally:
        if runner is not None:
            await runner.cleanup()
