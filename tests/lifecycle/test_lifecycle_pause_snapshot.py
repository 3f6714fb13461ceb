"""Pause -> resume and snapshot -> new sandbox, with a live process, memory and files."""

from __future__ import annotations

import secrets
import time

import pytest
import requests
from e2b import Sandbox, SandboxQuery, SandboxState
from e2b.exceptions import NotFoundException, SandboxException, ServiceBusyException

from lifecycle_util import (WORK, ask_worker, assert_same_worker, kill_quietly, read_state, setup_worker,
                            start_detached, worker_processes)

HTTP_PORT = 8080


def http_get(server, sandbox_id: str, path: str = "/", port: int = HTTP_PORT) -> requests.Response:
    return requests.get(f"{server.sandbox_url}{path}", timeout=30,
                        headers={"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": str(port)})


def wait_http(server, sandbox_id: str, limit: float = 30) -> requests.Response:
    deadline = time.monotonic() + limit
    while True:
        r = http_get(server, sandbox_id, "/hello.txt")
        if r.status_code == 200 or time.monotonic() > deadline:
            return r
        time.sleep(0.3)


@pytest.mark.timeout(300)
def test_pause_resume_keeps_process_memory_files_and_listener(server, tracker):
    sbx = tracker.create()
    sbx.files.write(f"{WORK}/www/hello.txt", "hello through the traffic listener\n")
    sbx.files.write(f"{WORK}/data.bin", b"\x00\x01\x02" * 100_000)
    http_pid = start_detached(sbx, f"cd {WORK}/www && exec python3 -m http.server {HTTP_PORT}")
    st = setup_worker(sbx, 32)
    # No request to the listener before the pause: http.server (HTTP/1.0) closes each connection
    # itself, leaving a TIME_WAIT endpoint in the sandbox for 60 s, which gVisor cannot checkpoint
    # (see test_pause_right_after_traffic_to_a_user_server).

    at_pause = read_state(sbx)
    assert sbx.pause() is True
    # The second pause is refused (409) -> the SDK returns False.
    assert sbx.pause() is False
    assert Sandbox.pause(sbx.sandbox_id) is False
    paused = {i.sandbox_id: i for i in Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()}
    assert sbx.sandbox_id in paused and paused[sbx.sandbox_id].state == SandboxState.PAUSED
    info = Sandbox.get_info(sbx.sandbox_id)
    assert info.state == SandboxState.PAUSED

    resumed = Sandbox.connect(sbx.sandbox_id, timeout=600)
    assert resumed.sandbox_id == sbx.sandbox_id
    assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.RUNNING
    got = ask_worker(resumed)
    assert_same_worker(got, at_pause, "after resume")
    assert got.pid == st.pid
    assert resumed.files.read(f"{WORK}/data.bin", format="bytes") == b"\x00\x01\x02" * 100_000
    # The listener is the same process and still serves through the traffic listener.
    ps = resumed.commands.run(f"cat /proc/{http_pid}/cmdline | tr '\\0' ' '").stdout
    assert "http.server" in ps, ps
    r = wait_http(server, sbx.sandbox_id)
    assert r.status_code == 200 and r.text == "hello through the traffic listener\n", (r.status_code, r.text)
    # And the counter keeps going after the resume.
    time.sleep(0.5)
    assert read_state(resumed).counter > got.counter


@pytest.mark.timeout(300)
def test_pause_right_after_traffic_to_a_user_server(server, tracker):
    """A user server that closes connections itself (HTTP/1.0 http.server) leaves TIME_WAIT in the sandbox.

    Old gVisor refused such checkpoints (and lost the sandbox); now the pause succeeds at once and
    the server answers again after the resume.
    """
    sbx = tracker.create()
    sbx.files.write(f"{WORK}/www/hello.txt", "hello through the traffic listener\n")
    start_detached(sbx, f"cd {WORK}/www && exec python3 -m http.server {HTTP_PORT}")
    r = wait_http(server, sbx.sandbox_id)
    assert r.status_code == 200, (r.status_code, r.text)
    t0 = time.monotonic()
    assert sbx.pause() is True
    assert time.monotonic() - t0 < 30  # no waiting for TIME_WAIT to run out
    resumed = Sandbox.connect(sbx.sandbox_id)
    assert wait_http(server, resumed.sandbox_id).status_code == 200


