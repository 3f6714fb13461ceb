"""Random concurrent lifecycle operations through the cluster's gateway (`tests/soak.py`): creates
placed on any node, pauses published to S3 and resumed wherever the scheduler puts them, forks and
snapshots on the owning node, checkpoints' sandboxes killed while others use them. The cluster must
behave as one server does under the same load: every answer a success or a 409, every sandbox
with its data, killed and expired ones gone everywhere."""

from __future__ import annotations

from collections import Counter

import pytest
from e2b import Sandbox

from soak import Soak
from test_cluster_multinode import bindings

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]


def test_cluster_soak_keeps_every_sandbox_and_its_data(cluster):
    opts = cluster.sdk_opts()
    ids: set[str] = set()
    soak = Soak(cluster.gateway.url, cluster.api_key, ids.add, seed=20261205, sdk=opts, run_s=90)
    try:
        soak.run()
        print("operations done:", soak.done)
        nodes = Counter(node for node, _state in bindings(cluster, ids).values())
        print("sandboxes left per node:", dict(nodes))
        soak.assert_clean("\n".join(f"--- node {n.name}\n{n.log_tail(15)}" for n in cluster.nodes.values()),
                          logs={**{f"node {n.name}": n.log_path for n in cluster.nodes.values()},
                                "gateway": cluster.gateway.log_path, "scheduler": cluster.scheduler.log_path})
    finally:
        for sid in ids:
            try:
                Sandbox.kill(sid, **opts)
            except Exception:  # noqa: BLE001 - gone already; the fixture's checks find the rest
                pass
