"""Host checks for `agentenv doctor`: what is missing, and how to fix it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from agentenv.config import Settings


@dataclass
class Check:
    name: str
    status: str  # ok | warn | fail | info
    detail: str
    fix: str | None = None


def _run(argv: list[str], timeout: float = 10.0) -> tuple[int, str]:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        return p.returncode, (p.stdout + p.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return 127, str(e)


def check_python() -> Check:
    ok = sys.version_info >= (3, 11)
    return Check("python", "ok" if ok else "fail", sys.version.split()[0], None if ok else "install Python >= 3.11")


def check_root() -> Check:
    root = os.geteuid() == 0
    return Check("root", "ok" if root else "fail", f"euid={os.geteuid()}",
                 None if root else "run agentenv as root (netns, mounts, runsc need it)")


RUNSC_FIX = ("bash scripts/setup.sh installs the current runsc (gVisor >= {min}): from bookworm-backports on "
             "Debian 12, from the distribution on Debian 13 / Ubuntu; or install gVisor's release "
             "(https://gvisor.dev/docs/user_guide/install/)")


def check_runsc(settings: Settings) -> Check:
    """runsc's path and release (fails below MIN_RELEASE), and the platform it runs sandboxes on here."""
    import asyncio

    from agentenv.errors import RuntimeFailure
    from agentenv.runtimes.gvisor_platform import MIN_RELEASE, choose_platform, default_cache_dir, runsc_release

    name = "runsc (gVisor)"
    fix = RUNSC_FIX.format(min=MIN_RELEASE)
    path = shutil.which(settings.runsc_path)
    if not path:
        return Check(name, "fail", f"{settings.runsc_path}: not found", fix)
    release = runsc_release(path)
    if release is not None and release < MIN_RELEASE:
        return Check(name, "fail", f"{path}: release {release}, older than {MIN_RELEASE} (no systrap, "
                     "checkpoints of epoll servers and TCP connections lose the sandbox)", fix)
    try:
        choice = asyncio.run(choose_platform(path, settings.runsc_platform, default_cache_dir(settings.data_dir),
                                             fresh=True))
    except RuntimeFailure as e:
        return Check(name, "fail", f"{path}: release {release or '?'}; platform {settings.runsc_platform}: "
                     f"{e.message}", "set AGENTENV_GVISOR_PLATFORM=auto (or runsc_platform = \"auto\" in the config file)")
    probed = ", ".join(f"{p}={'ok' if r == 'ok' else 'no'}" for p, r in sorted(choice.probed.items()))
    detail = (f"{path}: release {release or '?'}; platform {choice.platform} "
              f"({settings.runsc_platform}: {choice.reason}) [probed: {probed}]")
    if release is None:  # e.g. a self-built runsc: it runs, but we cannot tell whether it is new enough
        return Check(name, "warn", detail, f"no release date in `{path} --version`: agentenv needs {MIN_RELEASE} "
                     f"or newer; {fix}")
    return Check(name, "ok", detail)


def check_tool(name: str, pkg: str, why: str) -> Check:
    path = shutil.which(name)
    return Check(name, "ok" if path else "fail", path or f"not found ({why})", None if path else f"apt-get install {pkg}")


def check_netns() -> Check:
    if not shutil.which("ip"):
        return Check("network namespaces", "fail", "`ip` not found", "apt-get install iproute2")
    name = f"agentenv-doctor-{uuid.uuid4().hex[:6]}"
    rc, out = _run(["ip", "netns", "add", name])
    if rc != 0:
        return Check("network namespaces", "fail", out[:120], "run as root on a kernel with CONFIG_NET_NS")
    _run(["ip", "netns", "del", name])
    return Check("network namespaces", "ok", "create/delete works")


def check_cgroups() -> Check:
    root = Path("/sys/fs/cgroup")
    if (root / "cgroup.controllers").exists():
        ctrls = (root / "cgroup.controllers").read_text().split()
        missing = [c for c in ("cpu", "memory", "pids") if c not in ctrls]
        return Check("cgroups", "warn" if missing else "ok", f"v2: {' '.join(ctrls)}",
                     f"enable controllers: {', '.join(missing)}" if missing else None)
    have = [c for c in ("cpu", "memory", "pids") if (root / c).exists()]
    missing = [c for c in ("cpu", "memory", "pids") if c not in have]
    return Check("cgroups", "warn" if missing else "ok", f"v1: {' '.join(have)}",
                 f"mount the {', '.join(missing)} controller(s) for resource limits" if missing else None)


