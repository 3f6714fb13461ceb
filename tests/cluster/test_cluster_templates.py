"""A template built through the gateway, placed by the scheduler, starts on another node.

The E2B SDK's `Template` builder talks only to the gateway: the build request is placed by the
scheduler (on A: B and C drain meanwhile), the COPY context is uploaded through the gateway to A,
the start and the status polls are routed to A, and A publishes the built layers and memory image
to the S3 snapshot store. Then A drains, and a sandbox created from the template lands on B or C,
which pull them from S3: it sees the copied file and the RUN step's output.
"""

from __future__ import annotations

import secrets
import time

import pytest
import requests
from e2b import Sandbox, Template

from test_cluster_multinode import bindings, from_store

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]


def build_record(cluster, build_id: str):
    return from_store(cluster, lambda s: s.get_build(build_id))


def test_template_built_through_the_gateway_starts_on_another_node(cluster, tmp_path):
    api = dict(api_key=cluster.api_key, api_url=cluster.gateway.url)
    headers = {"X-API-Key": cluster.api_key}
    secret = secrets.token_hex(8)  # a new files hash: the upload really goes through the gateway
    (tmp_path / "hello.txt").write_text(f"copied {secret}\n")
    name = f"gw-tpl-{secrets.token_hex(4)}"
    template = (Template(file_context_path=str(tmp_path)).from_base_image()
                .copy("hello.txt", "/home/user/hello.txt")
                .run_cmd("echo ran-at-build > /home/user/run.txt"))
    logs: list[str] = []
    sbx = info = None
    try:
        for n in ("b", "c"):
            cluster.drain(n)
        t0 = time.monotonic()
        try:
            info = Template.build(template, name, cpu_count=1, memory_mb=512,
                                  on_build_logs=lambda e: logs.append(str(e.message)), **api)
        finally:
            for n in ("b", "c"):
                cluster.drain(n, False)
        built_s = time.monotonic() - t0
        build = build_record(cluster, info.build_id)
        assert build.spec["node"] == "a", build.spec.get("node")
        assert build.status.value == "ready" and build.layers and build.memory_digest
        assert any("snapshot store" in line for line in logs), logs
        # the catalog through the gateway (relayed to a node)
        got = requests.get(f"{cluster.gateway.url}/templates/{info.template_id}", headers=headers, timeout=30)
        assert got.status_code == 200 and got.json()["builds"][0]["buildID"] == info.build_id, got.text

        cluster.drain("a")  # the template's node takes no new sandbox: it must start elsewhere
        t0 = time.monotonic()
        sbx = Sandbox.create(name, timeout=300, request_timeout=300, **cluster.sdk_opts())
        created_s = time.monotonic() - t0
        node, _state = bindings(cluster, {sbx.sandbox_id})[sbx.sandbox_id]
        print(f"template built on a in {built_s:.1f}s; first sandbox from it on {node} (pulling its "
              f"{len(build.layers)} layer(s) and memory image from S3) in {created_s:.1f}s")
        assert node in ("b", "c"), node
        assert sbx.files.read("/home/user/hello.txt") == f"copied {secret}\n"
        assert sbx.commands.run("cat /home/user/run.txt").stdout.strip() == "ran-at-build"
        # the node pulled the build's layers and memory image (it never built them)
        pulled = cluster.nodes[node].data_dir
        assert all((pulled / "layers" / d).is_dir() for d in build.layers)
        assert (pulled / "memory" / build.memory_digest).is_dir()
    except BaseException:
        for role in ("gateway", "scheduler"):
            print(f"--- {role} log\n" + open(getattr(cluster, role).log_path, errors="replace").read()[-4000:])
        for n in cluster.nodes.values():
            print(f"--- node {n.name} log\n{n.log_tail(40)}")
        print("--- build logs\n" + "\n".join(logs[-40:]))
        raise
    finally:
        if sbx is not None:
            Sandbox.kill(sbx.sandbox_id, **cluster.sdk_opts())
        cluster.drain("a", False)
        if info is not None:
            requests.delete(f"{cluster.gateway.url}/templates/{info.template_id}", headers=headers, timeout=60)


def test_build_routes_without_a_build_answer_typed_errors(cluster):
    """A start or status poll of an unknown build, an upload URL naming no node: JSON errors."""
    headers = {"X-API-Key": cluster.api_key}
    base = cluster.gateway.url
    r = requests.get(f"{base}/templates/nope/builds/00000000-0000-0000-0000-000000000000/status",
                     headers=headers, timeout=30)
    assert r.status_code == 404 and r.json()["code"] == 404, r.text
    r = requests.put(f"{base}/template-files/{'0' * 64}?team=t&expires=1&signature=x", data=b"x", timeout=30)
    assert r.status_code == 400 and "node" in r.json()["message"], r.text
    r = requests.post(f"{base}/v3/templates", json={"name": "x"}, timeout=30)  # no key
    assert r.status_code == 401, r.text
