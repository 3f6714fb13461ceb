"""The data plane's process: HAProxy supervised by `agentenv serve`, and the fallback without it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import requests
from e2b import Sandbox

from agentenv.proxy.haproxy import processes_running, sock_dir_for
from serverproc import new_data_dir, remove_data_dir, run_gc, start_extra_server, stop_unchecked

pytestmark = pytest.mark.timeout(300)


def haproxy_pids(data_dir: Path) -> list[int]:
    """HAProxy processes running the configuration of the server on `data_dir`."""
    return processes_running(data_dir / "haproxy" / "haproxy.cfg")


def test_haproxy_is_restarted_when_it_dies(server) -> None:
    before = haproxy_pids(server.data_dir)
    assert len(before) == 1, "the session server runs one HAProxy (is haproxy installed?)"
    sbx = Sandbox.create(timeout=120, metadata={"suite": "proxy"})
    try:
        assert sbx.commands.run("echo before").stdout == "before\n"
        os.kill(before[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while True:
            now = haproxy_pids(server.data_dir)
            if now and now != before:
                try:
                    if sbx.commands.run("echo after", request_timeout=5).stdout == "after\n":
                        break
                except Exception:  # noqa: BLE001 - still restarting
                    pass
            assert time.monotonic() < deadline, f"no working HAProxy 30 s after a kill (pids {now})"
            time.sleep(0.3)
        assert "haproxy exited" in server.log_path.read_text(errors="replace")
    finally:
        sbx.kill()


def test_without_haproxy_the_python_proxy_serves_traffic() -> None:
    data_dir = new_data_dir("nohaproxy")
    srv = start_extra_server(data_dir, env={"AGENTENV_HAPROXY_PATH": "/nonexistent/haproxy"})
    try:
        assert "the Python proxy serves sandbox traffic" in srv.log_path.read_text()
        assert haproxy_pids(data_dir) == []
        sbx = Sandbox.create(timeout=120, **srv.sdk_opts())
        srv.known_ids.add(sbx.sandbox_id)
        try:
            assert sbx.commands.run("echo python-proxy").stdout == "python-proxy\n"
            sbx.files.write("/tmp/f", "x")
            assert sbx.files.read("/tmp/f") == "x"
        finally:
            sbx.kill()
    finally:
        srv.stop()
        remove_data_dir(data_dir)


def test_api_errors_stay_json_while_the_server_is_down() -> None:
    """A crashed server's HAProxy keeps running (sandbox traffic goes on); the API's callers get E2B's
    JSON error with a reason from it, not an HTML page, until the next start takes over."""
    data_dir = new_data_dir("serverdown")
    first = second = None
    try:
        first = start_extra_server(data_dir)
        assert requests.get(f"{first.url}/sandboxes", headers=first.headers(), timeout=10).status_code == 200
        first.kill9()
        assert haproxy_pids(data_dir), "HAProxy went down with the server"
        r = requests.get(f"{first.url}/sandboxes", headers=first.headers(), timeout=10)
        assert r.status_code in (502, 503), (r.status_code, r.text)
        assert r.headers["content-type"].startswith("application/json"), r.text
        body = r.json()
        assert body["code"] == r.status_code and "agentenv server" in body["message"], body
        second = start_extra_server(data_dir, api_key=first.api_key)  # stops the old HAProxy, runs its own
        assert requests.get(f"{second.url}/sandboxes", headers=second.headers(), timeout=10).status_code == 200
        assert len(haproxy_pids(data_dir)) == 1
        second.stop()
        assert haproxy_pids(data_dir) == []
    finally:
        stop_unchecked(first, second)
        remove_data_dir(data_dir)


def test_socket_dir_of_a_killed_server_goes_once_its_data_dir_is_gone(server) -> None:
    """A server killed together with its HAProxy (SIGKILL) leaves its socket dir
    in the temp dir, where its own data dir's `agentenv gc` would find it. Once that data dir is gone
    too, `agentenv gc` of any other data dir removes it, and leaves the dirs of live servers."""
    gone, other = new_data_dir("orphan"), new_data_dir("sweeper")
    parked = gone.with_name(gone.name + "-parked")
    srv = None
    try:
        srv = start_extra_server(gone)
        sock_dir = sock_dir_for(gone)
        assert (sock_dir / "owner").read_text() == str((gone / "haproxy").resolve())
        for pid in haproxy_pids(gone):  # HAProxy has a session of its own: it outlives the server
            os.kill(pid, signal.SIGKILL)
        os.killpg(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait(timeout=30)
        srv.stopped = True
        deadline = time.monotonic() + 30
        while haproxy_pids(gone) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert haproxy_pids(gone) == []
        assert sock_dir.is_dir()
        gone.rename(parked)  # its data dir deleted (set aside here, so the test can collect it after)
        r = run_gc(other)
        assert r.returncode == 0, r.stdout + r.stderr
        assert not sock_dir.exists(), f"{sock_dir} outlived its data dir: {r.stdout}"
        assert sock_dir.name in r.stdout, r.stdout
        assert sock_dir_for(server.data_dir).is_dir(), "the live session server's socket dir was removed"
    finally:
        if parked.exists():
            parked.rename(gone)
        stop_unchecked(srv)
        remove_data_dir(gone)
        remove_data_dir(other)
