"""The E2B SDK against a server with AGENTENV_RUNTIME=firecracker: a real Linux guest per sandbox.

Needs hardware virtualization (VT-x/AMD-V). On hosts whose /dev/kvm is software PVM (our CI
machines) a stock guest kernel cannot boot, so this module skips with what host detection found —
and `agentenv serve` with this runtime refuses to start there (tests/test_cli_host.py checks that).
The guest image is the one the QEMU runtime uses (`agentenv image build --vm`).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from agentenv.runtimes.select import detect_virt
from serverproc import ExtraServer, agentenv_executable, new_data_dir, remove_data_dir, shared_data_dir, \
    start_extra_server

from .conftest import missing

pytestmark = [pytest.mark.kvm, pytest.mark.timeout(900)]

FC_ENV = {"AGENTENV_RUNTIME": "firecracker", "AGENTENV_DEFAULT_MEMORY_MB": "512",
          "AGENTENV_DEFAULT_CPU_COUNT": "1", "AGENTENV_DEFAULT_DISK_MB": "2048"}
REQ = 120


@pytest.fixture(scope="module")
def fc_server(request) -> Iterator[ExtraServer]:
    virt = detect_virt()
    if not virt.hardware:
        pytest.skip(f"no hardware virtualization on this host, so no Linux guest under Firecracker: {virt.detail}")
    why = missing()
    if why:
        pytest.skip(why)
    request.getfixturevalue("server")   # the session server builds the base image and tools layer first
    shared = shared_data_dir()
    env = dict(os.environ, **FC_ENV)
    r = subprocess.run([agentenv_executable(), "image", "build", "--vm", "--data-dir", str(shared)], env=env,
                       capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, f"guest image build failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    d = new_data_dir("fc")
    srv = start_extra_server(d, env=FC_ENV, log_name="server-firecracker.log")
    try:
        yield srv
    finally:
        try:
            srv.stop(timeout=120)
        finally:
            subprocess.run(["umount", str(d / "vm")], capture_output=True, timeout=60)   # the VM store
            remove_data_dir(d)


def _kill(s) -> None:
    try:
        s.kill()
    except Exception:  # noqa: BLE001
        pass


def test_linux_guest_create_commands_pause_fork(fc_server):
    from e2b import Sandbox

    t0 = time.monotonic()
    sbx = Sandbox.create(timeout=600, request_timeout=REQ, **fc_server.sdk_opts())
    children = []
    try:
        print(f"create: {time.monotonic() - t0:.2f}s")
        r = sbx.commands.run("uname -r; tr '\\0' ' ' < /proc/1/cmdline", timeout=60, request_timeout=REQ)
        kernel, init = r.stdout.split("\n", 1)
        assert kernel.endswith("-cloud-amd64") and kernel != os.uname().release, r.stdout
        assert "agentenv.envd" in init, init
        sbx.commands.run("echo 41 > /home/user/n; python3 -c 'print(1)'", timeout=60, request_timeout=REQ)
        sbx.pause()
        sbx = Sandbox.connect(sbx.sandbox_id, timeout=600, request_timeout=REQ, **fc_server.sdk_opts())
        assert sbx.files.read("/home/user/n").strip() == "41"
        children = sbx.fork(count=4)
        assert len(children) == 4

        def bump(c):
            c.commands.run("echo $(( $(cat /home/user/n) + 1 )) > /home/user/n", timeout=60, request_timeout=REQ)
            return c.files.read("/home/user/n").strip()

        with ThreadPoolExecutor(4) as ex:
            assert list(ex.map(bump, children)) == ["42"] * 4      # each continues from the capture, alone
        assert sbx.files.read("/home/user/n").strip() == "41"
    finally:
        for c in children:
            _kill(c)
        _kill(sbx)
