"""The microVM guest image: kernel, initramfs and ext4 drives, built from Debian packages only.

One image serves every VMM (QEMU microvm/q35, Firecracker): both attach virtio devices over
virtio-mmio (q35 over PCI), and the initramfs loads both transports.

Why each part looks the way it does:
- Kernel: Debian's `linux-image-*-cloud-amd64` (fetched with `apt-get download`, no other source).
  Its virtio drivers are modules, so the initramfs carries them. `vmlinuz` is the bzImage (what QEMU
  boots anywhere); `vmlinux` is the uncompressed ELF cut out of it (what Firecracker needs, and what
  saves QEMU the in-guest decompression, seconds under TCG; the kernel has a PVH entry point).
- Initramfs: busybox-static (a Debian package) plus /init below: load modules, mount the root and
  tools drives by label, configure eth0 with the guest address every slot uses, print readiness
  markers on the console and `switch_root` into envd, which becomes PID 1 (it reaps orphans).
- /tmp is the root drive's own directory (1777 root:root, created if an image lacks it), as in E2B:
  files there are part of the sandbox's disk, its layers, snapshots and templates.
- Per-sandbox settings (envd's environment, hostname) come on the kernel command line as one
  base64 parameter `agentenv.cfg=`: both VMMs have a command line, only QEMU has fw_cfg.
- Drives: the sandbox root is an ext4 image made with `mkfs.ext4 -d` from the same base image
  gVisor uses (no loop mount); the tools layer (envd + its interpreter) is a second, read-only
  ext4 image. Sandboxes never write either: each gets a qcow2 (QEMU) or copy-on-write file on top.

Layout under `<data_dir>/images/vm/`:
    kernel-<version>/{vmlinuz,vmlinux,initrd.img,kernel.json}
    disks/root-<key>.ext4      one per base image build (+ layers), key in its name
    disks/tools-<digest>.ext4  one per tools layer
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import re
import shlex
import shutil
import stat
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from agentenv import constants
from agentenv.storage._util import CommandError, file_lock, run, tree_size

log = logging.getLogger(__name__)


# What a microVM boots (`SandboxSpec.vm`, re-exported by agentenv.runtimes.base). Defined here, with
# the guest image that produces it, so storage never imports runtimes (runtimes import storage).
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

KERNEL_META_PACKAGE = "linux-image-cloud-amd64"
BUSYBOX_PACKAGE = "busybox-static"
ROOT_LABEL = "agentenv-root"
TOOLS_LABEL = "agentenv-tools"
GUEST_MAC = "06:00:ac:10:00:02"  # same in every sandbox: restores into any slot see the same NIC
READY_MARKER = "agentenv-guest: envd starting"
CMD_TIMEOUT = 600
# Modules the cloud kernel lacks built in; dependencies are resolved from each module's modinfo.
GUEST_MODULES = [
    "virtio_mmio", "virtio_pci", "virtio_blk", "virtio_net", "virtio_console", "virtio_balloon",
    "virtio-rng", "vmw_vsock_virtio_transport",
]
ROOT_HEADROOM_MB = 512

ProgressFn = "Callable[[str, float | None], None]"

INIT_SCRIPT = r"""#!/bin/busybox sh
# agentenv guest init (initramfs): modules, drives, network, then envd as PID 1.
/bin/busybox mkdir -p /bin /sbin /usr/bin /usr/sbin /proc /sys /dev /newroot
/bin/busybox --install -s
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
for m in $(cat /modules.order); do insmod "/lib/modules/$m.ko" 2>/dev/null; done
cfg=""
for w in $(cat /proc/cmdline); do case "$w" in agentenv.cfg=*) cfg="${w#agentenv.cfg=}";; esac; done
[ -n "$cfg" ] && eval "$(echo "$cfg" | base64 -d)"
fail() { echo "agentenv-guest: FAILED: $*"; sleep 2; poweroff -f; }
i=0
while ! root=$(findfs LABEL=@ROOT_LABEL@ 2>/dev/null) || ! tools=$(findfs LABEL=@TOOLS_LABEL@ 2>/dev/null); do
  i=$((i+1)); [ $i -gt 500 ] && fail "drives not found: $(ls /dev)"; sleep 0.02