def check_overlay() -> Check:
    fs = Path("/proc/filesystems").read_text()
    ok = "overlay" in fs
    return Check("overlayfs", "ok" if ok else "fail", "supported" if ok else "missing",
                 None if ok else "modprobe overlay (sandbox rootfs = base image + writable layer)")


def check_kvm() -> Check:
    """Which kind of KVM, if any: hardware (vmx/svm), software PVM, or none (microVM runtimes)."""
    from agentenv.runtimes.select import detect_virt

    virt = detect_virt()
    if virt.kind == "none":
        return Check("KVM", "info", f"{virt.detail}: microVM runtimes unavailable (gVisor works)")
    if virt.kind == "hardware":
        return Check("KVM", "ok", f"{virt.detail}: Firecracker / QEMU+KVM can boot Linux guests")
    if virt.kind == "pvm":
        return Check("KVM", "info", virt.detail)
    return Check("KVM", "warn", virt.detail)


def check_runtimes(settings: Settings) -> list[Check]:
    """Every runtime's verdict (VMMs boot a probe guest) and what `runtime = auto` picks."""
    import asyncio

    from agentenv.runtimes import select

    async def go() -> tuple[list[select.Probe], select.Selection | None, str | None]:
        virt = select.detect_virt()
        probes = await select.probe_all(settings, virt, fresh=True)
        try:
            return probes, await select.choose(settings, virt=virt, probes=probes), None
        except select.RuntimeUnavailable as e:
            return probes, None, e.message

    probes, sel, err = asyncio.run(go())
    out = []
    for p in probes:
        status = "ok" if p.available else ("info" if p.runtime in select.VM_RUNTIMES else "fail")
        out.append(Check(f"runtime {p.runtime}", status, p.reason, p.fix))
    if sel is None:
        out.append(Check(f"runtime selection ({settings.runtime})", "fail", err or "no runtime",
                         "see the runtime rows above"))
    else:
        out.append(Check(f"runtime selection ({settings.runtime})", "ok", sel.summary))
    return out


def check_disk(settings: Settings) -> Check:
    p = settings.data_dir
    while not p.exists():
        p = p.parent
    st = os.statvfs(p)
    free_gb = st.f_bavail * st.f_frsize / 1e9
    status = "ok" if free_gb >= 5 else ("warn" if free_gb >= 1 else "fail")
    return Check("free disk", status, f"{free_gb:.1f} GB free at {p}",
                 None if status == "ok" else "free space: the base image needs ~0.5 GB, each sandbox its changes")


def check_data_plane(settings: Settings) -> Check:
    """HAProxy serves sandbox traffic (and HTTPS) when installed; otherwise the Python proxy does."""
    from agentenv.proxy.haproxy import haproxy_binary

    path = haproxy_binary(settings.haproxy_path)
    if settings.data_plane == "python":
        return Check("data plane", "info", "the Python proxy (data_plane = python)")
    if path is None:
        status = "fail" if settings.data_plane == "haproxy" or settings.https_bind else "warn"
        return Check("data plane", status, "haproxy not found: the Python proxy serves sandbox traffic "
                     "(about 5x slower, no HTTPS)", "apt-get install haproxy")
    rc, out = _run([path, "-v"])
    version = out.split("version", 1)[1].split()[0] if rc == 0 and "version" in out else "?"
    return Check("data plane", "ok", f"haproxy {version} ({path})")


def run_checks(settings: Settings) -> list[Check]:
    return [
        check_python(), check_root(), check_runsc(settings),
        check_tool("debootstrap", "debootstrap", "builds the base image"),
        check_tool("nft", "nftables", "sandbox NAT and egress rules"),
        check_netns(), check_cgroups(), check_overlay(), check_kvm(), *check_runtimes(settings),
        check_disk(settings), check_data_plane(settings),
        Check("data dir", "info", str(settings.data_dir)),
    ]
