"""Runtime selection: which runtimes this host can really run, and which one a sandbox gets.

`runtime = auto | gvisor | firecracker | qemu` (setting `runtime`, env `AGENTENV_RUNTIME`; per
template and per request through the `agentenv.runtime` metadata key, see docs/runtimes.md).

`auto` takes the strongest isolation the host *really* supports, in this order:

    firecracker (hardware KVM) > qemu with KVM > gvisor > qemu with TCG emulation

"Really" means detected *and* proven: `/dev/kvm` alone proves nothing (our CI machines' KVM is
PVM, a software implementation on which stock guest kernels die), so hardware virtualization is
the CPU's vmx/svm flag, and a VMM is only counted once it has booted a probe guest here.

Asking for a VM runtime explicitly never silently degrades: if it cannot run, selection fails
with the reason (`RuntimeUnavailable`, HTTP 400 for a request, a startup error for the server).

Every runtime registers here, the same way (`register`: a factory and a probe that import the
runtime's module lazily); what a runtime can do is its `traits` (runtimes/base.py).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import re
import shutil
import struct
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

from agentenv.config import Settings
from agentenv.errors import BadRequest

log = logging.getLogger(__name__)

CHOICES = ("auto", "gvisor", "firecracker", "qemu")
VM_RUNTIMES = ("firecracker", "qemu")
METADATA_KEY = "agentenv.runtime"   # per-template / per-request choice (E2B metadata is free-form)

# Isolation strength used by `auto` (higher wins); a probe may report a lower one (QEMU under TCG).
STRENGTH_HW_VM = 40
STRENGTH_KVM_VM = 30
STRENGTH_GVISOR = 20
STRENGTH_EMULATED_VM = 10


class RuntimeUnavailable(BadRequest):
    """An explicitly requested runtime cannot run on this host (never downgraded silently)."""


# ------------------------------------------------------------------------------------ host detection


@dataclass(frozen=True)
class HostVirt:
    """What kind of hardware virtualization this host offers."""

    kvm_device: bool          # /dev/kvm exists and opens
    hardware: bool            # the CPU advertises vmx (Intel VT-x) or svm (AMD-V)
    cpu_flag: str | None      # "vmx" | "svm" | None
    pvm: bool                 # the kvm_pvm module (software, pagetable-based KVM) is loaded
    detail: str

    @property
    def kind(self) -> str:
        if not self.kvm_device:
            return "none"
        if self.hardware:
            return "hardware"
        return "pvm" if self.pvm else "unknown"


def detect_virt(cpuinfo: Path = Path("/proc/cpuinfo"), sys_module: Path = Path("/sys/module"),
                kvm: Path = Path("/dev/kvm")) -> HostVirt:
    try:
        flags = re.search(r"^flags\s*:(.*)$", cpuinfo.read_text(), re.M)
        flagset = set(flags.group(1).split()) if flags else set()
    except OSError:
        flagset = set()
    flag = "vmx" if "vmx" in flagset else ("svm" if "svm" in flagset else None)
    pvm = (sys_module / "kvm_pvm").exists()
    try:
        fd = os.open(kvm, os.O_RDWR | os.O_CLOEXEC)
        os.close(fd)
        dev = True
    except OSError:
        dev = False
    if not dev:
        detail = "no usable /dev/kvm"
    elif flag:
        detail = f"hardware virtualization ({'Intel VT-x' if flag == 'vmx' else 'AMD-V'}: '{flag}' in /proc/cpuinfo)"
    elif pvm:
        detail = ("/dev/kvm is PVM (module kvm_pvm: software, pagetable-based KVM) and the CPU has no vmx/svm "
                  "flag: a stock Linux guest kernel's ring-0 code is emulated and dies "
                  "(KVM_EXIT_INTERNAL_ERROR); only PVM-patched guest kernels run")
    else:
        detail = "/dev/kvm present but the CPU advertises no vmx/svm (nested or software KVM)"
    return HostVirt(dev, flag is not None, flag, pvm, detail)


# ------------------------------------------------------------------------------------ boot probe

# A 54-byte 64-bit guest: reloads CR3 (privileged), runs CPUID, prints a marker to the 8250 UART,
# halts. Source (GNU as): mov %cr3,%rax; mov %rax,%cr3; xor %eax,%eax; cpuid; lea msg(%rip),%rsi;
# mov $0x3f8,%dx; 1: lodsb; test %al,%al; jz 2f; outb %al,%dx; jmp 1b; 2: hlt; jmp 2b; msg: .asciz ...
PROBE_MARKER = b"agentenv-vm-probe-ok"
_PROBE_CODE = bytes.fromhex(
    "0f20d80f22d831c00fa2488d350f00000066baf803ac84c07403eeebf8f4ebfd"
) + PROBE_MARKER + b"\n\0"
_PROBE_LOAD = 0x200000


def probe_elf() -> bytes:
    """The probe guest as a minimal ELF64 executable (one PT_LOAD at 2 MiB), built without a toolchain."""
    ehsize, phsize = 64, 56
    off = 0x1000
    ehdr = struct.pack("<16sHHIQQQIHHHHHH", b"\x7fELF\x02\x01\x01" + b"\0" * 9, 2, 0x3E, 1,
                       _PROBE_LOAD, ehsize, 0, 0, ehsize, phsize, 1, 0, 0, 0)
    phdr = struct.pack("<IIQQQQQQ", 1, 5, off, _PROBE_LOAD, _PROBE_LOAD, len(_PROBE_CODE), len(_PROBE_CODE), 0x1000)
    return (ehdr + phdr).ljust(off, b"\0") + _PROBE_CODE


@dataclass
class BootProof:
    ok: bool
    detail: str
    seconds: float = 0.0


async def firecracker_boot_probe(binary: Path, timeout: float = 5.0) -> BootProof:
    """Boot the probe guest in a throw-away Firecracker (no network, no disk) and wait for its marker."""
    from agentenv.runtimes.base import VmBoot
    from agentenv.runtimes.firecracker import CONSOLE_LOG, FirecrackerError, FirecrackerVM, VmSettings

    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="agentenv-fcprobe-") as d:
        work = Path(d)
        (work / "probe.elf").write_bytes(probe_elf())
        vm = FirecrackerVM(binary, work, vm_id=f"probe{os.getpid()}")
        try:
            await vm.spawn()
            await vm.configure(VmBoot(kernel=Path("probe.elf")),
                               VmSettings(vcpus=1, mem_mib=32, track_dirty_pages=False, balloon=False,
                                          net=False, vsock=False, mmds=False), disks=[])
            await vm.start_instance()
            while time.monotonic() - t0 < timeout:
                if PROBE_MARKER in (work / CONSOLE_LOG).read_bytes():
                    return BootProof(True, "probe guest booted", time.monotonic() - t0)
                if not vm.alive():
                    break
                await asyncio.sleep(0.01)
            return BootProof(False, f"probe guest did not boot: {vm.log_tail(400)}", time.monotonic() - t0)
        except (FirecrackerError, OSError) as e:
            return BootProof(False, f"firecracker failed: {e}", time.monotonic() - t0)
        finally:
            await vm.kill()


# ------------------------------------------------------------------------------------ registry


@dataclass
class Probe:
    """One runtime's verdict on this host."""

    runtime: str
    available: bool
    strength: int                   # isolation rank for `auto`; meaningful when available
    reason: str                     # why (not) available, in words a user can act on
    isolation: str = ""             # "hardware VM" | "emulated VM" | "user-space kernel"
    fix: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


