"""Firecracker runtime: one microVM (own guest kernel) per sandbox, driven over its API socket.

Design, and why:
- **One Firecracker process per sandbox**, in the sandbox's network namespace (the slot netns), its
  current directory a per-sandbox *work dir* on a reflink-capable store (`storage/reflink.py`).
  Every path we give Firecracker (disks, vsock socket, snapshot files) is **relative to that work
  dir**. A snapshot therefore names `rootfs.raw`, not a host path, and restoring it in another work
  dir (a fork child) opens that child's own disk and socket: no rewriting of snapshot state. The
  jailer (optional) gives the same picture, the work dir being its chroot.
- **API client**: one kept aiohttp session over the Unix socket per VM (`FirecrackerApi`).
- **Network**: a tap `tap0` in the slot netns, bridged with the slot's guest-side veth end (`eth0`),
  so the guest answers at the slot's fixed guest address behind the gateway veth exactly as a gVisor
  sandbox does; a restore into a fresh slot finds its own `tap0`: identical guest addressing.
- **Memory**: restores use the File backend, which maps the memory image `MAP_PRIVATE`: clones of
  one image share its page cache and copy only pages they write. Images are never written after
  a VM maps them.
- **Checkpoints**: a VM restored from an image keeps dirty-page tracking, so its next checkpoint is
  a *diff* snapshot (cost ∝ pages written since the restore) merged onto a reflink copy of its base
  image; a booted VM takes a full snapshot.
- **Balloon** with `deflate_on_oom` (and free-page reporting where the VMM supports it: 1.12 does
  not); **MMDS** (V2) carries the sandbox's identity and tokens and is rewritten after every restore
  (fork children get their own); **vsock** at `vsock.sock` in the work dir.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import aiohttp

from agentenv import constants
from agentenv.errors import RuntimeFailure
from agentenv.network.slots import GUEST_LINK
from agentenv.proc import run_cmd
from agentenv.runtimes.base import RuntimeTraits, SandboxSpec, VmBoot, VmDisk
from agentenv.storage import reflink as rl

log = logging.getLogger(__name__)

DEFAULT_FIRECRACKER_DIR = Path("/usr/local/lib/agentenv/firecracker")
FIRECRACKER_VERSION = "1.12.1"

API_SOCK = "api.sock"
VSOCK_SOCK = "vsock.sock"
CONSOLE_LOG = "console.log"     # guest serial console (Firecracker's stdout)
VMM_LOG = "firecracker.log"     # Firecracker's own log
META = "vm.json"                # what the runtime needs to find and re-adopt the VM
STATE_FILE = "vm.state"         # snapshot: device + vCPU state
MEMORY_FILE = "memory"          # snapshot: guest memory (full image)
TAP = "tap0"
BRIDGE = "fcbr0"
GUEST_CID = 3
API_TIMEOUT = 30.0
SNAPSHOT_TIMEOUT = 600.0
SPAWN_TIMEOUT = 10.0


class FirecrackerError(RuntimeFailure):
    """Firecracker refused an API call or died."""


def find_firecracker(configured: str | None = None) -> Path | None:
    """The firecracker binary: configured path, our install dir, then $PATH."""
    cands = [configured] if configured else []
    cands += [str(DEFAULT_FIRECRACKER_DIR / "firecracker"), shutil.which("firecracker") or ""]
    for c in cands:
        if c and os.access(c, os.X_OK):
            return Path(c)
    return None


# ---------------------------------------------------------------------------------------- API client


class FirecrackerApi:
    """A kept HTTP/1.1 client on one VM's API socket; raises FirecrackerError with its fault_message."""

    def __init__(self, sock: Path, alive: Callable[[], bool] | None = None) -> None:
        self.sock = sock
        # Until the first answer, a refused connection means "not listening yet" (retried while
        # `alive()`), which saves a readiness round trip per VM start.
        self._alive = alive
        self._answered = False
        self._session = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=str(sock), limit=1),
            base_url="http://firecracker", timeout=aiohttp.ClientTimeout(total=API_TIMEOUT))

    async def call(self, method: str, path: str, body: Any = None, *, timeout: float = API_TIMEOUT) -> Any:
        t0 = time.monotonic()
        while True:
            try:
                async with self._session.request(method, path, json=body,
                                                 timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                    text = await r.text()
                self._answered = True
                break
            except aiohttp.ClientConnectorError as e:
                if (self._answered or self._alive is None or not self._alive()
                        or time.monotonic() - t0 > SPAWN_TIMEOUT):
                    raise FirecrackerError(f"firecracker API {method} {path}: {e}") from None
                await asyncio.sleep(0.001)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                raise FirecrackerError(f"firecracker API {method} {path}: {type(e).__name__}: {e}") from None
        log.debug("firecracker %s %s -> %d in %.1f ms", method, path, r.status, (time.monotonic() - t0) * 1e3)
        if r.status >= 300:
            try:
                msg = json.loads(text).get("fault_message", text)
            except ValueError:
                msg = text
            raise FirecrackerError(f"firecracker API {method} {path} -> {r.status}: {msg}")
        return json.loads(text) if text.strip() else None

    async def get(self, path: str) -> Any:
        return await self.call("GET", path)

    async def put(self, path: str, body: Any, **kw: Any) -> Any:
        return await self.call("PUT", path, body, **kw)

    async def patch(self, path: str, body: Any, **kw: Any) -> Any:
        return await self.call("PATCH", path, body, **kw)

    async def close(self) -> None:
        await self._session.close()


# ---------------------------------------------------------------------------------------- one VM


@dataclass
class VmSettings:
    """How a VM is configured (what a snapshot then carries)."""

    vcpus: int = 2
    mem_mib: int = 1024
    track_dirty_pages: bool = True       # diff snapshots
    balloon: bool = True
    balloon_stats_s: int = 1
    net: bool = True                      # tap0 in the netns
    vsock: bool = True
    mmds: bool = True                     # needs net
    guest_mac: str = "06:00:ac:10:00:02"  # = storage.guest.GUEST_MAC: the guest init looks for it


@dataclass
class VmMeta:
    """Persisted in the work dir: enough to re-adopt, checkpoint or stop the VM after a server restart."""

    sandbox_id: str
    pid: int
    netns_path: str | None
    base_memory: str | None = None        # image this VM was restored from (diff snapshots build on it)
    writable: list[str] = field(default_factory=list)   # relative names of its writable disks
    disks: list[dict] = field(default_factory=list)      # VmDisk fields (+ "source": the template's file)
    jailed: bool = False
    free_page_reporting: bool = False
    started_at: float = field(default_factory=time.time)
    bundle_dir: str | None = None         # the orchestrator's per-sandbox dir: logs are kept there on stop


@dataclass
class JailerConfig:
    """Run Firecracker under its jailer: chroot, uid/gid drop, own cgroup (production hardening)."""

    binary: Path
    uid: int = 0
    gid: int = 0
    chroot_base: Path | None = None      # default: <store>/jail


class FirecrackerVM:
    """One Firecracker process and its API client. All guest-visible paths are relative to `workdir`."""

    def __init__(self, binary: Path, workdir: Path, *, vm_id: str, netns_path: str | None = None,
                 jailer: JailerConfig | None = None) -> None:
        self.binary = binary
        self.vm_id = vm_id
        self.netns_path = netns_path
        self.jailer = jailer
        if jailer is not None:
            base = jailer.chroot_base or workdir.parent / "jail"
            self.jail_dir = base / binary.name / vm_id
            self.workdir = self.jail_dir / "root"     # the chroot: Firecracker's "/" and cwd
        else:
            self.jail_dir = None
            self.workdir = workdir
        self.proc: asyncio.subprocess.Process | None = None
        self.pid: int | None = None
        self.api: FirecrackerApi | None = None
        self.free_page_reporting = False

    @property
    def sock(self) -> Path:
        return self.workdir / API_SOCK

    async def spawn(self) -> None:
        """Start the VMM process (no guest yet) and wait for its API socket."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.sock.unlink(missing_ok=True)
        (self.workdir / VMM_LOG).touch()
        if self.jailer is not None and (self.jailer.uid or self.jailer.gid):
            # The jailed VMM runs as uid:gid: it creates its socket and snapshot files in the work dir.
            for p in (self.workdir, self.workdir / VMM_LOG):
                os.chown(p, self.jailer.uid, self.jailer.gid)
        fc_args = ["--api-sock", API_SOCK, "--log-path", VMM_LOG, "--level", "Warning"]
        if self.jailer is None:
            argv = [str(self.binary), "--id", self.vm_id, *fc_args]
            if self.netns_path:
                argv = ["nsenter", f"--net={self.netns_path}", "--", *argv]
            cwd = self.workdir
        else:
            j = self.jailer
            argv = [str(j.binary), "--id", self.vm_id, "--exec-file", str(self.binary), "--uid", str(j.uid),
                    "--gid", str(j.gid), "--chroot-base-dir", str(self.jail_dir.parent.parent)]
            if Path("/sys/fs/cgroup/cgroup.controllers").exists():
                argv += ["--cgroup-version", "2"]
            if self.netns_path:
                argv += ["--netns", self.netns_path]
            argv += ["--", *fc_args]
            cwd = self.jail_dir.parent
        console = open(self.workdir / CONSOLE_LOG, "ab")
        try:
            # Own session: a signal to the server's process group must not take the VMs with it.
            self.proc = await asyncio.create_subprocess_exec(
                *argv, cwd=cwd, stdin=asyncio.subprocess.DEVNULL, stdout=console, stderr=console,
                start_new_session=True)
        finally:
            console.close()
        self.pid = self.proc.pid
        proc = self.proc
        self.api = FirecrackerApi(self.sock, alive=lambda: proc.returncode is None)
        deadline = time.monotonic() + SPAWN_TIMEOUT
        while True:
            if self.proc.returncode is not None:
                raise FirecrackerError(f"firecracker exited at start (rc={self.proc.returncode}): {self.log_tail()}")
            if self.sock.exists():
                return   # the first API call retries until the VMM listens
            if time.monotonic() > deadline:
                raise FirecrackerError(f"firecracker API socket not ready after {SPAWN_TIMEOUT:.0f}s: {self.log_tail()}")
            await asyncio.sleep(0.002)

    def adopt(self, pid: int) -> None:
        """Attach to a VM started by an earlier server process."""
        self.pid = pid
        self.api = FirecrackerApi(self.sock)

    def log_tail(self, limit: int = 1500) -> str:
        out = []
        for name in (VMM_LOG, CONSOLE_LOG):
            try:
                out.append((self.workdir / name).read_text(errors="replace")[-limit:].strip())
            except OSError:
                pass
        return " | ".join(o for o in out if o) or "(no log)"

    async def configure(self, boot: VmBoot, vm: VmSettings, *, disks: list[VmDisk],
                        mmds: dict | None = None) -> None:
        """Everything before InstanceStart; `disks` paths must be relative to the work dir."""
        api = self._api()
        await api.put("/machine-config", {"vcpu_count": vm.vcpus, "mem_size_mib": vm.mem_mib,
                                          "track_dirty_pages": vm.track_dirty_pages})
        src: dict[str, Any] = {"kernel_image_path": str(boot.kernel), "boot_args": boot.cmdline}
        if boot.initrd is not None:
            src["initrd_path"] = str(boot.initrd)
        await api.put("/boot-source", src)
        for d in disks:
            await api.put(f"/drives/{d.drive_id}", {"drive_id": d.drive_id, "path_on_host": str(d.path),
                                                    "is_root_device": d.root, "is_read_only": d.read_only})
        if vm.net:
            await api.put(f"/network-interfaces/{GUEST_LINK}", {"iface_id": GUEST_LINK, "host_dev_name": TAP,
                                                                 "guest_mac": vm.guest_mac})
            if vm.mmds:
                await api.put("/mmds/config", {"version": "V2", "network_interfaces": [GUEST_LINK]})
        if vm.vsock:
            await api.put("/vsock", {"guest_cid": GUEST_CID, "uds_path": VSOCK_SOCK})
        if vm.balloon:
            await self._put_balloon(vm)
        if mmds is not None and vm.net and vm.mmds:
            await self.set_mmds(mmds)

    async def _put_balloon(self, vm: VmSettings) -> None:
        body = {"amount_mib": 0, "deflate_on_oom": True, "stats_polling_interval_s": vm.balloon_stats_s,
                "free_page_reporting": True}
        try:
            await self._api().put("/balloon", body)
            self.free_page_reporting = True
        except FirecrackerError as e:
            if "free_page_reporting" not in str(e):
                raise
            # Firecracker < 1.14 has no free-page reporting: keep the balloon for deflate-on-OOM
            # and explicit inflation (the host reclaims what the guest hands back).
            body.pop("free_page_reporting")
            await self._api().put("/balloon", body)
            self.free_page_reporting = False

    async def set_mmds(self, data: dict) -> None:
        await self._api().put("/mmds", data)

    async def start_instance(self) -> None:
        await self._api().put("/actions", {"action_type": "InstanceStart"})

    async def pause(self) -> None:
        await self._api().patch("/vm", {"state": "Paused"})

    async def resume(self) -> None:
        await self._api().patch("/vm", {"state": "Resumed"})

    async def snapshot(self, *, diff: bool, state: str = STATE_FILE, memory: str = MEMORY_FILE) -> None:
        """Write state + memory into the work dir (VM must be paused)."""
        await self._api().put("/snapshot/create", {"snapshot_type": "Diff" if diff else "Full",
                                                   "snapshot_path": state, "mem_file_path": memory},
                              timeout=SNAPSHOT_TIMEOUT)

    async def load(self, state: str, memory: str, *, track_dirty_pages: bool = True, resume: bool = True) -> None:
        """Restore a snapshot into this (fresh) process; memory is mapped copy-on-write (File backend)."""
        await self._api().put("/snapshot/load", {
            "snapshot_path": state, "mem_backend": {"backend_type": "File", "backend_path": memory},
            "enable_diff_snapshots": track_dirty_pages, "resume_vm": resume}, timeout=SNAPSHOT_TIMEOUT)

    async def info(self) -> dict:
        return await self._api().get("/")

    async def balloon(self) -> dict:
        return await self._api().get("/balloon")

    def alive(self) -> bool:
        return self.pid is not None and _pid_is_vmm(self.pid, self.vm_id)

    async def kill(self) -> None:
        """SIGKILL the VMM and wait until the process is gone (idempotent)."""
        if self.api is not None:
            await self.api.close()
        if self.pid is None:
            return
        if self.proc is not None:   # our child: its Process knows whether it is still there
            if self.proc.returncode is None:
                try:
                    self.proc.kill()
                except ProcessLookupError:
                    pass
            await self.proc.wait()
            return
        # Adopted after a restart: not our child (init reaps it). Only signal the pid while it is
        # still this VM's VMM — a pid can be reused once the VMM is gone.
        if not _pid_is_vmm(self.pid, self.vm_id):
            return
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 10
        while _pid_is_vmm(self.pid, self.vm_id) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    def _api(self) -> FirecrackerApi:
        if self.api is None:
            raise FirecrackerError("VM not started")
        return self.api


def _pid_is_vmm(pid: int, vm_id: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return False
    except OSError:
        return False
    return vm_id.encode() in argv


# ---------------------------------------------------------------------------------------- network


_taps_ready: set[tuple[str, int]] = set()   # (netns path, netns inode) known to have our tap

# In the slot netns (idempotent): the guest, not the netns, owns the guest address, so it comes off
# the guest-side veth end, which is bridged with the VMM's tap; bridged frames must not meet the
# slot's IP rules even where br_netfilter is loaded.
_TAP_SH = f"""
set -e
ip addr flush dev {GUEST_LINK}
for f in /proc/sys/net/bridge/bridge-nf-call-iptables /proc/sys/net/bridge/bridge-nf-call-ip6tables \\
         /proc/sys/net/bridge/bridge-nf-call-arptables; do [ -e "$f" ] && echo 0 > "$f"; done
ip link show {BRIDGE} >/dev/null 2>&1 || ip link add {BRIDGE} type bridge
ip link show {TAP} >/dev/null 2>&1 || ip tuntap add {TAP} mode tap@OWNER@
echo 1 > /proc/sys/net/ipv6/conf/{BRIDGE}/disable_ipv6 2>/dev/null || true
ip link set {GUEST_LINK} master {BRIDGE}
ip link set {TAP} master {BRIDGE}
ip link set {BRIDGE} up
ip link set {TAP} up
ip link set {GUEST_LINK} up
"""


async def setup_tap(netns_path: str | None, owner: int | None = None) -> None:
    """tap0 in the slot netns, bridged with the guest-side veth end, so the guest owns GUEST_IP (idempotent).

    One short script per new netns; a netns this process already set up (same path *and* inode: a
    released slot's name can come back as a new netns) costs nothing.
    """
    if netns_path is None:
        return
    key = (netns_path, os.stat(netns_path).st_ino)
    if key in _taps_ready:
        return
    script = _TAP_SH.replace("@OWNER@", f" user {owner}" if owner else "")
    await run_cmd(["nsenter", f"--net={netns_path}", "sh", "-c", script], timeout=10, what="tap setup")
    if len(_taps_ready) > 4096:
        _taps_ready.clear()
    _taps_ready.add(key)


# ---------------------------------------------------------------------------------------- runtime


class FirecrackerRuntime:
    """The Runtime protocol on Firecracker microVMs.

    Boots `spec.vm` when given (tests, other guests); otherwise the microVM guest image shared with
    the QEMU runtime (`storage/guest.py`: uncompressed vmlinux, initramfs, the sandbox's root drive
    built from `spec.rootfs`/`spec.lowers`, the tools drive with envd). Writable disks are
    reflink-copied per sandbox; read-only ones are shared (symlinked, or hard-linked into a jail).
    """

    name = "firecracker"
    traits = RuntimeTraits(vm=True, boots_from_spec=True)
    # A VM snapshot keeps the guest kernel's TCP connections: the orchestrator need not drain them.
    keeps_tcp_across_checkpoint = True

    def __init__(self, data_dir: Path, *, binary: Path | None = None, jailer: JailerConfig | None = None,
                 vm_defaults: VmSettings | None = None, store: rl.ReflinkStore | None = None,
                 images_dir: Path | None = None) -> None:
        found = binary or find_firecracker()
        if found is None:
            raise RuntimeFailure("firecracker binary not found: run scripts/install-firecracker.sh "
                                 "or set AGENTENV_FIRECRACKER_PATH")
        self.binary = found
        self.jailer = jailer
        self.vm_defaults = vm_defaults or VmSettings()
        self.store = store or rl.ReflinkStore(data_dir)
        self.images_dir = images_dir or data_dir / "images"
        self._vms: dict[str, FirecrackerVM] = {}
        self._root: Path | None = None

    # -------------------------------------------------------------- paths

    @property
    def root(self) -> Path:
        if self._root is None:
            self._root = self.store.ensure()
            (self._root / "vms").mkdir(exist_ok=True)
            (self._root / "cache").mkdir(exist_ok=True)
        return self._root

    def workdir(self, sandbox_id: str) -> Path:
        if self.jailer is not None:
            base = self.jailer.chroot_base or self.root / "jail"
            return base / self.binary.name / sandbox_id / "root"
        return self.root / "vms" / sandbox_id

    def _vm(self, sandbox_id: str, netns_path: str | None = None) -> FirecrackerVM:
        vm = self._vms.get(sandbox_id)
        if vm is None:
            vm = FirecrackerVM(self.binary, self.root / "vms" / sandbox_id, vm_id=sandbox_id,
                               netns_path=netns_path, jailer=self._jailer())
            meta = self._read_meta(vm)
            if meta is not None:
                vm.adopt(meta.pid)
                vm.netns_path = meta.netns_path
            self._vms[sandbox_id] = vm
        return vm

    def _uid(self) -> int | None:
        return self.jailer.uid if self.jailer is not None and self.jailer.uid else None

    def _jailer(self) -> JailerConfig | None:
        if self.jailer is not None and self.jailer.chroot_base is None:
            self.jailer.chroot_base = self.root / "jail"
        return self.jailer

    def _meta_path(self, vm: FirecrackerVM) -> Path:
        # Outside the work dir: a jailed (possibly compromised) VMM owns its work dir, never our records.
        return self.root / "meta" / f"{vm.vm_id}.json"

    def _read_meta(self, vm: FirecrackerVM) -> VmMeta | None:
        try:
            return VmMeta(**json.loads(self._meta_path(vm).read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def _write_meta(self, vm: FirecrackerVM, meta: VmMeta) -> None:
        path = self._meta_path(vm)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(meta)))
        os.replace(tmp, path)

    def _cached(self, path: Path) -> Path:
        """`path` itself when it is on the store's filesystem, else a copy in the store (made once)."""
        if os.stat(path).st_dev == os.stat(self.root).st_dev:
            return path
        st = path.stat()
        key = f"{abs(hash((str(path.resolve()), st.st_size, st.st_mtime_ns))):x}-{path.name}"
        dst = self.root / "cache" / key
        if not dst.exists():
            rl.sparse_copy(path, dst)
        return dst

    def _place_disks(self, vm: FirecrackerVM, boot: VmBoot, source_dir: Path | None) -> tuple[list[VmDisk], list[str]]:
        """Per-sandbox disks in the work dir: writable ones as reflink copies, read-only ones shared."""
        disks, writable = [], []
        for d in boot.disks:
            name = f"{d.drive_id}.raw"
            dst = vm.workdir / name
            dst.unlink(missing_ok=True)
            if d.read_only:
                if vm.jail_dir is not None:
                    os.link(self._cached(d.path), dst)     # a symlink would point outside the chroot
                else:
                    dst.symlink_to(d.path.resolve())
            else:
                src = source_dir / name if source_dir is not None else self._cached(d.path)
                rl.clone(src, dst)
                if self.jailer is not None and (self.jailer.uid or self.jailer.gid):
                    os.chown(dst, self.jailer.uid, self.jailer.gid)
                writable.append(name)
            disks.append(VmDisk(d.drive_id, Path(name), d.read_only, d.root))
        return disks, writable

    def _stage_boot(self, vm: FirecrackerVM, boot: VmBoot) -> VmBoot:
        """Kernel and initramfs as paths the VMM can open: hard-linked into the chroot when jailed."""
        if vm.jail_dir is None:
            return boot
        staged = VmBoot(kernel=Path("vmlinux"), cmdline=boot.cmdline, disks=boot.disks)
        os.link(self._cached(boot.kernel), vm.workdir / "vmlinux")
        if boot.initrd is not None:
            os.link(self._cached(boot.initrd), vm.workdir / "initrd")
            staged.initrd = Path("initrd")
        return staged

    @staticmethod
    def _mmds(spec: SandboxSpec) -> dict:
        return {"agentenv": {"sandbox_id": spec.sandbox_id, "hostname": spec.hostname,
                             "guest_ip": constants.GUEST_IP, "env": dict(spec.env), "args": list(spec.args)}}

    def _settings(self, spec: SandboxSpec) -> VmSettings:
        vm = VmSettings(**asdict(self.vm_defaults))
        vm.vcpus, vm.mem_mib = spec.cpu_count, spec.memory_mb
        return vm

    # -------------------------------------------------------------- Runtime protocol

    async def guest_boot(self, spec: SandboxSpec, progress: Any = None) -> VmBoot:
        """The shared microVM guest image for `spec` (the orchestrator normally attaches it already)."""
        from agentenv.storage import guest

        return await guest.vm_boot(self.images_dir, spec, progress)

    async def start(self, spec: SandboxSpec) -> None:
        if spec.vm is None:
            spec.vm = await self.guest_boot(spec)
        vm = self._fresh_vm(spec)
        try:
            disks, writable = self._place_disks(vm, spec.vm, None)
            await asyncio.gather(setup_tap(spec.slot.netns_path if self.vm_defaults.net else None, self._uid()),
                                 vm.spawn())
            await vm.configure(self._stage_boot(vm, spec.vm), self._settings(spec), disks=disks,
                               mmds=self._mmds(spec))
            await vm.start_instance()
            self._write_meta(vm, VmMeta(spec.sandbox_id, vm.pid or 0, spec.slot.netns_path, None, writable,
                                        _disk_records(spec.vm), vm.jail_dir is not None,
                                        vm.free_page_reporting, bundle_dir=str(spec.bundle_dir)))
        except BaseException:
            await asyncio.shield(self.stop(spec.sandbox_id))
            raise

    async def restore(self, spec: SandboxSpec, image_dir: Path) -> None:
        """A fresh VMM process from a capture: disks reflinked from it, memory mapped copy-on-write."""
        cap = json.loads((image_dir / META).read_text())
        vm = self._fresh_vm(spec)
        try:
            # The capture's own disk list (with the template's read-only files) unless the caller names one.
            boot = spec.vm or VmBoot(kernel=Path("-"), disks=[
                VmDisk(d["drive_id"], Path(d["source"]), d["read_only"], d["root"]) for d in cap["disks"]])
            _, writable = self._place_disks(vm, boot, image_dir)
            await asyncio.gather(setup_tap(spec.slot.netns_path if cap.get("net", True) else None, self._uid()),
                                 vm.spawn())
            state, memory = self._stage_capture(vm, image_dir)
            if cap.get("net", True) and cap.get("mmds", True):
                # The new identity is in MMDS before the guest runs a single instruction (fork
                # children): the data store is not part of a snapshot and may be filled before loading.
                await vm.set_mmds(self._mmds(spec))
            await vm.load(state, memory, track_dirty_pages=cap.get("track_dirty_pages", True))
            vm.free_page_reporting = bool(cap.get("free_page_reporting", False))
            self._write_meta(vm, VmMeta(spec.sandbox_id, vm.pid or 0, spec.slot.netns_path,
                                        str((image_dir / MEMORY_FILE).resolve()), writable,
                                        _disk_records(boot), vm.jail_dir is not None, vm.free_page_reporting,
                                        bundle_dir=str(spec.bundle_dir)))
        except BaseException:
            await asyncio.shield(self.stop(spec.sandbox_id))
            raise

    def _stage_capture(self, vm: FirecrackerVM, image_dir: Path) -> tuple[str, str]:
        """Paths Firecracker can open for a capture's state + memory (inside the jail when jailed)."""
        if vm.jail_dir is None:
            return str((image_dir / STATE_FILE).resolve()), str((image_dir / MEMORY_FILE).resolve())
        for name in (STATE_FILE, MEMORY_FILE):
            dst = vm.workdir / f"restore-{name}"
            dst.unlink(missing_ok=True)
            os.link(image_dir / name, dst)   # same store filesystem; read-only use
        return f"restore-{STATE_FILE}", f"restore-{MEMORY_FILE}"

    def _fresh_vm(self, spec: SandboxSpec) -> FirecrackerVM:
        old = self._vms.pop(spec.sandbox_id, None)
        if old is not None and old.alive():
            raise RuntimeFailure(f"sandbox {spec.sandbox_id} already has a running VM")
        vm = FirecrackerVM(self.binary, self.root / "vms" / spec.sandbox_id, vm_id=spec.sandbox_id,
                           netns_path=spec.slot.netns_path, jailer=self._jailer())
        if vm.jail_dir is not None:
            shutil.rmtree(vm.jail_dir, ignore_errors=True)
        else:
            shutil.rmtree(vm.workdir, ignore_errors=True)
        vm.workdir.mkdir(parents=True)
        self._vms[spec.sandbox_id] = vm
        return vm

    async def checkpoint(self, sandbox_id: str, image_dir: Path) -> None:
        """Pause, snapshot (diff when restored with dirty tracking), move it to image_dir, stop the VM.

        image_dir gets: vm.state, memory (a full image), one reflink copy per writable disk, vm.json.
        """
        vm = self._vm(sandbox_id)
        meta = self._read_meta(vm)
        if meta is None or not vm.alive():
            raise RuntimeFailure(f"no running firecracker VM for {sandbox_id}")
        image_dir.mkdir(parents=True, exist_ok=True)
        try:
            t0 = time.monotonic()
            await vm.pause()
            base = Path(meta.base_memory) if meta.base_memory else None
            diff = base is not None and base.exists()
            mem_name = "memory.diff" if diff else MEMORY_FILE
            await vm.snapshot(diff=diff, memory=mem_name)
            t1 = time.monotonic()
            for name in (STATE_FILE, mem_name, *meta.writable):
                _regular_file(vm.workdir / name)   # never follow a link a (jailed) VMM may have planted
            self._export(vm.workdir / STATE_FILE, image_dir / STATE_FILE)
            if diff:
                applied = rl.apply_diff(base, vm.workdir / mem_name, image_dir / MEMORY_FILE)
                log.info("%s: diff snapshot %.1f ms, %.1f MiB dirty merged onto its base image", sandbox_id,
                         (t1 - t0) * 1e3, applied / 2**20)
            else:
                self._export(vm.workdir / mem_name, image_dir / MEMORY_FILE)
                log.info("%s: full snapshot %.1f ms", sandbox_id, (t1 - t0) * 1e3)
            (vm.workdir / mem_name).unlink(missing_ok=True)
            for name in (STATE_FILE, MEMORY_FILE):
                # Read-only and ours: restores (maybe jailed under the same uid) map these, never write them.
                if os.geteuid() == 0:
                    os.chown(image_dir / name, 0, 0)
                os.chmod(image_dir / name, 0o444)
            for name in meta.writable:
                rl.clone(vm.workdir / name, image_dir / name)
            cap = {"format": 1, "vmm": "firecracker", "version": FIRECRACKER_VERSION, "disks": meta.disks,
                   "diff_from": str(base) if diff else None, "track_dirty_pages": True,
                   "net": True, "mmds": True, "free_page_reporting": meta.free_page_reporting}
            (image_dir / META).write_text(json.dumps(cap))
        finally:
            await asyncio.shield(self.stop(sandbox_id))

    @staticmethod
    def _export(src: Path, dst: Path) -> None:
        try:
            os.replace(src, dst)           # same filesystem: a rename
        except OSError:
            rl.clone(src, dst)
            src.unlink(missing_ok=True)

    async def stop(self, sandbox_id: str) -> None:
        vm = self._vms.pop(sandbox_id, None) or self._vm(sandbox_id)
        self._vms.pop(sandbox_id, None)
        meta = self._read_meta(vm)
        await vm.kill()
        if meta is not None and meta.bundle_dir:
            _keep_logs(vm.workdir, Path(meta.bundle_dir))
        self._meta_path(vm).unlink(missing_ok=True)
        if vm.jail_dir is not None:
            shutil.rmtree(vm.jail_dir, ignore_errors=True)
            await _remove_jail_cgroups(vm.binary.name, sandbox_id)
        else:
            shutil.rmtree(vm.workdir, ignore_errors=True)

    async def is_alive(self, sandbox_id: str) -> bool:
        return self._vm(sandbox_id).alive()

    async def pause(self, sandbox_id: str) -> None:
        await self._vm(sandbox_id).pause()

    async def resume(self, sandbox_id: str) -> None:
        await self._vm(sandbox_id).resume()

    async def list_ids(self) -> list[str]:
        vms = self.root / "vms"
        ids = [p.name for p in vms.iterdir()] if vms.is_dir() else []
        jail = self.root / "jail" / self.binary.name
        if jail.is_dir():
            ids += [p.name for p in jail.iterdir()]
        metas = self.root / "meta"
        if metas.is_dir():
            ids += [p.stem for p in metas.glob("*.json")]
        return sorted(set(ids))

    async def console(self, sandbox_id: str) -> str:
        """The guest's serial console output so far."""
        vm = self._vm(sandbox_id)
        try:
            return (vm.workdir / CONSOLE_LOG).read_text(errors="replace")
        except OSError:
            return ""

    def vm(self, sandbox_id: str) -> FirecrackerVM:
        """The VM object (its API client) of a sandbox: for tests, benchmarks and diagnostics."""
        return self._vm(sandbox_id)

    async def state(self, sandbox_id: str) -> str | None:
        return "running" if await self.is_alive(sandbox_id) else None

    async def close(self) -> None:
        """Drop the API clients; unmount the loop-mounted VM store when no VM runs any more.

        (Captures and paused sandboxes live in the orchestrator's dirs, template disk copies stay in
        the store's image: nothing is lost, the next start mounts it again.)
        """
        for vm in list(self._vms.values()):
            if vm.api is not None:
                await vm.api.close()
        if self._root is None or not self.store.is_mounted():
            return
        if any(self._vm(sid).alive() for sid in await self.list_ids()):
            return
        for vm in list(self._vms.values()):
            if vm.api is not None:
                await vm.api.close()
        self._vms.clear()
        try:
            self.store.unmount()
            self._root = None
        except OSError as e:
            log.warning("VM store stays mounted: %s", e)


def _keep_logs(workdir: Path, bundle_dir: Path, limit: int = 1 << 20) -> None:
    """The last MiB of the guest console and VMM log, next to the orchestrator's other sandbox logs."""
    try:
        bundle_dir.mkdir(parents=True, exist_ok=True)
        for name in (CONSOLE_LOG, VMM_LOG):
            src = workdir / name
            if src.is_file() and not src.is_symlink():
                with open(src, "rb") as f:
                    f.seek(max(0, src.stat().st_size - limit))
                    (bundle_dir / f"firecracker-{name}").write_bytes(f.read())
    except OSError as e:
        log.debug("could not keep the logs of %s: %s", workdir, e)


def _regular_file(path: Path) -> None:
    import stat

    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise FirecrackerError(f"{path} is not a regular file: refusing to export it")


def _disk_records(boot: VmBoot) -> list[dict]:
    return [{"drive_id": d.drive_id, "read_only": d.read_only, "root": d.root, "source": str(d.path)}
            for d in boot.disks]


async def _remove_jail_cgroups(exec_name: str, vm_id: str) -> None:
    for base in (Path("/sys/fs/cgroup") / exec_name / vm_id, Path("/sys/fs/cgroup/firecracker") / vm_id):
        for _ in range(100):
            try:
                base.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                await asyncio.sleep(0.02)
