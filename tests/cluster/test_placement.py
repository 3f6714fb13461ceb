"""The scheduler's placement rules (`Placement`), on registries written out by hand: which nodes
may take a sandbox, which one wins, and how reservations of placements in flight count."""

from __future__ import annotations

from datetime import timedelta

import pytest

from agentenv.cluster.scheduler import Placement, Request
from agentenv.errors import BadRequest, Unavailable
from agentenv.models import NodeRecord, utcnow


def node(node_id: str, **kw) -> NodeRecord:
    base = dict(node_id=node_id, url=f"http://{node_id}", cpu_count=8, memory_mb=32768, max_sandboxes=10,
                runtimes=["gvisor"])
    base.update(kw)
    return NodeRecord(**base)


def placement() -> Placement:
    return Placement(dead_after_s=10, max_starting=4)


def test_only_nodes_serving_the_runtime_are_candidates():
    p = placement()
    nodes = [node("a"), node("b", runtimes=["gvisor", "qemu"]), node("c", runtimes=["firecracker"])]
    assert p.place(nodes, Request(runtime="qemu"))[0].node_id == "b"
    assert p.place(nodes, Request(runtime="firecracker"))[0].node_id == "c"
    with pytest.raises(Unavailable) as e:
        p.place([node("a")], Request(runtime="qemu"))
    assert "does not serve the qemu runtime" in e.value.message


def test_a_request_without_runtime_and_a_node_that_reports_none_match_anything():
    p = placement()
    assert p.place([node("old", runtimes=[])], Request(runtime="qemu"))[0].node_id == "old"
    assert p.place([node("c", runtimes=["firecracker"])], Request())[0].node_id == "c"


def test_capacity_counts_reservations_until_a_heartbeat_shows_the_sandbox():
    p = placement()
    n = node("a", max_sandboxes=3, sandboxes=1, heartbeat_at=utcnow() - timedelta(seconds=1))
    _, r1 = p.place([n], Request())
    p.place([n], Request())
    with pytest.raises(Unavailable, match=r"at capacity \(3/3"):
        p.place([n], Request())
    p.release(r1)  # started, but the node's last heartbeat predates it: still counted
    with pytest.raises(Unavailable, match=r"at capacity \(3/3"):
        p.place([n], Request())
    # the next heartbeat shows the started sandbox: it is counted once, not twice
    with pytest.raises(Unavailable, match=r"at capacity \(3/3"):
        p.place([node("a", max_sandboxes=3, sandboxes=2)], Request())
    p.place([node("a", max_sandboxes=4, sandboxes=2)], Request())


def test_a_finished_start_is_no_longer_in_flight_but_its_load_counts_until_the_next_heartbeat():
    p = Placement(dead_after_s=10, max_starting=1)
    old = utcnow() - timedelta(seconds=1)
    a, b = node("a", sandboxes=0, heartbeat_at=old), node("b", sandboxes=0, heartbeat_at=old)
    first, r1 = p.place([a, b], Request())
    other = "b" if first.node_id == "a" else "a"
    with pytest.raises(Unavailable, match="busy starting 1"):
        p.place([first], Request())
    p.release(r1)
    # the start is over (no longer busy), and the node that took it is the fuller one until its
    # heartbeat says otherwise: the next sandbox goes to the other node
    assert p.place([a, b], Request())[0].node_id == other


def test_draining_dead_and_silent_nodes_are_skipped_and_the_emptier_node_wins():
    p = placement()
    stale = node("silent", heartbeat_at=utcnow() - timedelta(seconds=60))
    nodes = [node("busy", sandboxes=8), node("idle", sandboxes=1), node("drain", state="draining"), stale]
    assert p.place(nodes, Request())[0].node_id == "idle"
    with pytest.raises(Unavailable) as e:
        p.place([nodes[2], stale], Request())
    assert e.value.headers["Retry-After"] and "draining" in e.value.message


def test_fork_goes_to_the_source_node_or_nowhere():
    p = placement()
    nodes = [node("a", sandboxes=9), node("b")]
    assert p.place(nodes, Request(kind="fork", node="a"))[0].node_id == "a"
    with pytest.raises(Unavailable, match="source sandbox's node"):
        p.place(nodes, Request(kind="fork", node="a", count=2))
    with pytest.raises(BadRequest):
        p.place(nodes, Request(count=0))