ProbeFn = Callable[[Settings, HostVirt], Awaitable[Probe]]
FactoryFn = Callable[[Settings], Any]


@dataclass
class Entry:
    name: str
    factory: FactoryFn
    probe: ProbeFn
    vm: bool


_REGISTRY: dict[str, Entry] = {}

# The guest image builder microVM runtimes need (template -> kernel, initramfs, disks as VmBoot):
# agentenv/storage/guest.py, loaded on first use (`_load_providers`). Until it is, Firecracker is
# not offered by `auto`.
VM_GUEST_IMAGES: Callable[..., Any] | None = None


def register(name: str, factory: FactoryFn, probe: ProbeFn, *, vm: bool) -> None:
    """The one registration path: every runtime is registered below with a factory and a probe
    that import its module only when called, so each runtime module stays optional."""
    _REGISTRY[name] = Entry(name, factory, probe, vm)


def _load_providers() -> None:
    global VM_GUEST_IMAGES
    if VM_GUEST_IMAGES is None:
        try:
            VM_GUEST_IMAGES = importlib.import_module("agentenv.storage.guest").vm_boot
        except ImportError:
            pass


async def _probe_gvisor(settings: Settings, virt: HostVirt) -> Probe:
    path = shutil.which(settings.runsc_path)
    if not path:
        return Probe("gvisor", False, STRENGTH_GVISOR, "runsc not found", "user-space kernel",
                     "apt-get install runsc (or gVisor's release)")
    from agentenv.runtimes.gvisor_platform import MIN_RELEASE, runsc_release

    release = await asyncio.to_thread(runsc_release, path)
    if release is None or release < MIN_RELEASE:
        # Older releases lose a sandbox whose checkpoint they refuse (open TCP connections, epoll).
        return Probe("gvisor", False, STRENGTH_GVISOR, f"runsc at {path} is release {release or 'unknown'}, "
                     f"older than {MIN_RELEASE}", "user-space kernel",
                     "bash scripts/setup.sh (bookworm-backports on Debian 12), or install gVisor's release")
    return Probe("gvisor", True, STRENGTH_GVISOR, f"runsc {release} at {path} (platform {settings.runsc_platform})",
                 "user-space kernel")


