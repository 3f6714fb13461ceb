"""The cluster end to end through the unmodified E2B SDK pointed at the gateway.

30 sandboxes spread by load over three nodes, commands, a fork (children on the source's node), a
pause on node A resumed on node B, a pause on node C resumed elsewhere after C died, and node C
killed with -9: its running sandboxes are reported lost, nothing new is placed on it, the rest
keeps serving. Bindings (which node holds a sandbox) are read from the real PostgreSQL.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from e2b import Sandbox

from agentenv.state.postgres import PostgresStateStore

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1500)]


def from_store(cluster, read):
    """`await read(store)` on the cluster's real PostgreSQL state store."""

    async def go():
        s = PostgresStateStore(cluster.database_url, min_size=1, max_size=1)
        await s.open()
        try:
            return await read(s)
        finally:
            await s.close()

    return asyncio.run(go())


def bindings(cluster, ids=None) -> dict[str, str]:
    """sandbox id -> node id, as the shared state store has them."""

    async def read(s):
        return {r.sandbox_id: (r.node_id, r.state.value) for r in await s.list_sandboxes()}

    got = from_store(cluster, read)
    return {k: v for k, v in got.items() if ids is None or k in ids}


def s3_client(cluster):
    """A boto3 client of the cluster's snapshot store (rclone serving S3; bucket `cluster`)."""
    import boto3
    from botocore.config import Config

    s3 = cluster.s3
    return boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id=s3.access_key,
                        aws_secret_access_key=s3.secret_key, region_name="us-east-1",
                        config=Config(s3={"addressing_style": "path"}))


def test_cluster_end_to_end(cluster):
    opts = cluster.sdk_opts()
    created: list[Sandbox] = []
    try:
        _scenario(cluster, opts, created)
    except BaseException:
        for name in ("gateway", "scheduler"):
            print(f"--- {name} log\n" + open(getattr(cluster, name).log_path, errors="replace").read()[-4000:])
        for n in cluster.nodes.values():
            print(f"--- node {n.name} log\n{n.log_tail(40)}")
        raise
    finally:
        for s in created:
            try:
                Sandbox.kill(s.sandbox_id, **opts)
            except Exception:  # noqa: BLE001 - best effort; the fixture's gc removes the rest
                pass
        node_c = cluster.nodes["c"]
        if node_c.killed:  # bring the cluster back to three nodes for the next tests
            cluster.restart_node("c")


