"""Fixtures for the Firecracker runtime tests: the pinned VMM, a purpose-written guest, real slots.

Everything runs through agentenv's own code (FirecrackerRuntime, NetworkManager, the reflink
store); nothing is mocked. Each VM and slot is registered before it can fail and torn down in the
finalizer; the session finalizer unmounts the store's XFS image and deletes the data dir.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from agentenv.config import Settings
from agentenv.network.manager import NetworkManager
from agentenv.network.slots import NetSlot
from agentenv.runtimes.base import SandboxSpec, VmBoot, VmDisk
from agentenv.runtimes.firecracker import DEFAULT_FIRECRACKER_DIR, FirecrackerRuntime, JailerConfig, find_firecracker
from agentenv.storage.reflink import ReflinkStore

from . import testguest

# The pinned release (scripts/install-firecracker.sh): tests run exactly this binary.
FIRECRACKER_SHA256 = "b99ea49b8d8b7bfa307d3845585d6a97f7642aa17a985749900370070d8ca930"
BASE_DIR = Path(os.environ.get("AGENTENV_TEST_RUNTIME_DIR", "/var/tmp/agentenv-test-runtime"))
DATA_DIR = BASE_DIR.with_name(BASE_DIR.name + "-fc")
TEST_SUBNET = os.environ.get("AGENTENV_TEST_RUNTIME_SUBNET", "10.214.0.0/16")
GUEST_MEM_MIB = 64


def missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (netns, taps, loop mount)"
    if not os.path.exists("/dev/kvm"):
        return "no /dev/kvm: Firecracker needs KVM"
    fc = find_firecracker()
    if fc is None:
        return "firecracker not installed (bash scripts/install-firecracker.sh)"
    if hashlib.sha256(fc.read_bytes()).hexdigest() != FIRECRACKER_SHA256:
        return f"{fc} is not the pinned Firecracker v1.12.1 build"
    if shutil.which("mkfs.xfs") is None:
        return "mkfs.xfs missing (apt-get install xfsprogs)"
    return testguest.tools_missing()


@pytest.fixture(scope="session")
def fc_data_dir():
    reason = missing()
    if reason:
        pytest.skip(reason)
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    store = ReflinkStore(DATA_DIR, size_gb=16)
    try:
        yield DATA_DIR
    finally:
        store.destroy()
        shutil.rmtree(DATA_DIR, ignore_errors=True)


@pytest.fixture(scope="session")
def guest(fc_data_dir: Path) -> testguest.TestGuest:
    return testguest.build(fc_data_dir / "guest")


@pytest.fixture(scope="session")
def template_disks(fc_data_dir: Path) -> tuple[Path, Path]:
    """A writable 'rootfs' template disk and a read-only 'tools' disk, raw files with marker bytes."""
    d = fc_data_dir / "template"
    d.mkdir(exist_ok=True)
    rootfs, tools = d / "rootfs.raw", d / "tools.raw"
    for p, marker in ((rootfs, b"template-rootfs"), (tools, b"template-tools")):
        with open(p, "wb") as f:
            f.truncate(32 << 20)
            f.write(marker)
    return rootfs, tools


@dataclass
class Kit:
    settings: Settings
    net: NetworkManager
    rt: FirecrackerRuntime
    guest: testguest.TestGuest
    disks: tuple[Path, Path]
    live: dict[str, NetSlot] = field(default_factory=dict)

    def boot(self) -> VmBoot:
        rootfs, tools = self.disks
        return VmBoot(kernel=self.guest.elf.resolve(), cmdline="console=ttyS0",
                      disks=[VmDisk("rootfs", rootfs, read_only=False, root=True),
                             VmDisk("tools", tools, read_only=True)])

    async def spec(self, sandbox_id: str | None = None) -> SandboxSpec:
        sid = sandbox_id or f"fc{uuid.uuid4().hex[:10]}"
        slot = await self.net.allocate(sid, allow_internet=False)
        self.live[sid] = slot
        return SandboxSpec(sandbox_id=sid, rootfs=Path("/nonexistent"), tools_dir=Path("/nonexistent"), slot=slot,
                           bundle_dir=self.settings.paths.sandbox_dir(sid), cpu_count=1, memory_mb=GUEST_MEM_MIB,
                           env={"AGENTENV_TEST": "1"}, vm=self.boot())

    async def destroy(self, sid: str) -> None:
        await self.rt.stop(sid)
        slot = self.live.pop(sid, None)
        if slot is not None:
            await self.net.release(slot)

    async def close(self) -> None:
        errors = []
        for sid in list(self.live):
            try:
                await self.destroy(sid)
            except Exception as e:  # keep cleaning the others
                errors.append(e)
        await self.rt.close()
        if errors:
            raise errors[0]


async def _kit(fc_data_dir: Path, guest: testguest.TestGuest, template_disks, jailer: JailerConfig | None):
    settings = Settings(data_dir=fc_data_dir, slot_subnet=TEST_SUBNET)
    net = NetworkManager(settings)
    await net.setup_host()
    return Kit(settings, net, FirecrackerRuntime(fc_data_dir, store=ReflinkStore(fc_data_dir, size_gb=16),
                                                 jailer=jailer), guest, template_disks)


@pytest.fixture
async def kit(fc_data_dir: Path, guest: testguest.TestGuest, template_disks):
    k = await _kit(fc_data_dir, guest, template_disks, None)
    try:
        yield k
    finally:
        await k.close()


JAIL_UID = 64123   # an unprivileged uid/gid nobody on the host uses


@pytest.fixture
async def jailed_kit(fc_data_dir: Path, guest: testguest.TestGuest, template_disks):
    jailer = DEFAULT_FIRECRACKER_DIR / "jailer"
    if not os.access(jailer, os.X_OK):
        pytest.skip("jailer not installed (bash scripts/install-firecracker.sh)")
    k = await _kit(fc_data_dir, guest, template_disks, JailerConfig(jailer, uid=JAIL_UID, gid=JAIL_UID))
    try:
        yield k
    finally:
        await k.close()
