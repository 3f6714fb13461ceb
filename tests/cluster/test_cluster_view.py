"""One cluster view at the gateway: the merged event stream has the events of every node (each
with its nodeID, in one increasing sequence), /sandboxes/metrics and the console's node list cover
every node, and a signed /files URL reaches its sandbox through a gateway replica that never
carried its traffic (the gateway routes it by its owner, found in the shared store)."""

from __future__ import annotations

import time

import pytest
import requests
from e2b import Sandbox

from test_cluster_multinode import bindings

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]


def _create_on(cluster, opts, node: str) -> Sandbox:
    others = [n for n in cluster.nodes if n != node]
    for n in others:
        cluster.drain(n)
    try:
        return Sandbox.create(timeout=300, **opts)
    finally:
        for n in others:
            cluster.drain(n, False)


def test_gateway_serves_one_cluster_view(cluster):
    opts = cluster.sdk_opts()
    gw, headers = cluster.gateway.url, {"X-API-Key": cluster.api_key}
    since = requests.get(f"{gw}/events?tail=1", headers=headers, timeout=30).json()["lastSeq"]
    created: dict[str, Sandbox] = {}
    try:
        for name in sorted(cluster.nodes):
            created[name] = _create_on(cluster, opts, name)
        ids = {s.sandbox_id: name for name, s in created.items()}
        assert {sid: bindings(cluster)[sid][0] for sid in ids} == ids

        # ---- the merged event stream: a "created" event from every node, one sequence
        seen: list[dict] = []
        deadline = time.monotonic() + 60
        while {e["sandboxID"] for e in seen if e["type"] == "created"} < set(ids):
            assert time.monotonic() < deadline, f"events missing: {seen}"
            r = requests.get(f"{gw}/events", params={"since": since, "wait": 5, "limit": 5000}, headers=headers,
                             timeout=30)
            assert r.status_code == 200, r.text
            body = r.json()
            seen += body["events"]
            since = body["lastSeq"]
        seqs = [e["seq"] for e in seen]
        assert seqs == sorted(set(seqs)), seqs
        created_events = {e["sandboxID"]: e for e in seen if e["type"] == "created" and e["sandboxID"] in ids}
        assert {sid: e["nodeID"] for sid, e in created_events.items()} == ids
        assert "teamID" not in seen[0]

        # ---- cross-sandbox metrics and the console's data, from every node
        deadline = time.monotonic() + 60
        while True:
            r = requests.get(f"{gw}/sandboxes/metrics", headers=headers, timeout=30)
            assert r.status_code == 200, r.text
            if set(ids) <= set(r.json()["sandboxes"]):
                break
            assert time.monotonic() < deadline, r.json()
            time.sleep(1)
        r = requests.get(f"{gw}/observability/nodes", headers=headers, timeout=30)
        assert r.status_code == 200 and {n["nodeID"] for n in r.json()} >= set(cluster.nodes), r.text
        assert requests.get(f"{gw}/observability/nodes", timeout=30).status_code == 401
        assert requests.get(f"{gw}/console/", timeout=30).status_code == 200

        # ---- a signed URL, at a gateway replica that never carried traffic for the sandbox
        sbx = created["b"]
        sbx.files.write("/home/user/signed.txt", "via its owner")
        replica = cluster.start_gateway()
        try:
            at_replica = Sandbox.connect(sbx.sandbox_id, api_key=cluster.api_key, api_url=replica.url,
                                         sandbox_url=replica.url)
            url = at_replica.download_url("/home/user/signed.txt")
            assert url.startswith(replica.url), url
            r = requests.get(url, timeout=30)
            assert r.status_code == 200 and r.text == "via its owner", (r.status_code, r.text)
        finally:
            replica.stop()
    finally:
        for s in created.values():
            try:
                Sandbox.kill(s.sandbox_id, **opts)
            except Exception:  # noqa: BLE001 - best effort; the fixture's gc removes the rest
                pass
