"""The shared microVM guest image, booted by FirecrackerRuntime with no `spec.vm` (the server's path).

Checks what this host can show: the runtime builds the VmBoot from the guest image (uncompressed
vmlinux, initramfs, the template's root drive as a per-sandbox reflink copy, the read-only tools
drive), Firecracker accepts all of it and starts the instance, MMDS and the command line carry the
sandbox's settings. Where hardware virtualization exists the guest must also reach its init's
readiness marker; under PVM (our CI machines) a stock kernel cannot get that far, so that part is
left to hosts that can (see test_firecracker_e2e.py for the full SDK flow there).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time

import pytest

from agentenv.config import Settings
from agentenv.runtimes.firecracker import FirecrackerRuntime
from agentenv.runtimes.select import detect_virt
from agentenv.storage import guest
from agentenv.storage.images import ImageStore
from agentenv.storage.reflink import ReflinkStore
from serverproc import agentenv_executable, shared_data_dir

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def guest_images(server):
    """The session server built base + tools; add the VM guest image to the shared images dir."""
    shared = shared_data_dir()
    r = subprocess.run([agentenv_executable(), "image", "build", "--vm", "--data-dir", str(shared)],
                       capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, f"guest image build failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return shared / "images"


async def test_runtime_boots_the_shared_guest_image(kit, guest_images):
    store = ImageStore(Settings(data_dir=guest_images.parent))
    tools = await store.ensure_tools()
    rt = FirecrackerRuntime(kit.settings.data_dir, images_dir=guest_images,
                            store=ReflinkStore(kit.settings.data_dir, size_gb=16))
    spec = await kit.spec()
    spec.vm = None
    spec.rootfs, spec.tools_dir, spec.lowers = store.image_rootfs("base"), tools, []
    spec.memory_mb, spec.disk_mb = 256, 2048
    spec.args, spec.env = list(store.envd_argv()), {"AGENTENV_ENVD_HOST_TOKEN": "t0ken"}
    sid = spec.sandbox_id
    try:
        await rt.start(spec)
        assert await rt.is_alive(sid)
        cfg = await rt.vm(sid).api.get("/vm/config")
        kernel = await store_kernel(guest_images)
        assert cfg["boot-source"]["kernel_image_path"] == str(kernel.vmlinux)
        assert cfg["boot-source"]["initrd_path"] == str(kernel.initrd)
        args = cfg["boot-source"]["boot_args"]
        assert "agentenv.cfg=" in args and "console=ttyS0" in args
        drives = {d["drive_id"]: d for d in cfg["drives"]}
        assert drives["root"]["is_read_only"] is False and drives["tools"]["is_read_only"] is True
        assert cfg["network-interfaces"][0]["guest_mac"] == guest.GUEST_MAC
        root_copy = rt.workdir(sid) / "root.raw"
        assert root_copy.stat().st_size >= 1 << 30 and not root_copy.is_symlink()   # its own disk
        mmds = await rt.vm(sid).api.get("/mmds")
        assert mmds["agentenv"]["env"]["AGENTENV_ENVD_HOST_TOKEN"] == "t0ken"
        if detect_virt().hardware:
            deadline = time.monotonic() + 120
            while guest.READY_MARKER not in await rt.console(sid):
                assert time.monotonic() < deadline, (await rt.console(sid))[-3000:]
                await asyncio.sleep(0.2)
    finally:
        await rt.stop(sid)
        await rt.close()
    assert not os.path.exists(rt.workdir(sid))


async def store_kernel(images_dir):
    return await guest.GuestImages(images_dir).ensure_kernel()
