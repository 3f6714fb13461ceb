"""A real Linux guest under Firecracker through FirecrackerRuntime: needs hardware virtualization.

On hosts whose /dev/kvm is software PVM (our CI machines) a stock guest kernel's ring-0 code is
emulated and dies, so this test skips with what the host detection found. With VT-x/AMD-V it boots
the guest kernel (uncompressed vmlinux) and root disk named by AGENTENV_TEST_VMLINUX,
AGENTENV_TEST_GUEST_ROOTFS (optional AGENTENV_TEST_GUEST_INITRD), snapshots it, restores it into
a fresh process and checks the kernel keeps running.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from agentenv.runtimes.base import VmBoot, VmDisk
from agentenv.runtimes.select import detect_virt

pytestmark = [pytest.mark.kvm, pytest.mark.timeout(600)]


def _guest_files() -> tuple[Path, Path, Path | None] | None:
    k, r = os.environ.get("AGENTENV_TEST_VMLINUX"), os.environ.get("AGENTENV_TEST_GUEST_ROOTFS")
    if not (k and r and Path(k).exists() and Path(r).exists()):
        return None
    i = os.environ.get("AGENTENV_TEST_GUEST_INITRD")
    return Path(k), Path(r), Path(i) if i else None


async def _console_has(kit, sid: str, needle: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = await kit.rt.console(sid)
        if needle in text:
            return text
        await asyncio.sleep(0.1)
    raise AssertionError(f"{needle!r} not on the console after {timeout}s: {(await kit.rt.console(sid))[-2000:]}")


async def test_linux_guest_boots_snapshots_and_restores(kit):
    virt = detect_virt()
    if not virt.hardware:
        pytest.skip(f"no hardware virtualization on this host: {virt.detail}")
    files = _guest_files()
    if files is None:
        pytest.skip("no guest image: set AGENTENV_TEST_VMLINUX and AGENTENV_TEST_GUEST_ROOTFS "
                    "(uncompressed vmlinux + ext4 root disk)")
    kernel, rootfs, initrd = files
    spec = await kit.spec()
    spec.memory_mb = 256
    spec.vm = VmBoot(kernel=kernel.resolve(), initrd=initrd.resolve() if initrd else None,
                     cmdline="console=ttyS0 reboot=k panic=1 root=/dev/vda rw",
                     disks=[VmDisk("rootfs", rootfs, read_only=False, root=True)])
    await kit.rt.start(spec)
    await _console_has(kit, spec.sandbox_id, "Linux version", 60)
    await _console_has(kit, spec.sandbox_id, "Freeing unused kernel", 120)
    cap = kit.rt.root / "captures" / f"{spec.sandbox_id}-linux"
    await kit.rt.checkpoint(spec.sandbox_id, cap)
    child = await kit.spec()
    child.vm = spec.vm
    await kit.rt.restore(child, cap)
    await asyncio.sleep(2)
    assert await kit.rt.is_alive(child.sandbox_id), kit.rt.vm(child.sandbox_id).log_tail()