def _gvisor(settings: Settings) -> Any:
    from agentenv.runtimes.gvisor import GVisorRuntime

    return GVisorRuntime(settings)


async def _probe_firecracker(settings: Settings, virt: HostVirt) -> Probe:
    from agentenv.runtimes.firecracker import find_firecracker

    binary = find_firecracker(settings.firecracker_path)
    if binary is None:
        return Probe("firecracker", False, STRENGTH_HW_VM, "firecracker binary not found", "hardware VM",
                     "bash scripts/install-firecracker.sh (pinned, sha256-checked) or set AGENTENV_FIRECRACKER_PATH")
    if not virt.kvm_device:
        return Probe("firecracker", False, STRENGTH_HW_VM, f"{virt.detail}: Firecracker needs KVM", "hardware VM",
                     "run on bare metal or a VM with nested virtualization enabled")
    proof = await firecracker_boot_probe(binary)
    extra = {"binary": str(binary), "probe_boot_ok": proof.ok, "probe_boot_s": round(proof.seconds, 3)}
    if not virt.hardware:
        vmm = (f"Firecracker itself runs here (a probe guest booted in {proof.seconds * 1e3:.0f} ms)"
               if proof.ok else f"and Firecracker failed its probe boot ({proof.detail})")
        return Probe("firecracker", False, STRENGTH_HW_VM,
                     f"cannot boot a Linux guest: {virt.detail}. {vmm}", "hardware VM",
                     "use a host with Intel VT-x / AMD-V (bare metal, or nested virtualization enabled)", extra)
    if not proof.ok:
        return Probe("firecracker", False, STRENGTH_HW_VM, proof.detail, "hardware VM", None, extra)
    if VM_GUEST_IMAGES is None:
        return Probe("firecracker", False, STRENGTH_HW_VM,
                     f"{virt.detail} and the VMM boots, but no microVM guest image builder is registered "
                     "(select.VM_GUEST_IMAGES, agentenv/storage/guest.py)", "hardware VM", None, extra)
    return Probe("firecracker", True, STRENGTH_HW_VM,
                 f"{virt.detail}; probe guest booted in {proof.seconds * 1e3:.0f} ms", "hardware VM", None, extra)


def _firecracker(settings: Settings) -> Any:
    from agentenv.runtimes.firecracker import FirecrackerRuntime, find_firecracker

    return FirecrackerRuntime(settings.data_dir, binary=find_firecracker(settings.firecracker_path),
                              images_dir=settings.paths.images)


async def _probe_qemu(settings: Settings, virt: HostVirt) -> Probe:
    from agentenv.runtimes.qemu import probe

    return await probe(settings, virt)


def _qemu(settings: Settings) -> Any:
    from agentenv.runtimes.qemu import QemuRuntime

    return QemuRuntime(settings)


register("gvisor", _gvisor, _probe_gvisor, vm=False)
register("firecracker", _firecracker, _probe_firecracker, vm=True)
register("qemu", _qemu, _probe_qemu, vm=True)


# ------------------------------------------------------------------------------------ choosing


@dataclass
class Selection:
    runtime: str
    requested: str
    reason: str                   # full: why this one, and why each stronger one is unavailable
    probes: list[Probe]
    virt: HostVirt
    summary: str = ""             # one line for tables


_cache: dict[tuple, tuple[float, list[Probe]]] = {}
_CACHE_S = 300.0


