"""The runtime seam.

A runtime starts and stops isolated sandboxes; it never executes commands itself: everything
inside a sandbox is driven through envd over the sandbox's network slot. Pause/resume and
checkpoint/restore are the hooks lifecycle operations (pause, snapshot, fork) build on.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from agentenv.network.slots import NetSlot
from agentenv.storage.guest import VmBoot, VmDisk  # part of the seam: SandboxSpec.vm

__all__ = ["Runtime", "RuntimeTraits", "SandboxSpec", "VmBoot", "VmDisk"]


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


@dataclass(frozen=True)
class RuntimeTraits:
    """What a runtime can do, declared by the runtime (the orchestrator never probes with getattr)."""

    vm: bool = False                  # a microVM with its own guest kernel (Firecracker, QEMU)
    boots_from_spec: bool = False     # boots the guest image the host puts in SandboxSpec.vm (Firecracker)
    envd_timeout_s: float = 60.0      # how long envd may take to answer after a start or restore
    resets_connections: bool = False  # checkpoint(reset_connections=...) (gVisor >= 20240729)
    may_stay_frozen: bool = False     # a capture interrupted by a restart can leave it frozen: state()/resume()
    # checkpoint_running(): capture memory while the sandbox keeps running (frozen only for the image
    # and a callback that captures its disk at the same instant); without it a capture stops the sandbox
    captures_running: bool = False
    # The sandbox's root filesystem is the host's overlay mount, kept coherent with what programs in the
    # sandbox write (gVisor writes through to the host file): large file transfers may use it
    # (`agentenv.proxy.hostfiles`)
    shares_rootfs: bool = False
    # A restored sandbox's monotonic clock has moved on by the time since its capture (gVisor's), so
    # the host tells envd how long it was away, for process timeouts that count run time only
    # (`agentenv.orchestrator.continuity`); a VM's guest clock stands still while it is saved
    restore_advances_clock: bool = False


class Runtime(Protocol):
    name: str

    @property
    def traits(self) -> RuntimeTraits: ...

    async def close(self) -> None:
        """Release what the runtime holds for all its sandboxes (API clients, mounts); sandboxes live on."""

    async def start(self, spec: SandboxSpec) -> None:
        """Boot the sandbox; returns once the runtime reports it running (envd may still be starting)."""

    async def stop(self, sandbox_id: str) -> None:
        """Kill and delete; idempotent; leaves no process, mount or cgroup behind."""

    async def is_alive(self, sandbox_id: str) -> bool: ...

    async def pause(self, sandbox_id: str) -> None:
        """Freeze in place (cheap; memory stays allocated)."""

    async def resume(self, sandbox_id: str) -> None: ...

    async def checkpoint(self, sandbox_id: str, image_dir: Path, **options: bool) -> None:
        """Write memory + runtime state to image_dir. The sandbox is stopped afterwards.
        `reset_connections=` only where `traits.resets_connections`; `leave_frozen=` only where
        `traits.may_stay_frozen`: it may be left frozen instead, for the caller to `stop`."""

    async def checkpoint_running(self, sandbox_id: str, image_dir: Path, *,
                                 while_frozen: Callable[[], Awaitable[None]], **options: bool) -> float:
        """Only where `traits.captures_running`: freeze, write memory + runtime state to image_dir, run
        `while_frozen` (the caller captures the disk at the same instant), thaw. The sandbox keeps
        running; if anything fails it is thawed and `CaptureRefused` says why. Returns the seconds
        it was frozen."""

    async def restore(self, spec: SandboxSpec, image_dir: Path) -> None:
        """Start a sandbox from a checkpoint (possibly into another slot/rootfs: a fork child)."""

    async def state(self, sandbox_id: str) -> str | None:
        """The runtime's own state of the sandbox ("running", "paused", ...), None if unknown."""

    async def list_ids(self) -> list[str]:
        """Ids of all sandboxes this runtime knows on this node (to reap orphans after a crash)."""
