"""The data plane's process: HAProxy supervised by `agentenv serve`, and the fallback without it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import requests
from e2b import Sandbox

from agentenv.proxy.haproxy import processes_running
from serverproc import new_data_dir, remove_data_dir, start_extra_server, stop_unchecked

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