def _scenario(cluster, opts, created):
    # ---- 30 sandboxes, created concurrently, spread by load. What earlier tests left running counts
    # as load too (the scheduler sees it in the heartbeats), and a burst beyond the nodes' start
    # slots (`max_starting_per_node`) goes to whichever node frees a slot first: a node that starts
    # slower takes fewer. So the check is a fair share of the total, not an exact 10/10/10.
    before = Counter(node for node, state in bindings(cluster).values() if state == "running")
    with ThreadPoolExecutor(10) as pool:
        sbxs = list(pool.map(lambda _i: Sandbox.create(timeout=900, request_timeout=300, **opts), range(30)))
    created.extend(sbxs)
    where = bindings(cluster, {s.sandbox_id for s in sbxs})
    per_node = Counter(node for node, _state in where.values())
    total = per_node + before
    print("placement of 30 sandboxes:", dict(per_node), "running before:", dict(before))
    assert len(where) == 30 and set(per_node) == {"a", "b", "c"}
    assert min(total[n] for n in "abc") >= 6 and max(total.values()) - min(total[n] for n in "abc") <= 6, \
        f"not spread by load: {dict(per_node)} placed, {dict(before)} running before"

    # ---- commands in every sandbox, through the gateway's traffic routing
    with ThreadPoolExecutor(10) as pool:
        outs = list(pool.map(lambda s: s.commands.run("echo $E2B_SANDBOX_ID; hostname").stdout.split(), sbxs))
    assert [o[0] for o in outs] == [s.sandbox_id for s in sbxs]
    listed = set()
    paginator = Sandbox.list(**opts)
    while paginator.has_next:
        listed |= {i.sandbox_id for i in paginator.next_items()}
    assert {s.sandbox_id for s in sbxs} <= listed, "list fan-out misses sandboxes"
    # node-local reads (metrics) are relayed to the owning node
    assert isinstance(sbxs[1].get_metrics(), list)

    # ---- fork: children on the source's node, with the source's state
    src = sbxs[0]
    src.files.write("/home/user/mark.txt", "before fork")
    results = src.fork(count=2, timeout=600, request_timeout=300)
    children = [r for r in results if isinstance(r, Sandbox)]
    created.extend(children)
    assert len(children) == 2, results
    where = bindings(cluster)
    assert {where[c.sandbox_id][0] for c in children} == {where[src.sandbox_id][0]}
    for c in children:
        assert c.files.read("/home/user/mark.txt") == "before fork"

    # ---- pause on node A, resume on node B (A drains: the scheduler must place it elsewhere)
    on_a = [s for s in sbxs[1:] if where[s.sandbox_id][0] == "a"]
    moving = on_a[0]
    moving.files.write("/home/user/state.txt", "paused on a")
    pid = moving.commands.run("sleep 3600 >/dev/null 2>&1 & echo $!").stdout.strip()
    assert moving.pause() is True
    assert bindings(cluster)[moving.sandbox_id] == ("a", "paused")
    cluster.drain("a")
    try:
        resumed = Sandbox.connect(moving.sandbox_id, timeout=600, **opts)
        node, state = bindings(cluster)[moving.sandbox_id]
        assert state == "running" and node != "a", (node, state)
        assert resumed.files.read("/home/user/state.txt") == "paused on a"
        assert resumed.commands.run(f"kill -0 {pid} && echo alive").stdout.strip() == "alive"
        # draining: a new sandbox never lands on A
        extra = Sandbox.create(timeout=600, **opts)
        created.append(extra)
        assert bindings(cluster)[extra.sandbox_id][0] != "a"
    finally:
        cluster.drain("a", False)

    # ---- node C dies (kill -9): lost, not placed on, the rest keeps serving
    where = bindings(cluster)
    on_c = [s for s in sbxs[1:] if where.get(s.sandbox_id, ("", ""))[0] == "c"]
    assert len(on_c) >= 3
    parked = on_c[0]
    parked.files.write("/home/user/parked.txt", "paused on c")
    assert parked.pause() is True
    running_on_c = on_c[1:]
    cluster.nodes["c"].kill9()
    deadline = time.monotonic() + 60
    while cluster.node_status()["c"]["state"] != "dead":
        assert time.monotonic() < deadline, "node c never declared dead"
        time.sleep(0.5)
    where = bindings(cluster)
    assert all(where[s.sandbox_id] == ("c", "lost") for s in running_on_c)
    assert where[parked.sandbox_id] == ("c", "paused")  # its state is in S3: not lost
    for s in running_on_c[:3]:
        with pytest.raises(Exception) as info:
            Sandbox.connect(s.sandbox_id, **opts)
        assert "lost" in str(info.value), info.value
    listed = {i.sandbox_id for i in Sandbox.list(**opts).next_items()}
    assert not listed & {s.sandbox_id for s in running_on_c}
    # the paused sandbox of the dead node resumes on another one, from the snapshot store
    back = Sandbox.connect(parked.sandbox_id, timeout=600, **opts)
    assert bindings(cluster)[parked.sandbox_id][0] in ("a", "b")
    assert back.files.read("/home/user/parked.txt") == "paused on c"
    # new sandboxes only on live nodes; the others still answer
    with ThreadPoolExecutor(4) as pool:
        fresh = list(pool.map(lambda _i: Sandbox.create(timeout=600, **opts), range(4)))
    created.extend(fresh)
    assert {bindings(cluster)[s.sandbox_id][0] for s in fresh} <= {"a", "b"}
    alive = [s for s in sbxs if where[s.sandbox_id][0] in ("a", "b") and s is not moving]
    for s in alive[:6] + fresh:
        assert s.commands.run("echo ok").stdout.strip() == "ok"
    # killing a lost sandbox removes its record
    Sandbox.kill(running_on_c[0].sandbox_id, **opts)
    assert running_on_c[0].sandbox_id not in bindings(cluster)


