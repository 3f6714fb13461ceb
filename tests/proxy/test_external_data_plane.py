"""HAProxy as a component of its own (`agentenv data-plane`, `haproxy_external = true`): the server
writes the configuration and maps and drives HAProxy through the runtime API, but another process
runs it — here in a PID namespace of its own, as a sidecar container would (the server cannot see
its processes). Checked through the E2B SDK and HAProxy's own counters:

- the fast path works (HAProxy's envd backend answers, not the Python fallback);
- HAProxy killed -9: the component starts it again, the server sees the new instance and sends it
  every route (the map files it loaded predate the sandbox, so only that resend puts it back on the
  fast path);
- a pause and resume work (HAProxy's connections into the sandbox are reset without its pid);
- the server stopping leaves the component running; a server restarted with another configuration
  has it reloaded; SIGTERM ends the component and its HAProxy, and nothing is left behind.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from e2b import Sandbox

from agentenv.proxy.haproxy import RuntimeApi, backend_stats, sock_dir_for
from serverproc import agentenv_executable, new_data_dir, remove_data_dir, start_extra_server, stop_unchecked
from leftovers import haproxy_master
from test_data_plane import haproxy_pids

pytestmark = pytest.mark.skipif(not Path("/usr/sbin/haproxy").exists(), reason="haproxy is not installed")

ENV = {"AGENTENV_HAPROXY_EXTERNAL": "true", "AGENTENV_POOL_SIZE": "0"}


def master_pid(data_dir: Path) -> int | None:
    return haproxy_master(data_dir / "haproxy" / "haproxy.cfg")


def routed(data_dir: Path) -> set[str]:
    """The sandbox ids in HAProxy's routes map now."""
    out = asyncio.run(RuntimeApi(sock_dir_for(data_dir) / "admin.sock").run(
        [f"show map {data_dir / 'haproxy' / 'routes.map'}"]))
    return {line.split()[1] for line in "\n".join(out).splitlines() if len(line.split()) == 3}


def envd_answers(data_dir: Path) -> int:
    stats = asyncio.run(backend_stats(RuntimeApi(sock_dir_for(data_dir) / "admin.sock"), ("sandbox_envd",)))
    return sum(stats["sandbox_envd"][f"hrsp_{k}xx"] for k in range(1, 6))


def wait_for(what: str, ok, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = ok()
            if value:
                return value
        except OSError:
            pass
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_haproxy_as_its_own_component(server):  # `server`: the shared images exist
    d = new_data_dir("extdp")
    comp = srv = None
    comp_log = d / "data-plane.log"
    try:
        with open(comp_log, "wb") as log:  # its own PID (and mount, for /proc) namespace
            comp = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child=SIGTERM",
                                     agentenv_executable(),
                                     "data-plane", "--role", "serve", "--data-dir", str(d)],
                                    env=dict(os.environ, AGENTENV_DATA_DIR=str(d)), stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        srv = start_extra_server(d, env=ENV, log_name="server-extdp.log")
        master = master_pid(d)
        assert master is not None, f"no haproxy of the component:\n{comp_log.read_text()[-2000:]}"

        sbx = Sandbox.create(timeout=300, **srv.sdk_opts())
        wait_for("the sandbox's route", lambda: sbx.sandbox_id in routed(d), timeout=10)
        before = envd_answers(d)
        assert sbx.commands.run("echo fast").stdout == "fast\n"
        assert envd_answers(d) > before, "the sandbox's envd traffic did not take HAProxy's fast path"

        # HAProxy dies: the component starts it again, the server resends every route
        os.kill(master, signal.SIGKILL)
        wait_for("the server to see the new haproxy", lambda: "is a new instance" in srv.log_path.read_text())
        wait_for("the sandbox's route resent", lambda: sbx.sandbox_id in routed(d), timeout=10)
        assert master_pid(d) not in (None, master)
        assert sbx.commands.run("echo again").stdout == "again\n"
        assert envd_answers(d) > 0, "after the restart the sandbox's traffic did not reach HAProxy's envd backend"
        assert "starting it again" in comp_log.read_text()

        # a pause closes HAProxy's connections into the sandbox (the server cannot see its pid)
        assert sbx.pause() is True
        sbx = Sandbox.connect(sbx.sandbox_id, timeout=300, **srv.sdk_opts())
        assert sbx.commands.run("echo resumed").stdout == "resumed\n"
        sbx.kill()

        # the server stops: the component and its HAProxy go on
        srv.stop(gc=False, check_leftovers=False)
        assert comp.poll() is None and haproxy_pids(d), "the component stopped with the server"
        # another configuration (threads): the component has HAProxy reload it
        srv = start_extra_server(d, env={**ENV, "AGENTENV_HAPROXY_THREADS": "1"}, log_name="server-extdp2.log")
        wait_for("the reload", lambda: "haproxy reloads it" in comp_log.read_text())
        other = Sandbox.create(timeout=120, **srv.sdk_opts())
        assert other.commands.run("echo reloaded").stdout == "reloaded\n"
        other.kill()
        srv.stop(gc=False, check_leftovers=False)

        # SIGTERM to the component itself (pid 1 of its namespace; unshare leaves SIGTERM to it)
        (child,) = Path(f"/proc/{comp.pid}/task/{comp.pid}/children").read_text().split()
        os.kill(int(child), signal.SIGTERM)
        comp.wait(30)
        wait_for("the component to stop its haproxy", lambda: "haproxy stopped" in comp_log.read_text(), timeout=20)
        wait_for("the component's haproxy to exit", lambda: not haproxy_pids(d), timeout=15)
        srv.stop()  # gc and the leftovers check
    finally:
        if comp is not None and comp.poll() is None:
            os.killpg(comp.pid, signal.SIGKILL)
            comp.wait(10)
        stop_unchecked(srv)
        remove_data_dir(d)
