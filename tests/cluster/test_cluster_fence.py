"""Fencing: node C is cut off the cluster's LAN (nft drop in its namespace: PostgreSQL, S3, the
scheduler, the gateway and the other nodes all out of reach, as a failed switch port would do).

C must stop serving its running sandbox before the scheduler declares C dead (probed from inside
C's namespace, through C's own listener, which still works there); a sandbox paused on C is resumed
on another node meanwhile, and never answers from C again. When the LAN comes back C rejoins
(`active`), and its fenced sandbox — declared lost meanwhile — is back as `paused`, resumable with
its files and processes. Through the E2B SDK at the gateway; bindings read from PostgreSQL.
"""

from __future__ import annotations

import time

import pytest
from e2b import Sandbox

from test_cluster_multinode import bindings

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]


def _on_c(cluster, opts, n: int) -> list[Sandbox]:
    """`n` sandboxes placed on node c (a and b drain meanwhile)."""
    for name in ("a", "b"):
        cluster.drain(name)
    try:
        return [Sandbox.create(timeout=600, **opts) for _ in range(n)]
    finally:
        for name in ("a", "b"):
            cluster.drain(name, False)


def test_partitioned_node_fences_then_rejoins(cluster):
    opts = cluster.sdk_opts()
    node_c = cluster.nodes["c"]
    created: list[Sandbox] = []
    try:
        created += _on_c(cluster, opts, 2)
        running, parked = created
        assert {bindings(cluster)[s.sandbox_id][0] for s in created} == {"c"}
        running.files.write("/home/user/fenced.txt", "ran on c")
        pid = running.commands.run("sleep 3600 >/dev/null 2>&1 & echo $!").stdout.strip()
        parked.files.write("/home/user/parked.txt", "paused on c")
        assert parked.pause() is True
        assert node_c.sandbox_status(running.sandbox_id) // 100 == 2

        # ---- partition: c stops serving before the cluster declares it dead
        node_c.partition()
        t0 = time.monotonic()
        last_answer = t0
        fenced_at = dead_at = None
        while dead_at is None:
            assert time.monotonic() - t0 < 90, "node c never declared dead"
            code = node_c.sandbox_status(running.sandbox_id)
            now = time.monotonic()
            if code // 100 == 2:
                last_answer = now
            elif code == 503 and fenced_at is None:
                fenced_at = now
            if cluster.node_status()["c"]["state"] == "dead":
                dead_at = time.monotonic()
            time.sleep(0.2)
        print(f"partition: last answer from c after {last_answer - t0:.1f}s, fenced (503) after "
              f"{(fenced_at or 0) - t0:.1f}s, declared dead after {dead_at - t0:.1f}s")
        assert fenced_at is not None and last_answer < fenced_at < dead_at, (last_answer, fenced_at, dead_at)
        assert "FENCED" in node_c.log_tail(400)
        assert bindings(cluster)[running.sandbox_id] == ("c", "lost")
        assert node_c.sandbox_status(running.sandbox_id) == 503

        # the paused one moves to a live node and answers there, never from c
        moved = Sandbox.connect(parked.sandbox_id, timeout=600, **opts)
        where, state = bindings(cluster)[parked.sandbox_id]
        assert where in ("a", "b") and state == "running"
        assert moved.files.read("/home/user/parked.txt") == "paused on c"
        assert node_c.sandbox_status(parked.sandbox_id) // 100 != 2

        # ---- the LAN comes back: c rejoins, never runs the moved sandbox, gets its fenced one back
        node_c.heal()
        deadline = time.monotonic() + 120
        while cluster.node_status()["c"]["state"] != "active":
            assert time.monotonic() < deadline, f"node c never rejoined:\n{node_c.log_tail(80)}"
            time.sleep(0.5)
        assert bindings(cluster)[parked.sandbox_id] == (where, "running")
        assert node_c.sandbox_status(parked.sandbox_id) // 100 != 2
        assert moved.commands.run("echo still here").stdout.strip() == "still here"
        assert bindings(cluster)[running.sandbox_id] == ("c", "paused")
        back = Sandbox.connect(running.sandbox_id, timeout=600, **opts)
        assert back.files.read("/home/user/fenced.txt") == "ran on c"
        assert back.commands.run(f"kill -0 {pid} && echo alive").stdout.strip() == "alive"
        on = bindings(cluster)[running.sandbox_id][0]
        assert cluster.nodes[on].sandbox_status(running.sandbox_id) // 100 == 2
    except BaseException:
        print(cluster.task_dumps())
        for name in ("gateway", "scheduler"):
            print(f"--- {name} log\n" + open(getattr(cluster, name).log_path, errors="replace").read()[-3000:])
        for n in cluster.nodes.values():
            print(f"--- node {n.name} log\n{n.log_tail(120 if n is node_c else 40)}")
        raise
    finally:
        node_c.heal()
        for s in created:
            try:
                Sandbox.kill(s.sandbox_id, **opts)
            except Exception:  # noqa: BLE001 - best effort; the fixture's gc removes the rest
                pass
        if cluster.node_status().get("c", {}).get("state") != "active":
            cluster.restart_node("c")


def test_fenced_node_that_restarts_keeps_its_paused_sandbox(cluster):
    """A fenced node that crashes before it could rejoin keeps what it paused onto its disk: after the
    restart it starts fenced, rejoins, and the sandbox resumes with its file and process."""
    opts = cluster.sdk_opts()
    node_c = cluster.nodes["c"]
    created: list[Sandbox] = []
    try:
        created += _on_c(cluster, opts, 1)
        (sbx,) = created
        sbx.files.write("/home/user/kept.txt", "across the crash")
        pid = sbx.commands.run("sleep 3600 >/dev/null 2>&1 & echo $!").stdout.strip()
        node_c.partition()
        deadline = time.monotonic() + 90
        while f"fence: sandbox {sbx.sandbox_id} paused" not in node_c.log_tail(200):
            assert time.monotonic() < deadline, f"node c never paused its sandbox:\n{node_c.log_tail(60)}"
            time.sleep(0.5)
        node_c.kill9()  # a crash while fenced; it restarts once the network is back
        node_c.heal()
        since = node_c.log_size()
        node_c.start()
        cluster.wait_nodes(["c"])
        # the store may still hold the killed process's `active`: the restarted one rejoins after
        # its first heartbeat; only this process's log tells
        log = node_c.wait_log("rejoined the cluster", since)
        assert f"sandbox {sbx.sandbox_id}, paused here while this node was fenced, is kept for its rejoin" in log
        assert bindings(cluster)[sbx.sandbox_id] == ("c", "paused")
        back = Sandbox.connect(sbx.sandbox_id, timeout=600, **opts)
        assert back.files.read("/home/user/kept.txt") == "across the crash"
        assert back.commands.run(f"kill -0 {pid} && echo alive").stdout.strip() == "alive"
    except BaseException:
        print(f"--- node c log\n{node_c.log_tail(150)}")
        raise
    finally:
        node_c.heal()
        for s in created:
            try:
                Sandbox.kill(s.sandbox_id, **opts)
            except Exception:  # noqa: BLE001 - best effort; the fixture's gc removes the rest
                pass
        if node_c.proc is None or node_c.proc.poll() is not None or \
                cluster.node_status().get("c", {}).get("state") != "active":
            cluster.restart_node("c")