def test_time_travel_through_the_gateway(cluster):
    """Checkpoint, rollback, the sandbox's checkpoints and the tree are routed to the owning node."""
    from agentenv.client.timetravel import TimeTravel

    opts = cluster.sdk_opts()
    tt = TimeTravel(api_url=cluster.gateway.url, api_key=cluster.api_key)
    sbx = Sandbox.create(timeout=600, **opts)
    try:
        sbx.files.write("/home/user/state", "one")
        c1 = tt.checkpoint(sbx.sandbox_id, name=f"gw-{sbx.sandbox_id}")
        sbx.files.write("/home/user/state", "two")
        c2 = tt.checkpoint(sbx.sandbox_id)
        assert c2.parent_id == c1.checkpoint_id
        tt.rollback(sbx.sandbox_id, c1.checkpoint_id)
        assert sbx.files.read("/home/user/state") == "one"
        assert [c.checkpoint_id for c in tt.checkpoints(sbx.sandbox_id)] == [c1.checkpoint_id, c2.checkpoint_id]
        tree = tt.tree(c2.checkpoint_id)
        assert tree.root_id == c1.checkpoint_id and len(tree.checkpoints) == 2
        for c in (c2, c1):
            tt.delete(c.checkpoint_id)
    finally:
        Sandbox.kill(sbx.sandbox_id, **opts)


def test_store_gc_counts_every_node_and_keeps_what_checkpoints_and_pauses_need(cluster):
    """`agentenv gc --store` with the cluster's settings (PostgreSQL + S3): a paused sandbox's blobs
    (referenced only by its PostgreSQL row) stay, and so do the layers a deleted checkpoint shares
    with its child; the deleted checkpoint's memory image goes, the killed sandbox's layer goes. The
    scheduler runs the periodic job."""
    import os
    import subprocess

    from agentenv.client.timetravel import TimeTravel
    from serverproc import agentenv_executable

    client = s3_client(cluster)
    prefix = "agentenv/"

    def keys() -> set[str]:
        out = set()
        for page in client.get_paginator("list_objects_v2").paginate(Bucket="cluster", Prefix=prefix):
            out |= {o["Key"][len(prefix):] for o in page.get("Contents", [])}
        return out

    def manifest(sid: str) -> dict:
        import json

        return json.loads(client.get_object(Bucket="cluster", Key=f"{prefix}manifests/{sid}.json")["Body"].read())

    def blobs(m: dict) -> set[str]:
        return {f"layers/{d}" for d in m["layers"]} | ({f"memory/{m['memory']}"} if m.get("memory") else set())

    def gc_store() -> set[str]:
        env = {**os.environ, **cluster.extra["gateway_env"], "AGENTENV_DATA_DIR": str(cluster.work)}
        t0 = time.monotonic()
        r = subprocess.run([agentenv_executable(), "gc", "--store", "--grace", "0"], env=env, capture_output=True,
                           text=True, timeout=120, stdin=subprocess.DEVNULL)
        assert r.returncode == 0, r.stdout + r.stderr
        print(f"gc --store on the cluster ({time.monotonic() - t0:.2f}s): {r.stdout.strip().splitlines()[-1]}")
        return {line.split()[1] for line in r.stdout.splitlines() if line.startswith("removed ")}

    opts = cluster.sdk_opts()
    tt = TimeTravel(api_url=cluster.gateway.url, api_key=cluster.api_key)
    sbx = Sandbox.create(timeout=600, **opts)
    try:
        sbx.files.write("/home/user/state", "one")
        c1 = tt.checkpoint(sbx.sandbox_id)
        sbx.files.write("/home/user/state", "two")
        c2 = tt.checkpoint(sbx.sandbox_id)
        m1, m2 = manifest(c1.checkpoint_id), manifest(c2.checkpoint_id)
        assert set(m1["layers"]) < set(m2["layers"]), (m1, m2)  # the child shares its parent's layers
        sbx.files.write("/home/user/paused", "p")
        before = keys()
        assert sbx.pause() is True
        paused = {k for k in keys() - before if k.split("/")[0] in ("layers", "memory")}
        assert {k.split("/")[0] for k in paused} == {"layers", "memory"}, paused
        tt.delete(c1.checkpoint_id)

        removed = gc_store()
        assert f"memory/{m1['memory']}" in removed, removed
        assert not removed & (paused | blobs(m2)), removed & (paused | blobs(m2))
        resumed = Sandbox.connect(sbx.sandbox_id, timeout=600, **opts)  # on any node, from S3 if need be
        assert resumed.files.read("/home/user/paused") == "p"
        tt.rollback(sbx.sandbox_id, c2.checkpoint_id)  # the child of the deleted checkpoint restores
        assert resumed.files.read("/home/user/state") == "two"
    finally:
        Sandbox.kill(sbx.sandbox_id, **opts)
    tt.delete(c2.checkpoint_id)
    paused_layers = {k for k in paused if k.startswith("layers/")}
    removed = gc_store()
    assert paused_layers <= removed, (paused_layers, removed)
    left = keys()
    for k in left:
        if k.startswith("manifests/"):
            missing = blobs(manifest(k.split("/")[1].removesuffix(".json"))) - left
            assert not missing, (k, missing)
    log = (cluster.work / "scheduler.log").read_text()
    assert "snapshot store:" in log, "the scheduler's periodic store GC never ran"