done
mount -t ext4 -o rw,noatime "$root" /newroot || fail "mount root $root"
mkdir -p /newroot@TOOLS@ /newroot/proc /newroot/sys /newroot/dev
[ -e /newroot/tmp ] || [ -L /newroot/tmp ] || { mkdir /newroot/tmp && chmod 1777 /newroot/tmp; }
mount -t ext4 -o ro,noatime "$tools" /newroot@TOOLS@ || fail "mount tools $tools"
ip link set lo up
ip link set eth0 address @MAC@ 2>/dev/null
ip addr add @GUEST_IP@/@PREFIX@ dev eth0 && ip link set eth0 up && ip route add default via @GATEWAY@ || fail network
hostname "${AE_HOSTNAME:-sandbox}"
echo "${AE_HOSTNAME:-sandbox}" > /newroot/etc/hostname 2>/dev/null
mount --move /proc /newroot/proc
mount --move /sys /newroot/sys
mount --move /dev /newroot/dev
mkdir -p /newroot/dev/pts /newroot/dev/shm
mount -t devpts -o nosuid,noexec,newinstance,ptmxmode=0666,mode=0620 devpts /newroot/dev/pts
mount -t tmpfs -o nosuid,nodev,mode=1777 shm /newroot/dev/shm
echo "@READY@"
[ -n "$AE_ARGV" ] || fail "no envd argv"
eval "exec switch_root /newroot $AE_ARGV"
"""


@dataclass(frozen=True)
class Kernel:
    version: str
    vmlinuz: Path
    vmlinux: Path
    initrd: Path

    @property
    def dir(self) -> Path:
        return self.vmlinuz.parent


def init_script() -> str:
    return (INIT_SCRIPT.replace("@ROOT_LABEL@", ROOT_LABEL).replace("@TOOLS_LABEL@", TOOLS_LABEL)
            .replace("@TOOLS@", constants.TOOLS_MOUNT).replace("@MAC@", GUEST_MAC)
            .replace("@GUEST_IP@", constants.GUEST_IP).replace("@PREFIX@", str(constants.GUEST_PREFIXLEN))
            .replace("@GATEWAY@", constants.GUEST_GATEWAY_IP).replace("@READY@", READY_MARKER))


def init_digest() -> str:
    """Identity of the initramfs' /init: a kernel built with another one gets a refreshed initramfs."""
    import hashlib

    return hashlib.sha256(init_script().encode()).hexdigest()


