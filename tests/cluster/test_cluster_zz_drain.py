"""Graceful drain on termination (what a Kubernetes pod stop or `systemctl stop` does to a node):
SIGTERM makes the node agent pause its running sandboxes into the S3 store before it exits, and
another node resumes them with their files and processes — through the E2B SDK at the gateway.

Runs after the load test on purpose ("zz"): a restarted node rebuilds its warm-start image in the
background, and that build most likely counts as a sandbox in the heartbeat, which the load test's
per-node peak check (<= max_sandboxes) saw once as 17/16."""

from __future__ import annotations

import pytest
from e2b import Sandbox

from test_cluster_multinode import bindings

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1200)]


def test_sigterm_pauses_running_sandboxes_for_other_nodes(cluster):
    opts = cluster.sdk_opts()
    created: list[Sandbox] = []
    stopped = None
    try:
        sbx = Sandbox.create(timeout=600, **opts)
        created.append(sbx)
        node, state = bindings(cluster)[sbx.sandbox_id]
        assert state == "running"
        sbx.files.write("/home/user/drained.txt", f"was on {node}")
        pid = sbx.commands.run("sleep 3600 >/dev/null 2>&1 & echo $!").stdout.strip()

        stopped = cluster.nodes[node]
        stopped.stop(timeout=300)
        assert stopped.proc.returncode == 0, stopped.log_tail()
        assert bindings(cluster)[sbx.sandbox_id] == (node, "paused"), stopped.log_tail()
        assert "drain" in stopped.log_tail(200)

        back = Sandbox.connect(sbx.sandbox_id, timeout=600, **opts)
        new_node, state = bindings(cluster)[sbx.sandbox_id]
        assert state == "running" and new_node != node, (new_node, state)
        assert back.files.read("/home/user/drained.txt") == f"was on {node}"
        assert back.commands.run(f"kill -0 {pid} && echo alive").stdout.strip() == "alive"
    finally:
        for s in created:
            try:
                Sandbox.kill(s.sandbox_id, **opts)
            except Exception:  # noqa: BLE001 - best effort; the fixture's gc removes the rest
                pass
        if stopped is not None:
            cluster.restart_node(stopped.name)
