"""The runtime seam.

A runtime starts and stops isolated sandboxes; it never executes commands itself: everything
inside a sandbox is driven through envd over the sandbox's network slot. Pause/resume and
checkpoint/restore are the hooks lifecycle operations (pause, snapshot, fork) build on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from agentenv.network.slots import NetSlot


@dataclass
class VmDisk:
    """One virtio block device of a microVM (raw file or image the VMM opens)."""

    drive_id: str
    path: Path
    read_only: bool = False
    root: bool = False


@dataclass
class VmBoot:
    """What a microVM runtime (Firecracker, QEMU) boots; container runtimes ignore it.

    `disks` are the *template's* disks: a VM runtime gives each sandbox its own copy-on-write
    copy of the writable ones (reflink / qcow2 overlay) and shares the read-only ones.
    """

    kernel: Path                         # uncompressed ELF vmlinux (Firecracker) or bzImage (QEMU)
    initrd: Path | None = None
    cmdline: str = ""
    disks: list[VmDisk] = field(default_factory=list)


@dataclass
class SandboxSpec:
    """Everything a runtime needs to start one sandbox."""

    sandbox_id: str
    rootfs: Path            # prepared root filesystem (overlay of base image + writable upper)
    tools_dir: Path         # read-only tools layer, mounted at constants.TOOLS_MOUNT
    slot: NetSlot           # the sandbox's network namespace
    bundle_dir: Path        # per-sandbox scratch dir owned by the runtime (OCI bundle, logs)
    cpu_count: int = 2
    memory_mb: int = 1024
    hostname: str = "sandbox"
    env: dict[str, str] = field(default_factory=dict)  # envd's environment (not user processes')
    args: list[str] = field(default_factory=list)      # argv of the sandbox's first process (envd)
    pids_limit: int = 4096                              # cgroup pids limit for the whole sandbox
    vm: VmBoot | None = None                            # guest to boot (microVM runtimes only)
    disk_mb: int = 4096                                 # room of the sandbox's disk (VM runtimes)
    # What `rootfs` is made of, top first (layers, then the base image): VM runtimes build their
    # read-only root drive from it once and key the drive by it.
    lowers: list[Path] = field(default_factory=list)
    nofile: int = 65536                                 # RLIMIT_NOFILE of the sandbox's processes
    memory_headroom_mb: int = 0                         # host limit above memory_mb (envd's OOM guard acts first)
    # Host file bind-mounted read-only over /proc/sys/kernel/random/boot_id (outside the rootfs, in the
    # sandbox dir; the orchestrator writes it per boot). gVisor only: its own boot_id is fixed when its
    # kernel boots, so every restore of one image would share it. MicroVM guests have their own.
    boot_id_file: Path | None = None


class Runtime(Protocol):
    name: str

    async def start(self, spec: SandboxSpec) -> None:
        """Boot the sandbox; returns once the runtime reports it running (envd may still be starting)."""

    async def stop(self, sandbox_id: str) -> None:
        """Kill and delete; idempotent; leaves no process, mount or cgroup behind."""

    async def is_alive(self, sandbox_id: str) -> bool: ...

    async def pause(self, sandbox_id: str) -> None:
        """Freeze in place (cheap; memory stays allocated)."""

    async def resume(self, sandbox_id: str) -> None: ...

    async def checkpoint(self, sandbox_id: str, image_dir: Path) -> None:
        """Write memory + runtime state to image_dir. The sandbox is stopped afterwards."""

    async def restore(self, spec: SandboxSpec, image_dir: Path) -> None:
        """Start a sandbox from a checkpoint (possibly into another slot/rootfs: a fork child)."""

    async def list_ids(self) -> list[str]:
        """Ids of all sandboxes this runtime knows on this node (to reap orphans after a crash)."""