@pytest.mark.timeout(300)
def test_snapshot_full_and_filesystem_modes(server, tracker):
    src = tracker.create()
    src.files.write(f"{WORK}/notes.txt", "snapshot me\n")
    setup_worker(src, 32)
    name = f"lc-{secrets.token_hex(4)}"

    at_full = read_state(src)
    full = src.create_snapshot(name=name)
    assert full.snapshot_id
    assert any(name in n for n in full.names), full.names
    # The source keeps running with its process.
    assert_same_worker(ask_worker(src), at_full, "source after snapshot")

    src.files.write(f"{WORK}/after.txt", "only in the filesystem snapshot\n")
    fs = src.create_snapshot(mode="filesystem")
    assert fs.snapshot_id and fs.snapshot_id != full.snapshot_id

    listed = {s.snapshot_id for s in Sandbox.list_snapshots().next_items()}
    assert {full.snapshot_id, fs.snapshot_id} <= listed
    mine = {s.snapshot_id for s in src.list_snapshots().next_items()}
    assert {full.snapshot_id, fs.snapshot_id} <= mine
    by_name = [s.snapshot_id for s in Sandbox.list_snapshots(name=name).next_items()]
    assert by_name == [full.snapshot_id]

    # Full snapshot -> a new sandbox with the very process (memory intact) and the files.
    a = tracker.create(full.snapshot_id)
    assert a.sandbox_id != src.sandbox_id
    assert_same_worker(ask_worker(a), at_full, "sandbox from full snapshot")
    assert a.files.read(f"{WORK}/notes.txt") == "snapshot me\n"
    assert not a.files.exists(f"{WORK}/after.txt")
    kill_quietly(a)

    # Filesystem snapshot -> files, but a cold boot: the worker is not running.
    b = tracker.create(fs.snapshot_id)
    assert b.files.read(f"{WORK}/notes.txt") == "snapshot me\n"
    assert b.files.read(f"{WORK}/after.txt") == "only in the filesystem snapshot\n"
    assert worker_processes(b) == "", "process from a filesystem-only snapshot is running"
    kill_quietly(b)

    # The snapshot survives the death of its source; create by name.
    src.kill()
    c = tracker.create(name)
    assert_same_worker(ask_worker(c), at_full, "sandbox from snapshot (by name) after the source was killed")
    kill_quietly(c)

    assert Sandbox.delete_snapshot(full.snapshot_id) is True
    assert Sandbox.delete_snapshot(full.snapshot_id) is False
    assert Sandbox.delete_snapshot(fs.snapshot_id) is True
    listed = {s.snapshot_id for s in Sandbox.list_snapshots().next_items()}
    assert not ({full.snapshot_id, fs.snapshot_id} & listed)
    with pytest.raises((NotFoundException, SandboxException)):
        tracker.create(full.snapshot_id)


@pytest.mark.timeout(300)
def test_a_command_timeout_counts_the_time_its_sandbox_ran_not_the_pause(server, tracker):
    """As on E2B, whose paused guest's clock stands still: a command with a timeout that lives across a
    pause, or in a snapshot restored later, keeps the rest of its timeout. (gVisor moves a restored
    sandbox's clock on by its time on disk; the host tells envd how long that was:
    agentenv/orchestrator/continuity.py.) The pause stops the sandbox for its capture, the snapshot
    captures it running: both ways of stamping an image are covered."""
    timeout_s, away_s = 15, 20
    sbx = tracker.create()
    handle = sbx.commands.run("sleep 600", background=True, timeout=timeout_s)
    handle.disconnect()
    started = time.monotonic()
    assert sbx.pause() is True
    ran = time.monotonic() - started  # at most this much of its timeout is spent
    time.sleep(away_s)  # longer than its whole timeout
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=600)
    back = time.monotonic()

    def running(s: Sandbox) -> bool:
        return handle.pid in [p.pid for p in s.commands.list()]

    def killed_after(s: Sandbox, since: float) -> float:
        while running(s):
            assert time.monotonic() - since < timeout_s + 30, "the command outlived its timeout"
            time.sleep(0.5)
        return time.monotonic() - since

    assert running(resumed), "the command was killed by its timeout while its sandbox was paused"
    snap = resumed.create_snapshot()
    in_snapshot = time.monotonic() - back + ran  # at most this much of its timeout is spent in the snapshot
    # killed once it had run its timeout: the rest of it (at least timeout_s - ran) after the resume
    after = killed_after(resumed, back)
    assert after > timeout_s - ran - 2, f"killed {after:.1f}s after the resume, it had run at most {ran:.1f}s"

    time.sleep(max(0.0, away_s - (time.monotonic() - back)))  # the snapshot's image is older than the timeout
    child = tracker.create(snap.snapshot_id)
    born = time.monotonic()
    assert running(child), "the command in the snapshot was killed by its timeout while the snapshot was stored"
    after = killed_after(child, born)
    assert after > timeout_s - in_snapshot - 2, \
        f"killed {after:.1f}s after the sandbox from the snapshot started, it had run at most {in_snapshot:.1f}s"
    kill_quietly(child)
    assert Sandbox.delete_snapshot(snap.snapshot_id) is True
