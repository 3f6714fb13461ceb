"""Illegal and racing lifecycle transitions: clear 409/400s, consistent state, no orphans."""

from __future__ import annotations

import threading
import time

import pytest
import requests
from e2b import Sandbox, SandboxState
from e2b.exceptions import NotFoundException, SandboxException

from leftovers import NETNS_PREFIX, agentenv_netns, mounts_under, runsc_containers


def api(server, method: str, path: str, body: dict | None = None, timeout: float = 300) -> requests.Response:
    return requests.request(method, f"{server.api_url}{path}", json=body, timeout=timeout,
                            headers={"X-API-KEY": server.api_key})


def assert_error(r: requests.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert body.get("code") == status and isinstance(body.get("message"), str) and body["message"], body
    for w in words:
        assert w.lower() in body["message"].lower(), body
    return body


def state_of(sandbox_id: str) -> SandboxState | None:
    try:
        return Sandbox.get_info(sandbox_id).state
    except NotFoundException:
        return None
    except SandboxException as e:
        if "404" in str(e) or "not found" in str(e).lower():
            return None
        raise


def sandbox_resources(server, sandbox_id: str) -> list[str]:
    """What the host still holds for this sandbox id (read from the host, not from the server)."""
    left = []
    if sandbox_id in runsc_containers(server.data_dir):
        left.append(f"runsc container {sandbox_id}")
    if f"{NETNS_PREFIX}{sandbox_id}" in agentenv_netns():
        left.append(f"netns {NETNS_PREFIX}{sandbox_id}")
    left += [f"mount {m}" for m in mounts_under(server.data_dir / "sandboxes" / sandbox_id)] \
        if (server.data_dir / "sandboxes" / sandbox_id).exists() else []
    return left


@pytest.mark.timeout(300)
def test_paused_sandbox_refuses_fork_and_second_pause(server, tracker):
    sbx = tracker.create()
    sbx.files.write("/home/user/x.txt", "x")
    assert sbx.pause() is True
    try:
        r = api(server, "POST", f"/sandboxes/{sbx.sandbox_id}/fork", {"count": 1})
        assert_error(r, 409, "paused")
        with pytest.raises(SandboxException) as ei:
            sbx.fork(count=1)
        assert "paused" in str(ei.value).lower()
        r = api(server, "POST", f"/sandboxes/{sbx.sandbox_id}/snapshots", {})
        assert_error(r, 409, "paused")
        assert sbx.pause() is False
        r = api(server, "POST", f"/sandboxes/{sbx.sandbox_id}/pause", {})
        assert_error(r, 409, "already paused")
        assert state_of(sbx.sandbox_id) == SandboxState.PAUSED
    finally:
        s = Sandbox.connect(sbx.sandbox_id)
    assert s.files.read("/home/user/x.txt") == "x"
    assert s.commands.run("echo ok").stdout.strip() == "ok"


@pytest.mark.timeout(120)
def test_fork_count_out_of_range_is_400(server, tracker):
    sbx = tracker.create()
    for count in (0, -1, 17, 1000):
        r = api(server, "POST", f"/sandboxes/{sbx.sandbox_id}/fork", {"count": count})
        assert_error(r, 400, "count")
    # Nothing happened to the sandbox.
    assert state_of(sbx.sandbox_id) == SandboxState.RUNNING
    assert sbx.commands.run("echo ok").stdout.strip() == "ok"


@pytest.mark.timeout(300)
def test_snapshot_during_fork_is_409_or_serialized(server, tracker):
    sbx = tracker.create()
    sbx.files.write("/home/user/f.txt", "f")
    out: dict = {}

    def do_fork():
        try:
            out["fork"] = api(server, "POST", f"/sandboxes/{sbx.sandbox_id}/fork", {"count": 2})
        except Exception as e:  # noqa: BLE001
            out["fork"] = e

    t = threading.Thread(target=do_fork)
    t.start()
    time.sleep(0.05)
    snap = api(server, "POST", f"/sandboxes/{sbx.sandbox_id}/snapshots", {})
    t.join(240)
    assert not t.is_alive()
    fork = out["fork"]
    assert isinstance(fork, requests.Response), fork
    assert fork.status_code == 201, fork.text
    child_ids = [item["sandbox"]["sandboxID"] for item in fork.json() if item.get("sandbox")]
    tracker.ids.update(child_ids)
    assert len(child_ids) == 2, fork.text
    if snap.status_code == 409:
        assert_error(snap, 409)
    else:
        assert snap.status_code == 201, snap.text
        sid = snap.json()["snapshotID"]
        assert Sandbox.delete_snapshot(sid) is True
    # Consistent afterwards: the source runs and answers; the children too.
    assert state_of(sbx.sandbox_id) == SandboxState.RUNNING
    assert sbx.commands.run("cat /home/user/f.txt").stdout == "f"
    for cid in child_ids:
        c = Sandbox.connect(cid)
        assert c.commands.run("cat /home/user/f.txt").stdout == "f"
        c.kill()


@pytest.mark.timeout(300)
def test_kill_source_while_forking_leaves_no_orphans(server, tracker):
    sbx = tracker.create()
    sid = sbx.sandbox_id
    out: dict = {}

    def do_fork():
        try:
            out["fork"] = api(server, "POST", f"/sandboxes/{sid}/fork", {"count": 3})
        except Exception as e:  # noqa: BLE001
            out["fork"] = e

    t = threading.Thread(target=do_fork)
    t.start()
    time.sleep(0.05)
    killed = api(server, "DELETE", f"/sandboxes/{sid}")
    t.join(240)
    assert not t.is_alive()
    # The kill either waited for the capture and succeeded, or found the sandbox already gone.
    assert killed.status_code in (204, 404), killed.text
    fork = out["fork"]
    assert isinstance(fork, requests.Response), fork
    child_ids: list[str] = []
    if fork.status_code == 201:
        # The capture was taken before the kill went through: every child starts from it, although
        # the source is gone while they restore (its image is not in the source's dir).
        child_ids = [item["sandbox"]["sandboxID"] for item in fork.json() if item.get("sandbox")]
        tracker.ids.update(child_ids)
        assert len(child_ids) == 3, f"children failed after their source was killed: {fork.text}"
    else:
        # The fork lost the race to the kill: a clean JSON error, never a 500.
        assert fork.status_code in (404, 409), fork.text
        assert_error(fork, fork.status_code)
    tracker.ids.update(child_ids)
    assert state_of(sid) is None, "killed source still visible"
    for cid in child_ids:
        st = state_of(cid)
        assert st in (SandboxState.RUNNING, None), f"child {cid} is {st}"
        if st == SandboxState.RUNNING:
            assert Sandbox.connect(cid).commands.run("echo ok").stdout.strip() == "ok"
    for cid in child_ids:
        Sandbox.kill(cid)
    # Nothing of the source or its children is left on the host.
    deadline = time.monotonic() + 20
    while True:
        left = {x: sandbox_resources(server, x) for x in [sid, *child_ids]}
        left = {k: v for k, v in left.items() if v}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not left, f"resources left after killing source + children: {left}\n{server.log_tail(30)}"
    assert not list((server.data_dir / "fork-images").glob(f"{sid}-*")), "the fork's image outlived it"
