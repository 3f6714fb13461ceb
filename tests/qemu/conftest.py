"""Fixtures for the QEMU runtime suite: one `agentenv serve` with AGENTENV_RUNTIME=qemu, real Linux guests.

The guest image (kernel from Debian packages, initramfs, ext4 drives) is built once into the shared
test data dir with `agentenv image build --vm` and hard-linked into the server's data dir, like the
base image. Every guest runs under TCG here (software PVM KVM cannot run a stock kernel), so the
timeouts are those of emulation: a cold boot to envd takes 10-20 s on a busy 2-core host.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from serverproc import (ExtraServer, agentenv_executable, new_data_dir, remove_data_dir, shared_data_dir,
                        start_extra_server)

QEMU_ENV = {
    "AGENTENV_RUNTIME": "qemu",
    "AGENTENV_EXTRA_RUNTIMES": "gvisor",   # one node, two runtimes: tests/qemu/test_multi_runtime.py
    "AGENTENV_DEFAULT_MEMORY_MB": "512",   # guest RAM (a sparse file; only touched pages cost)
    "AGENTENV_DEFAULT_CPU_COUNT": "1",     # TCG: one vCPU thread per guest keeps 2 host cores usable
    "AGENTENV_DEFAULT_DISK_MB": "2048",
}


def _missing() -> str | None:
    for tool in ("qemu-system-x86_64", "qemu-img", "mkfs.ext4", "apt-get", "lz4"):
        if shutil.which(tool) is None:
            return f"{tool} not installed (scripts/setup.sh --test installs it)"
    return None


@pytest.fixture(scope="session")
def qemu_env() -> dict[str, str]:
    """The AGENTENV_* settings of the suite's QEMU servers (for tests that start their own)."""
    return dict(QEMU_ENV)


@pytest.fixture(scope="session")
def guest_image(server) -> dict[str, Path]:
    """The guest image in the shared data dir, built by `agentenv image build --vm` (cached there).

    `server` (the session server) builds the base image and tools layer this needs first.
    """
    why = _missing()
    if why:
        pytest.skip(why)
    shared = shared_data_dir()
    env = dict(os.environ)
    env.update(QEMU_ENV)
    r = subprocess.run([agentenv_executable(), "image", "build", "--vm", "--data-dir", str(shared)], env=env,
                       capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, f"guest image build failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    parts = {}
    for line in r.stdout.splitlines():
        if line.startswith("guest "):
            name, path = line[len("guest "):].split(":", 1)
            parts[name.strip()] = Path(path.strip())
    assert {"kernel", "vmlinux", "initrd", "root", "tools"} <= set(parts), r.stdout
    return parts


@pytest.fixture(scope="session")
def qemu_server(guest_image) -> Iterator[ExtraServer]:
    d = new_data_dir("qemu")
    srv = start_extra_server(d, env=QEMU_ENV, log_name="server-qemu.log")
    srv.successor = None  # set by a test that restarts the server on the same data dir
    try:
        yield srv
    finally:
        try:
            if srv.successor is not None:
                srv.successor.stop(timeout=120)
            else:
                srv.stop(timeout=120)
        finally:
            remove_data_dir(d)