def guest_config_param(env: dict[str, str], argv: list[str], hostname: str) -> str:
    """The `agentenv.cfg=<base64>` kernel parameter: shell exports /init evals before envd starts."""
    lines = [f"export {k}={shlex.quote(v)}" for k, v in env.items() if re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", k)]
    lines.append(f"AE_HOSTNAME={shlex.quote(hostname)}")
    lines.append(f"AE_ARGV={shlex.quote(shlex.join(argv))}")
    blob = base64.b64encode("\n".join(lines).encode()).decode()
    return f"agentenv.cfg={blob}"


def host_tsc_khz() -> int | None:
    """The host's TSC frequency: under TCG the guest's TSC ticks at the host's rate."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                return int(float(line.split(":", 1)[1]) * 1000)
    except (OSError, ValueError):
        pass
    return None


def kernel_cmdline(env: dict[str, str], argv: list[str], hostname: str, console: str = "ttyS0",
                   extra: list[str] | None = None) -> str:
    # quiet: every console byte is a VM exit (slow under TCG); the markers from /init still print.
    parts = [f"console={console}", "quiet", "loglevel=1", "panic=-1", "reboot=t", "rdinit=/init",
             "random.trust_cpu=on", "tsc=reliable", "no_timer_check", "i8042.noaux", "i8042.nomux",
             "i8042.nopnp", "i8042.dumbkbd", *(extra or []), guest_config_param(env, argv, hostname)]
    line = " ".join(parts)
    if len(line) > 2000:
        raise ValueError(f"kernel command line too long ({len(line)} bytes; limit 2048)")
    return line


# ------------------------------------------------------------------------------- packages


async def _apt_download(pkg: str, dest: Path, logfile: Path) -> Path:
    """`apt-get download pkg` into dest; returns the .deb path."""
    dest.mkdir(parents=True, exist_ok=True)
    os.chmod(dest, 0o777)  # apt's sandbox user writes here
    before = set(dest.glob("*.deb"))
    await run(["sh", "-c", f"cd {shlex.quote(str(dest))} && apt-get download -q {shlex.quote(pkg)}"],
              timeout=CMD_TIMEOUT, log=logfile)
    new = sorted(set(dest.glob("*.deb")) - before) or sorted(dest.glob(f"{pkg.split('=')[0]}_*.deb"))
    if not new:
        raise CommandError(f"apt-get download {pkg} produced no .deb (log: {logfile})")
    return new[-1]


async def _real_kernel_package() -> tuple[str, str]:
    """(package, version) the meta package `linux-image-cloud-amd64` depends on, from apt's cache."""
    out = await run(["apt-cache", "show", "--no-all-versions", KERNEL_META_PACKAGE], timeout=60)
    m = re.search(r"^Depends:\s*(linux-image-[^\s,(]+)\s*\(=\s*([^)]+)\)", out, re.M)
    if not m:
        m2 = re.search(r"^Depends:\s*(linux-image-[^\s,(]+)", out, re.M)
        if not m2:
            raise CommandError(f"cannot find the kernel package behind {KERNEL_META_PACKAGE}: {out[-400:]}")
        return m2.group(1), ""
    return m.group(1), m.group(2)


def extract_vmlinux(bzimage: Path, out: Path) -> None:
    """Cut the compressed payload out of a bzImage and decompress it into an ELF vmlinux."""
    import subprocess

    data = bzimage.read_bytes()
    magics = [(b"\x02\x21\x4c\x18", ["lz4", "-dc"]), (b"\xfd7zXZ\x00", ["xz", "-dc"]),
              (b"\x28\xb5\x2f\xfd", ["zstd", "-dc"]), (b"\x1f\x8b\x08", ["gzip", "-dc"])]
    for magic, cmd in magics:
        pos = data.find(magic)
        while pos != -1:
            p = subprocess.run(cmd, input=data[pos:], capture_output=True, timeout=120)
            if p.stdout[:4] == b"\x7fELF":
                out.write_bytes(p.stdout)
                return
            pos = data.find(magic, pos + 1)
    raise CommandError(f"no decompressible ELF payload found in {bzimage}")


def _module_deps(ko: Path) -> list[str]:
    m = re.search(rb"\x00depends=([^\x00]*)\x00", b"\x00" + ko.read_bytes())
    return [d for d in m.group(1).decode().split(",") if d] if m else []


def _module_order(moddir: Path, wanted: list[str]) -> list[Path]:
    """Module files for `wanted` and their dependencies, dependencies first."""
    by_name: dict[str, Path] = {}
    for ko in moddir.rglob("*.ko"):
        by_name[ko.stem.replace("-", "_")] = ko
    order: list[Path] = []
    seen: set[str] = set()

    def visit(name: str) -> None:
        key = name.replace("-", "_")
        if key in seen:
            return
        seen.add(key)
        ko = by_name.get(key)
        if ko is None:
            return  # built in
        for dep in _module_deps(ko):
            visit(dep)
        order.append(ko)

    for w in wanted:
        visit(w)
    return order


def write_cpio(root: Path, out: Path) -> None:
    """A newc cpio archive of `root` (the initramfs format); files owned by root."""
    ino = 1
    with open(out, "wb") as f:
        def entry(name: str, mode: int, data: bytes, nlink: int = 1) -> None:
            nonlocal ino
            nb = name.encode() + b"\x00"
            hdr = "070701" + "".join(f"{v:08x}" for v in (
                ino, mode, 0, 0, nlink, 0, len(data), 0, 0, 0, 0, len(nb), 0))
            ino += 1
            f.write(hdr.encode() + nb)
            f.write(b"\x00" * ((4 - (110 + len(nb)) % 4) % 4))
            f.write(data)
            f.write(b"\x00" * ((4 - len(data) % 4) % 4))

        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            rel = os.path.relpath(dirpath, root)
            if rel != ".":
                entry(rel, stat.S_IFDIR | 0o755, b"", 2)
            for fn in sorted(filenames):
                p = Path(dirpath) / fn
                name = os.path.normpath(os.path.join(rel, fn))
                st = p.lstat()
                if stat.S_ISLNK(st.st_mode):
                    entry(name, stat.S_IFLNK | 0o777, os.readlink(p).encode())
                else:
                    entry(name, stat.S_IFREG | (st.st_mode & 0o7777), p.read_bytes())
        entry("TRAILER!!!", 0, b"")


def replace_cpio_file(src: Path, dst: Path, name: str, data: bytes) -> None:
    """Copy the newc cpio archive `src` to `dst` with the content of member `name` replaced."""
    blob = src.read_bytes()
    pos, found = 0, False
    with open(dst, "wb") as f:
        while True:
            hdr = blob[pos:pos + 110]
            if len(hdr) < 110 or hdr[:6] != b"070701":
                raise ValueError(f"{src}: not a newc cpio archive at offset {pos}")
            fields = [int(hdr[6 + 8 * i:14 + 8 * i], 16) for i in range(13)]
            size, namesize = fields[6], fields[11]
            name_end = pos + 110 + namesize
            member = blob[pos + 110:name_end - 1].decode()
            data_start = name_end + (-name_end % 4)
            data_end = data_start + size
            body = blob[data_start:data_end]
            if member == name:
                found, body = True, data
                fields[6], fields[12] = len(data), 0
                hdr = hdr[:6] + "".join(f"{v:08x}" for v in fields).encode()
            f.write(hdr + blob[pos + 110:data_start] + body + b"\x00" * (-len(body) % 4))
            pos = data_end + (-data_end % 4)
            if member == "TRAILER!!!":
                break
    if not found:
        dst.unlink(missing_ok=True)
        raise ValueError(f"{src} has no member {name!r}")


def root_key(lowers: list[Path]) -> str:
    """Identity of a read-only root drive: the base image build and the layers above it."""
    import hashlib

    parts = []
    for lower in lowers:
        manifest = lower.parent / "manifest.json"
        if manifest.is_file():  # an image: its build id changes on every rebuild, its revision on a fix-up
            m = json.loads(manifest.read_text())
            rev = int(m.get("revision", 0))
            parts.append(str(m.get("build_id", lower)) + (f"+r{rev}" if rev else ""))
        else:  # a content-addressed layer
            parts.append(lower.name)
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------- builders


class GuestImages:
    """Builds and caches the guest kernel/initramfs and the ext4 drives (safe across processes)."""

    def __init__(self, images_dir: Path) -> None:
        self.root = Path(images_dir) / "vm"
        self._kernel: Kernel | None = None

    # --- kernel + initramfs

    def _find_kernel(self, *, current_init: bool = True) -> Kernel | None:
        """The newest kernel built here; with `current_init`, only if its initramfs has today's /init."""
        for d in sorted(self.root.glob("kernel-*"), reverse=True):
            if (d / "kernel.json").is_file():
                meta = json.loads((d / "kernel.json").read_text())
                if current_init and meta.get("init_sha256") != init_digest():
                    return None
                return Kernel(meta["version"], d / "vmlinuz", d / "vmlinux", d / meta.get("initrd", "initrd.img"))
        return None

    async def ensure_kernel(self, progress=None) -> Kernel:
        if self._kernel is not None:
            return self._kernel
        found = self._find_kernel()
        if found is not None:
            self._kernel = found
            return found
        self.root.mkdir(parents=True, exist_ok=True)
        async with file_lock(self.root / ".kernel.lock"):
            found = self._find_kernel()
            if found is None:
                older = self._find_kernel(current_init=False)
                found = await asyncio.to_thread(self._refresh_init, older) if older else None
            if found is None:
                found = await self._build_kernel(progress)
        self._kernel = found
        return found

    def _refresh_init(self, k: Kernel) -> Kernel | None:
        """Give a kernel built by an older agentenv today's /init: a new initramfs file next to the old
        one (memory images of paused VMs keep naming theirs), then kernel.json, both replaced whole
        (the files may be hard links shared with another data dir)."""
        meta_path = k.dir / "kernel.json"
        meta = json.loads(meta_path.read_text())
        digest = init_digest()
        target = k.dir / f"initrd-{digest[:12]}.img"
        try:
            tmp = target.with_name(target.name + ".tmp")
            replace_cpio_file(k.initrd, tmp, "init", init_script().encode())
            os.replace(tmp, target)
        except (OSError, ValueError) as e:
            log.warning("cannot refresh the guest initramfs %s (%s): rebuilding the guest kernel", k.initrd, e)
            return None
        meta.update(initrd=target.name, init_sha256=digest)
        tmp_meta = meta_path.with_name("kernel.json.tmp")
        tmp_meta.write_text(json.dumps(meta, indent=1))
        os.replace(tmp_meta, meta_path)
        log.info("guest initramfs %s: /init updated", target)
        return Kernel(k.version, k.vmlinuz, k.vmlinux, target)

    async def _build_kernel(self, progress) -> Kernel:
        def step(msg: str, frac: float | None) -> None:
            log.info("guest image: %s", msg)
            if progress:
                progress(msg, frac)

        t0 = time.monotonic()
        logfile = self.root / "kernel.log"
        logfile.write_text(f"# guest kernel build {time.strftime('%Y-%m-%dT%H:%M:%S')}\n")
        tmp = self.root / f".kernel.tmp-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        try:
            step(f"resolving {KERNEL_META_PACKAGE}", 0.02)
            pkg, version = await _real_kernel_package()
            step(f"downloading {pkg} {version} and {BUSYBOX_PACKAGE}", 0.05)
            debs = tmp / "debs"
            kdeb = await _apt_download(f"{pkg}={version}" if version else pkg, debs, logfile)
            bdeb = await _apt_download(BUSYBOX_PACKAGE, debs, logfile)
            step("unpacking the kernel package", 0.3)
            kx = tmp / "kernel-pkg"
            await run(["dpkg-deb", "-x", str(kdeb), str(kx)], timeout=CMD_TIMEOUT, log=logfile)
            await run(["dpkg-deb", "-x", str(bdeb), str(tmp / "busybox-pkg")], timeout=CMD_TIMEOUT, log=logfile)
            vmlinuz = next((kx / "boot").glob("vmlinuz-*"))
            kver = vmlinuz.name[len("vmlinuz-"):]
            shutil.copyfile(vmlinuz, tmp / "vmlinuz")
            step("extracting the uncompressed vmlinux", 0.5)
            await asyncio.to_thread(extract_vmlinux, tmp / "vmlinuz", tmp / "vmlinux")
            step("building the initramfs (busybox + virtio modules)", 0.7)
            ird = tmp / "initrd"
            (ird / "bin").mkdir(parents=True)
            shutil.copyfile(tmp / "busybox-pkg/bin/busybox", ird / "bin/busybox")
            os.chmod(ird / "bin/busybox", 0o755)
            mods = _module_order(kx / "lib/modules" / kver, GUEST_MODULES)
            (ird / "lib/modules").mkdir(parents=True)
            for ko in mods:
                shutil.copyfile(ko, ird / "lib/modules" / ko.name)
            (ird / "modules.order").write_text("".join(ko.stem + "\n" for ko in mods))
            (ird / "init").write_text(init_script())
            os.chmod(ird / "init", 0o755)
            await asyncio.to_thread(write_cpio, ird, tmp / "initrd.img")
            meta = {"version": kver, "package": pkg, "package_version": version,
                    "modules": [ko.stem for ko in mods], "busybox": bdeb.name, "init_sha256": init_digest(),
                    "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "build_seconds": round(time.monotonic() - t0, 1)}
            (tmp / "kernel.json").write_text(json.dumps(meta, indent=1))
            for junk in ("debs", "kernel-pkg", "busybox-pkg", "initrd"):
                shutil.rmtree(tmp / junk)
            target = self.root / f"kernel-{kver}"
            if target.exists():
                shutil.rmtree(target)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        step(f"guest kernel {kver} ready", 1.0)
        return Kernel(kver, target / "vmlinuz", target / "vmlinux", target / "initrd.img")

    # --- drives

    def disk_path(self, kind: str, key: str) -> Path:
        return self.root / "disks" / f"{kind}-{key}.ext4"

    async def ensure_disk(self, kind: str, key: str, src: Path, *, size_mb: int = 0, label: str,
                          progress=None) -> Path:
        """An ext4 image of directory `src` (cached by `key`); `size_mb` of room at least."""
        target = self.disk_path(kind, key)
        if target.is_file():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        async with file_lock(target.parent / f".{kind}-{key}.lock"):
            if target.is_file():
                return target
            if progress:
                progress(f"making the {kind} drive (mkfs.ext4 -d)", None)
            t0 = time.monotonic()
            used_mb = await asyncio.to_thread(tree_size, src) // (1 << 20)
            mb = max(size_mb, int(used_mb * 1.3) + ROOT_HEADROOM_MB if kind == "root" else int(used_mb * 1.2) + 64)
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{kind}-", suffix=".tmp")
            os.close(fd)
            try:
                os.truncate(tmp, mb << 20)
                # Fixed UUID/hash seed: the image is a read-only base, its identity is the key.
                await run(["mkfs.ext4", "-q", "-F", "-L", label, "-d", str(src), "-m", "0",
                           "-E", "lazy_itable_init=1,lazy_journal_init=1", "-O", "^has_journal" if kind == "tools"
                           else "has_journal", tmp], timeout=CMD_TIMEOUT)
                os.chmod(tmp, 0o444)
                os.rename(tmp, target)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            log.info("guest %s drive %s (%d MiB) built in %.1fs", kind, target.name, mb, time.monotonic() - t0)
        return target

    async def ensure_tools_disk(self, tools_dir: Path, progress=None) -> Path:
        return await self.ensure_disk("tools", tools_dir.name, tools_dir, label=TOOLS_LABEL, progress=progress)

    async def ensure_root_disk(self, key: str, rootfs: Path, size_mb: int, progress=None) -> Path:
        return await self.ensure_disk("root", key, rootfs, size_mb=size_mb, label=ROOT_LABEL, progress=progress)


async def build_guest_image(images_dir: Path, base_rootfs: Path, tools_dir: Path, disk_mb: int,
                            progress=None) -> dict[str, Path]:
    """Everything a VM sandbox of the base image needs (what `agentenv image build --vm` makes)."""
    g = GuestImages(images_dir)
    k = await g.ensure_kernel(progress)
    tools = await g.ensure_tools_disk(tools_dir, progress)
    root = await g.ensure_root_disk(root_key([base_rootfs]), base_rootfs, disk_mb, progress)
    if progress:
        progress("guest image ready", 1.0)
    return {"kernel": k.vmlinuz, "vmlinux": k.vmlinux, "initrd": k.initrd, "root": root, "tools": tools}


async def vm_boot(images_dir: Path, spec, progress=None):
    """The guest image as `SandboxSpec.vm` (kernel, initramfs, cmdline, the template's disks).

    Loaded by runtime selection as `select.VM_GUEST_IMAGES`; the sandbox host calls it for microVM runtimes that
    take their boot from the spec (Firecracker). The root disk is the writable one: the runtime
    gives each sandbox its own copy-on-write copy; the tools disk is shared read-only.
    """
    g = GuestImages(images_dir)
    k = await g.ensure_kernel(progress)
    tools = await g.ensure_tools_disk(spec.tools_dir, progress)
    root = await g.ensure_root_disk(root_key(spec.lowers or [spec.rootfs]), spec.rootfs, spec.disk_mb, progress)
    return VmBoot(kernel=k.vmlinux, initrd=k.initrd, cmdline=kernel_cmdline(spec.env, spec.args, spec.hostname),
                  disks=[VmDisk("root", root, read_only=False, root=True), VmDisk("tools", tools, read_only=True)])