def test_concurrent_resumes_through_two_gateway_replicas(cluster, tmp_path):
    """Six `connect`s of one paused sandbox at once, half through a second gateway replica, with
    its node drained (each replica has the scheduler place a move, and the scheduler's reservations
    send them to different nodes): one node resumes it, the other moves are refused by its claim in
    the store (RESUMING) and sent to it, every caller gets the sandbox with its files, and it runs
    on exactly one node."""
    replica = cluster.start_gateway()
    gateways = [cluster.gateway.url, replica.url]
    probe = tuple(map(str, cluster.pki.issue("gateway", "probe", out=tmp_path)))  # nodes' rpc: gateways only
    opts = cluster.sdk_opts()
    sbx = Sandbox.create(timeout=600, **opts)
    try:
        for round_ in range(2):
            sbx.files.write("/home/user/round.txt", f"round {round_}")
            Sandbox.pause(sbx.sandbox_id, **opts)

            def connect(i: int) -> str:
                url = gateways[i % 2]
                s = Sandbox.connect(sbx.sandbox_id, timeout=600, api_key=cluster.api_key, api_url=url,
                                    sandbox_url=url)
                return s.files.read("/home/user/round.txt")

            # its node drained: every resume is a move, and the scheduler's reservations send the
            # replicas' concurrent moves to the two other nodes
            holder = bindings(cluster, {sbx.sandbox_id})[sbx.sandbox_id][0]
            cluster.drain(holder)
            try:
                with ThreadPoolExecutor(6) as pool:
                    seen = list(pool.map(connect, range(6)))
            finally:
                cluster.drain(holder, False)
            assert seen == [f"round {round_}"] * 6
            node, state = bindings(cluster, {sbx.sandbox_id})[sbx.sandbox_id]
            assert state == "running"
            team = _record(cluster, sbx.sandbox_id).team_id
            running_on = [n for n, proc in cluster.nodes.items()
                          if _held_by(cluster, probe, proc, sbx.sandbox_id, team)]
            assert running_on == [node], (running_on, node)

        # The race itself, at the nodes, as two replicas' moves would run it: node x resumes the
        # sandbox while node y adopts it from x. Exactly one of them wins; before the resume's
        # claim both did (two nodes running it, one deleting the pause image the other needed).
        sbx.files.write("/home/user/round.txt", "raced")
        Sandbox.pause(sbx.sandbox_id, **opts)
        holder = bindings(cluster, {sbx.sandbox_id})[sbx.sandbox_id][0]
        x, y = sorted(n for n in cluster.nodes if n != holder)
        team = _record(cluster, sbx.sandbox_id).team_id

        def rpc(node: str, method: str, **kw) -> requests.Response:
            return requests.post(f"{cluster.nodes[node].url}/internal/rpc/{method}", json=kw, cert=probe,
                                 verify=str(cluster.pki.ca), timeout=600)

        assert rpc(x, "adopt_sandbox", sandbox_id=sbx.sandbox_id, from_node=holder).status_code == 200
        assert rpc(holder, "release_sandbox", sandbox_id=sbx.sandbox_id).status_code == 200
        with ThreadPoolExecutor(1) as pool:
            resume = pool.submit(rpc, x, "connect_sandbox", sandbox_id=sbx.sandbox_id, timeout=600, team_id=team)
            time.sleep(0.15)  # x's resume under way (it claims it first thing)
            adopt = rpc(y, "adopt_sandbox", sandbox_id=sbx.sandbox_id, from_node=x)
            resumed = resume.result()
        codes = sorted([resumed.status_code, adopt.status_code])
        assert codes == [200, 409], (resumed.text, adopt.text)
        loser = adopt if adopt.status_code == 409 else resumed
        assert loser.json()["error_code"] == "sandbox_changing_state", loser.text
        running_on = [n for n, proc in cluster.nodes.items() if _held_by(cluster, probe, proc, sbx.sandbox_id, team)]
        assert running_on == ([x] if resumed.status_code == 200 else []), running_on
        back = Sandbox.connect(sbx.sandbox_id, timeout=600, **opts)
        assert back.files.read("/home/user/round.txt") == "raced"
    finally:
        try:
            Sandbox.kill(sbx.sandbox_id, **opts)
        finally:
            replica.stop()