async def probe_all(settings: Settings, virt: HostVirt | None = None, *, fresh: bool = False,
                    only: str | None = None) -> list[Probe]:
    """Every registered runtime's probe, or just `only`'s (cached for a few minutes: probes boot VMs)."""
    _load_providers()
    virt = virt or detect_virt()
    key = (settings.runsc_path, settings.firecracker_path, virt, only)
    hit = _cache.get(key)
    if hit and not fresh and time.monotonic() - hit[0] < _CACHE_S:
        return hit[1]
    probes = []
    for e in _REGISTRY.values():
        if only is not None and e.name != only:
            continue
        try:
            probes.append(await e.probe(settings, virt))
        except Exception as ex:  # noqa: BLE001 - a broken probe makes its runtime unavailable, not the server
            probes.append(Probe(e.name, False, 0, f"probe failed: {ex}"))
    _cache[key] = (time.monotonic(), probes)
    return probes


def normalise(value: str | None) -> str | None:
    if value is None or value == "":
        return None
    v = value.strip().lower()
    if v not in CHOICES:
        raise RuntimeUnavailable(f"unknown runtime {value!r}: choose one of {', '.join(CHOICES)}")
    return v


async def choose(settings: Settings, requested: str | None = None, *, virt: HostVirt | None = None,
                 probes: list[Probe] | None = None) -> Selection:
    """The runtime for `requested` (None: the configured default). Never downgrades an explicit choice."""
    virt = virt or detect_virt()
    want = normalise(requested) or normalise(settings.runtime) or "auto"
    if probes is None:   # an explicit choice needs only its own verdict (no probe boots for the others)
        probes = await probe_all(settings, virt, only=None if want == "auto" else want)
    by_name = {p.runtime: p for p in probes}
    if want != "auto":
        p = by_name.get(want)
        if p is None:
            raise RuntimeUnavailable(f"runtime {want!r} is not built into this agentenv")
        if not p.available:
            fix = f" Fix: {p.fix}." if p.fix else ""
            raise RuntimeUnavailable(f"runtime {want!r} was requested but cannot run on this host: {p.reason}.{fix} "
                                     "(no fallback to another runtime: ask for 'auto' to let agentenv choose)")
        return Selection(want, want, f"requested explicitly; {p.reason}", probes, virt, f"{want} (requested)")
    ok = sorted((p for p in probes if p.available), key=lambda p: -p.strength)
    if not ok:
        raise RuntimeUnavailable("no runtime can run on this host: " +
                                 "; ".join(f"{p.runtime}: {p.reason}" for p in probes))
    best = ok[0]
    skipped = [f"{p.runtime}: {p.reason}" for p in probes
               if not p.available and p.strength > best.strength]
    why = f"strongest available isolation ({best.isolation or best.runtime}): {best.reason}"
    if skipped:
        why += " | stronger but unavailable: " + "; ".join(skipped)
    names = [p.runtime for p in probes if not p.available and p.strength > best.strength]
    summary = f"{best.runtime} ({best.isolation or 'available'})" + (
        f"; stronger but unavailable here: {', '.join(names)}" if names else "")
    return Selection(best.runtime, "auto", why, probes, virt, summary)


def build(settings: Settings, name: str) -> Any:
    _load_providers()
    e = _REGISTRY.get(name)
    if e is None:
        raise RuntimeUnavailable(f"runtime {name!r} is not built into this agentenv")
    return e.factory(settings)


def is_vm(name: str) -> bool:
    e = _REGISTRY.get(name)
    return bool(e and e.vm)


async def resolve_request(settings: Settings, requested: str | None, served: list[str]) -> str:
    """The runtime a sandbox gets: `requested` (its template's or its create request's choice,
    metadata `agentenv.runtime`) among the runtimes this node serves (`served[0]` is the default).

    `auto`/absent take the default. A runtime the node does not serve fails with the reason: the
    host's, when that runtime cannot run here at all (e.g. Firecracker on PVM), else that this node
    does not serve it. Never a silent substitution.
    """
    want = normalise(requested)
    if want in (None, "auto"):
        return served[0]
    if want in served:
        return want
    await choose(settings, want)   # raises RuntimeUnavailable with the host's reason
    raise RuntimeUnavailable(f"runtime {want!r} can run on this host, but this node serves "
                             f"{', '.join(repr(n) for n in served)}; start the server with "
                             f"AGENTENV_EXTRA_RUNTIMES={want} (or AGENTENV_RUNTIME={want}) for {want} sandboxes")