def test_failed_move_leaves_the_sandbox_paused_for_any_node(cluster, tmp_path):
    """A resume that fails after its claim (the pause image cannot be pulled from the store) gives
    the claim back: PAUSED in the store, so the sandbox is not pinned to the node that failed. With
    that node drained too, the next connect moves it to the third node, with its files. Without the
    unclaim the store says RESUMING: no node can adopt it, and it stays bound to the node that failed
    (drained or not)."""
    opts = cluster.sdk_opts()
    client = s3_client(cluster)
    sbx = Sandbox.create(timeout=600, **opts)
    drained: list[str] = []
    withheld = tmp_path / "pause-image"
    key = None
    try:
        sbx.files.write("/home/user/kept.txt", "across a failed move")
        Sandbox.pause(sbx.sandbox_id, **opts)
        rec = _record(cluster, sbx.sandbox_id)
        holder, image = rec.node_id, rec.memory_digest
        assert image, "a published pause has a memory image"
        key = f"agentenv/memory/{image}"
        client.download_file("cluster", key, str(withheld))  # withheld from the store by the test
        client.delete_object(Bucket="cluster", Key=key)
        cluster.drain(holder)  # the one node that has the image itself
        drained.append(holder)
        with pytest.raises(Exception) as ei:
            Sandbox.connect(sbx.sandbox_id, timeout=600, **opts)
        print("connect with the pause image withheld:", repr(ei.value)[:300])
        rec = _record(cluster, sbx.sandbox_id)
        failed_on = rec.node_id
        assert failed_on != holder, "the resume was not a move"
        assert (rec.state.value, rec.memory_digest) == ("paused", image), \
            f"after the failed resume on {failed_on}: {rec.state.value} (the claim was not given back)"

        client.upload_file(str(withheld), "cluster", key)
        key = None
        cluster.drain(failed_on)
        drained.append(failed_on)
        back = Sandbox.connect(sbx.sandbox_id, timeout=600, **opts)
        assert back.files.read("/home/user/kept.txt") == "across a failed move"
        node, state = bindings(cluster, {sbx.sandbox_id})[sbx.sandbox_id]
        assert state == "running" and node not in (holder, failed_on), (node, state, holder, failed_on)
    finally:
        if key is not None and withheld.exists():
            client.upload_file(str(withheld), "cluster", key)
        for n in drained:
            cluster.drain(n, False)
        Sandbox.kill(sbx.sandbox_id, **opts)


def _record(cluster, sandbox_id: str):
    return from_store(cluster, lambda s: s.get_sandbox(sandbox_id))


def _held_by(cluster, cert: tuple[str, str], node, sandbox_id: str, team_id: str) -> bool:
    """Whether the node itself (not the shared store) holds the sandbox, running."""
    r = requests.post(f"{node.url}/internal/rpc/get_sandbox", json={"sandbox_id": sandbox_id, "team_id": team_id},
                      cert=cert, verify=str(cluster.pki.ca), timeout=30)
    if r.status_code == 404:
        return False
    assert r.status_code == 200, r.text
    return r.json()["state"] == "running"
