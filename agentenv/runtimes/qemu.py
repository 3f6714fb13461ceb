"""QEMU runtime: every sandbox is a Linux microVM (`qemu-system-x86_64 -M microvm`), KVM or TCG.

Why it is built this way:
- Same guest image as every VMM (agentenv.storage.guest): kernel + initramfs, the base image as a
  read-only ext4 drive under a per-sandbox qcow2 (the sandbox's writable disk), the tools layer as
  a second read-only drive. envd is PID 1 of the guest.
- Network: QEMU runs inside the sandbox's slot netns on a tap bridged to the slot's guest veth
  (`eth0`), and the guest takes the address gVisor would have (constants.GUEST_IP). The rest of
  agentenv (DNAT, proxy, envd client) reaches envd at the slot's host_ip exactly as for gVisor.
- Control: QMP over a Unix socket with the `qemu.qmp` library.
- Memory: guest RAM is a file (`memory-backend-file`). A sandbox that booted owns its RAM file
  (share=on), so a checkpoint is a migration with `x-ignore-shared` (only device state is written,
  milliseconds) and the RAM file is moved into the image. A restore maps the image's RAM file
  copy-on-write (share=off): N clones of one checkpoint share every page they have not written.
  A sandbox restored that way does not own its RAM, so its own checkpoint carries the RAM in the
  migration stream ("full" image); restoring a full image gives the clone its own RAM file again.
- Disk: a checkpoint moves the sandbox's qcow2 (its changes since the base drive) into the image;
  a restore copies it (cost ∝ the sandbox's changes) and puts it back on this node's base drive.
- Accelerator: KVM when the host has hardware virtualization (vmx/svm, not PVM), else TCG.
  Software PVM KVM cannot run stock guest kernels, hence no KVM there.
- TCP connections survive a checkpoint (the guest kernel's state is saved whole), so the
  orchestrator need not drain them first (`keeps_tcp_across_checkpoint`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shlex
import shutil
import signal
import time
from pathlib import Path
from typing import Any

from agentenv.config import Settings
from agentenv.errors import RuntimeFailure
from agentenv.proc import pid_alive, run_cmd
from agentenv.runtimes import cgroups
from agentenv.runtimes.base import RuntimeTraits, SandboxSpec
from agentenv.storage import guest
from agentenv.storage.artifacts import REQUIRES_FILE, ArtifactCache, drive_path

log = logging.getLogger(__name__)

QMP_TIMEOUT = 30.0
START_TIMEOUT = 30.0
MIGRATE_TIMEOUT = 300.0
CMD_TIMEOUT = 60.0
TAP = "tap0"
BRIDGE = "br0"
STATE_FILE = "state"
FULL_STATE_FILE = "full.state"  # transient: a full stream before _to_ram_file
RAM_FILE = "ram"
DISK_FILE = "disk.qcow2"
META_FILE = "vm.json"
CONSOLE_LOG = "console.log"
QEMU_LOG = "qemu.log"

# In the slot netns: take the guest address off eth0 and bridge eth0 with QEMU's tap (idempotent:
# a capture restores into the same slot).
_NETNS_SH = f"""
set -e
ip addr flush dev eth0
# Bridged frames must not meet the slot's IP rules (it drops everything arriving on eth0): with
# br_netfilter loaded on the host they would, unless switched off in this netns.
for f in /proc/sys/net/bridge/bridge-nf-call-iptables /proc/sys/net/bridge/bridge-nf-call-ip6tables \
         /proc/sys/net/bridge/bridge-nf-call-arptables; do [ -e "$f" ] && echo 0 > "$f"; done
ip link show {BRIDGE} >/dev/null 2>&1 || ip link add {BRIDGE} type bridge
ip link show {TAP} >/dev/null 2>&1 || ip tuntap add {TAP} mode tap
echo 1 > /proc/sys/net/ipv6/conf/{BRIDGE}/disable_ipv6 2>/dev/null || true
ip link set eth0 master {BRIDGE}
ip link set {TAP} master {BRIDGE}
ip link set {BRIDGE} up
ip link set {TAP} up
ip link set eth0 up
"""


def kvm_usable() -> tuple[bool, str]:
    """Whether guest kernels run under /dev/kvm here: hardware vmx/svm, not software PVM."""
    if not os.path.exists("/dev/kvm") or not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False, "no usable /dev/kvm"
    if os.path.exists("/sys/module/kvm_pvm"):
        return False, "/dev/kvm is software PVM (stock guest kernels cannot run on it)"
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    if not re.search(r"\b(vmx|svm)\b", cpuinfo):
        return False, "no vmx/svm CPU flag"
    return True, "hardware virtualization"


def _fully_exited(pid: int) -> bool:
    """Gone, or a zombie whose every thread has exited and released its files (tap, locks).

    A multi-threaded process's leader shows as a zombie while its other threads still exit and
    hold the fd table: the tap is not free yet then.
    """
    try:
        if pid_alive(pid):
            return False
        return not os.listdir(f"/proc/{pid}/fd") and len(os.listdir(f"/proc/{pid}/task")) <= 1
    except FileNotFoundError:
        return True
    except PermissionError:
        return False


class QemuRuntime:
    """Runtime protocol implementation on top of qemu-system-x86_64 + QMP."""

    name = "qemu"
    keeps_tcp_across_checkpoint = True
    envd_timeout = 240.0  # a cold boot under TCG on a busy host (15-40 s measured); KVM sets it lower

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.paths = settings.paths
        self.binary = settings.qemu_path
        self.machine = settings.qemu_machine
        self.images = guest.GuestImages(self.paths.images)
        if settings.qemu_accel == "auto":
            ok, why = kvm_usable()  # same rule as select.detect_virt: vmx/svm and a usable /dev/kvm
            self.accel = "kvm" if ok else "tcg"
            log.info("qemu runtime: accelerator %s (%s)", self.accel, why)
        else:
            self.accel = settings.qemu_accel
        if self.accel == "kvm":
            self.envd_timeout = 60.0
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        self._qmp: dict[str, Any] = {}
        self._qmp_locks: dict[str, asyncio.Lock] = {}

    # ---------------------------------------------------------------- plumbing

    def _bundle(self, sandbox_id: str) -> Path:
        return self.paths.sandbox_dir(sandbox_id) / "bundle"

    def _pid(self, sandbox_id: str) -> int | None:
        bundle = self._bundle(sandbox_id)
        try:
            pid = int((bundle / "qemu.pid").read_text().strip())
        except (OSError, ValueError):
            return None
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return None
        if b"qemu-system" not in cmdline or str(bundle).encode() not in cmdline:
            return None  # pid reused by something else
        return pid if pid_alive(pid) else None

    async def _client(self, sandbox_id: str):
        c = self._qmp.get(sandbox_id)
        if c is not None and c.runstate.name == "RUNNING":
            return c
        c = await _qmp_connect(self._bundle(sandbox_id) / "qmp.sock", f"agentenv-{sandbox_id}",
                               lambda: self._pid(sandbox_id) is not None)
        self._qmp[sandbox_id] = c
        return c

    async def qmp(self, sandbox_id: str, cmd: str, args: dict | None = None, timeout: float = QMP_TIMEOUT) -> Any:
        lock = self._qmp_locks.setdefault(sandbox_id, asyncio.Lock())
        async with lock:
            try:
                c = await self._client(sandbox_id)
                return await asyncio.wait_for(c.execute(cmd, args), timeout)
            except (OSError, asyncio.TimeoutError, EOFError) as e:
                await self._drop_client(sandbox_id)
                raise RuntimeFailure(f"QMP {cmd} to sandbox {sandbox_id} failed: {e!r}") from e
            except Exception as e:  # noqa: BLE001 - qemu.qmp errors (ExecuteError, ConnectError...)
                if type(e).__module__.startswith("qemu."):
                    await self._drop_client(sandbox_id)
                    raise RuntimeFailure(f"QMP {cmd} to sandbox {sandbox_id} failed: {e}") from e
                raise

    async def _drop_client(self, sandbox_id: str) -> None:
        c = self._qmp.pop(sandbox_id, None)
        if c is not None:
            try:
                await asyncio.wait_for(c.disconnect(), 5)
            except Exception:  # noqa: BLE001
                pass

    async def _setup_netns(self, spec: SandboxSpec) -> None:
        await run_cmd(["nsenter", f"--net={spec.slot.netns_path}", "sh", "-c", _NETNS_SH],
                      timeout=CMD_TIMEOUT, what="netns tap setup")

    async def prepare_drives(self, spec: SandboxSpec, progress=None) -> tuple[guest.Kernel, Path, Path]:
        kernel = await self.images.ensure_kernel(progress)
        tools = await self.images.ensure_tools_disk(spec.tools_dir, progress)
        root = await self.images.ensure_root_disk(guest.root_key(spec.lowers or [spec.rootfs]), spec.rootfs, spec.disk_mb, progress)
        return kernel, root, tools

    def _argv(self, spec: SandboxSpec, meta: dict, ram_path: Path, share: bool, incoming: bool) -> list[str]:
        b = spec.bundle_dir
        mem = f"{spec.memory_mb}M"
        dev = "device" if self.machine == "microvm" else "pci"
        machine = ("microvm,x-option-roms=off,isa-serial=on,rtc=on,pit=on,pic=on"
                   if self.machine == "microvm" else f"{self.machine}")
        extra = []
        if self.accel == "tcg" and (khz := guest.host_tsc_khz()):
            # Without it the guest calibrates its TSC against the PIT, which under TCG on a busy host
            # fails and leaves microvm guests hanging in early boot.
            extra.append(f"tsc_early_khz={khz}")
        cmdline = guest.kernel_cmdline(spec.env, spec.args, spec.hostname, extra=extra)
        argv = [
            "nsenter", f"--net={spec.slot.netns_path}", "--",
            self.binary, "-name", f"agentenv-{spec.sandbox_id}",
            "-M", machine, "-accel", self.accel, "-cpu", "host" if self.accel == "kvm" else "max",
            "-smp", str(max(1, spec.cpu_count)), "-m", mem,
            "-object", f"memory-backend-file,id=mem,size={mem},mem-path={ram_path},share={'on' if share else 'off'}",
            "-numa", "node,memdev=mem",
            "-kernel", meta["kernel"], "-initrd", meta["initrd"], "-append", cmdline,
            "-nodefaults", "-no-user-config", "-display", "none", "-serial", f"file:{b / CONSOLE_LOG}",
            "-blockdev", f"driver=file,node-name=base,filename={meta['root_disk']},read-only=on",
            "-blockdev", "driver=raw,node-name=baseraw,file=base,read-only=on",
            "-blockdev", f"driver=file,node-name=top,filename={b / DISK_FILE},discard=unmap",
            "-blockdev", "driver=qcow2,node-name=root,file=top,backing=baseraw,discard=unmap",
            "-device", f"virtio-blk-{dev},drive=root",
            "-blockdev", f"driver=file,node-name=toolsf,filename={meta['tools_disk']},read-only=on",
            "-blockdev", "driver=raw,node-name=tools,file=toolsf,read-only=on",
            "-device", f"virtio-blk-{dev},drive=tools",
            "-netdev", f"tap,id=n0,ifname={TAP},script=no,downscript=no",
            "-device", f"virtio-net-{dev},netdev=n0,mac={guest.GUEST_MAC}",
            "-object", "rng-random,id=rng0,filename=/dev/urandom", "-device", f"virtio-rng-{dev},rng=rng0",
            "-device", f"virtio-balloon-{dev},id=balloon0,deflate-on-oom=on,free-page-reporting=on",
            "-qmp", f"unix:{b / 'qmp.sock'},server=on,wait=off",
            "-pidfile", str(b / "qemu.pid"),
        ]
        if incoming:
            argv += ["-incoming", "defer"]
        return argv

    async def _launch(self, spec: SandboxSpec, meta: dict, ram_path: Path, share: bool, incoming: bool) -> None:
        b = spec.bundle_dir
        for f in ("qmp.sock", "qemu.pid"):
            (b / f).unlink(missing_ok=True)
        argv = self._argv(spec, meta, ram_path, share, incoming)
        (b / META_FILE).write_text(json.dumps({**meta, "argv": argv}, indent=1))  # for _to_ram_file
        with open(b / QEMU_LOG, "ab") as logf:
            logf.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} {shlex.join(argv)}\n".encode())
            logf.flush()
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True)
        self._procs[spec.sandbox_id] = proc
        deadline = time.monotonic() + START_TIMEOUT
        while not (b / "qmp.sock").exists():
            if proc.returncode is not None or time.monotonic() > deadline:
                raise RuntimeFailure(f"qemu did not start (rc={proc.returncode}): {_tail(b / QEMU_LOG)}")
            await asyncio.sleep(0.01)
        pid = self._pid(spec.sandbox_id)
        if pid is not None:  # the VM weighs what every sandbox weighs under a saturated CPU
            cgroups.place(spec.sandbox_id, pid, self.settings.sandbox_cpu_weight)
        await self.qmp(spec.sandbox_id, "migrate-set-capabilities",
                       {"capabilities": [{"capability": "x-ignore-shared", "state": True}]})

    # ---------------------------------------------------------------- Runtime protocol

    async def start(self, spec: SandboxSpec) -> None:
        try:
            kernel, root, tools = await self.prepare_drives(spec)
            b = spec.bundle_dir
            b.mkdir(parents=True, exist_ok=True)
            await run_cmd(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b", str(root), str(b / DISK_FILE)],
                          timeout=CMD_TIMEOUT, what="qemu-img create")
            ram = b / RAM_FILE
            ram.unlink(missing_ok=True)
            with open(ram, "wb") as f:
                f.truncate(spec.memory_mb << 20)
            meta = {"kernel": str(kernel.vmlinux), "initrd": str(kernel.initrd), "kernel_version": kernel.version,
                    "root_disk": str(root), "tools_disk": str(tools), "memory_mb": spec.memory_mb,
                    "cpu_count": spec.cpu_count, "machine": self.machine, "owns_ram": True}
            (b / META_FILE).write_text(json.dumps(meta, indent=1))
            await self._setup_netns(spec)
            await self._launch(spec, meta, ram, share=True, incoming=False)
        except BaseException:
            await asyncio.shield(self.stop(spec.sandbox_id))
            raise

    async def restore(self, spec: SandboxSpec, image_dir: Path) -> None:
        try:
            meta = await self._localise(json.loads((image_dir / META_FILE).read_text()), image_dir)
            b = spec.bundle_dir
            b.mkdir(parents=True, exist_ok=True)
            t0 = time.monotonic()
            await asyncio.to_thread(shutil.copyfile, image_dir / DISK_FILE, b / DISK_FILE)
            await run_cmd(["qemu-img", "rebase", "-u", "-f", "qcow2", "-F", "raw", "-b", meta["root_disk"],
                           str(b / DISK_FILE)], timeout=CMD_TIMEOUT, what="qemu-img rebase")
            spec.memory_mb, spec.cpu_count = meta["memory_mb"], meta["cpu_count"]  # must match the image
            if (image_dir / RAM_FILE).exists():
                ram = image_dir / RAM_FILE  # copy-on-write view of the checkpoint's RAM
            else:
                # A full image: the stream carries the RAM. It must land in private memory (with
                # x-ignore-shared, a shared RAM block would be skipped on load), so this VM too
                # will write its RAM into its next checkpoint.
                ram = b / RAM_FILE
                ram.unlink(missing_ok=True)
                with open(ram, "wb") as f:
                    f.truncate(spec.memory_mb << 20)
            share = False
            meta = {**meta, "owns_ram": False}
            (b / META_FILE).write_text(json.dumps(meta, indent=1))
            await self._setup_netns(spec)
            await self._launch(spec, meta, ram, share=share, incoming=True)
            src = shlex.quote(str(image_dir / STATE_FILE))
            await self.qmp(spec.sandbox_id, "migrate-incoming", {"uri": f"exec:cat {src}"})
            await self._wait_migration(spec.sandbox_id, incoming=True)
            st = await self.qmp(spec.sandbox_id, "query-status")
            if st.get("status") != "running":
                await self.qmp(spec.sandbox_id, "cont")
            log.debug("restored %s in %.3fs", spec.sandbox_id, time.monotonic() - t0)
        except BaseException:
            await asyncio.shield(self.stop(spec.sandbox_id))
            raise

    async def _wait_migration(self, sandbox_id: str, *, incoming: bool) -> None:
        deadline = time.monotonic() + MIGRATE_TIMEOUT
        delay = 0.005
        while True:
            if incoming:
                st = await self.qmp(sandbox_id, "query-status")
                if st.get("status") not in ("inmigrate", "prelaunch"):
                    if st.get("status") in ("running", "paused"):
                        return
                    raise RuntimeFailure(f"incoming migration of {sandbox_id} ended in state {st.get('status')}: "
                                         f"{_tail(self._bundle(sandbox_id) / QEMU_LOG)}")
            else:
                st = await self.qmp(sandbox_id, "query-migrate")
                status = st.get("status")
                if status == "completed":
                    return
                if status in ("failed", "cancelled"):
                    raise RuntimeFailure(f"migration of {sandbox_id} {status}: {st.get('error-desc', '')}")
            if time.monotonic() > deadline:
                raise RuntimeFailure(f"migration of {sandbox_id} did not finish within {MIGRATE_TIMEOUT:.0f}s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)

    async def checkpoint(self, sandbox_id: str, image_dir: Path) -> None:
        """Save device state (+ RAM unless the VM owns its RAM file) and stop the VM."""
        b = self._bundle(sandbox_id)
        try:
            meta = json.loads((b / META_FILE).read_text())
            image_dir.mkdir(parents=True, exist_ok=True)
            t0 = time.monotonic()
            owns = bool(meta.get("owns_ram"))
            dst = image_dir / (STATE_FILE if owns else FULL_STATE_FILE)
            if not owns:  # a plain full stream; _to_ram_file turns it into a RAM-file image below
                await self.qmp(sandbox_id, "migrate-set-capabilities",
                               {"capabilities": [{"capability": "x-ignore-shared", "state": False}]})
            await self.qmp(sandbox_id, "migrate", {"uri": f"exec:cat > {shlex.quote(str(dst))}"})
            await self._wait_migration(sandbox_id, incoming=False)
            t_mig = time.monotonic() - t0
            await self._kill(sandbox_id)
            if owns:
                os.replace(b / RAM_FILE, image_dir / RAM_FILE)
            else:
                await self._to_ram_file(sandbox_id, meta, image_dir)
            os.replace(b / DISK_FILE, image_dir / DISK_FILE)
            keep = {k: meta[k] for k in ("kernel", "initrd", "kernel_version", "root_disk", "tools_disk",
                                         "memory_mb", "cpu_count", "machine")}
            (image_dir / META_FILE).write_text(json.dumps(keep, indent=1))
            # The guest has these drives' blocks cached: a restore needs these exact files. Sealing the
            # image gives them digests, and the snapshot store carries them to other nodes.
            (image_dir / REQUIRES_FILE).write_text(json.dumps(
                {"drives": {k: {"path": meta[k]} for k in ("root_disk", "tools_disk")}}, indent=1))
            log.debug("checkpointed %s: migration %.3fs, total %.3fs (%s)", sandbox_id, t_mig,
                      time.monotonic() - t0, "shared RAM" if meta.get("owns_ram") else "full RAM")
        finally:
            await asyncio.shield(self.stop(sandbox_id))

    async def _localise(self, meta: dict, image_dir: Path) -> dict:
        """The image's kernel and drives as files of this node: the recorded paths where they exist
        (the node that took the image), else the same kernel version built here and the exact drives
        pulled with the image (`<data>/drives/<digest>/`, see storage/artifacts.py)."""
        meta = dict(meta)
        if not (Path(meta["kernel"]).exists() and Path(meta["initrd"]).exists()):
            kernel = await self.images.ensure_kernel()
            if kernel.version != meta.get("kernel_version"):
                raise RuntimeFailure(f"this checkpoint was taken with guest kernel {meta.get('kernel_version')}, "
                                     f"this node has {kernel.version}")
            meta["kernel"], meta["initrd"] = str(kernel.vmlinux), str(kernel.initrd)
        drives = ArtifactCache.required_drives(image_dir)
        for key in ("root_disk", "tools_disk"):
            if Path(meta[key]).exists():
                continue
            digest = (drives.get(key) or {}).get("digest")
            pulled = drive_path(self.paths.root, digest) if digest else None
            if pulled is None or not pulled.is_file():
                raise RuntimeFailure(f"this checkpoint needs the guest drive {meta[key]}"
                                     f"{f' (sha256 {digest[:12]})' if digest else ''}, which is neither on this "
                                     "node nor pulled from the snapshot store")
            meta[key] = str(pulled)
        return meta

    async def _to_ram_file(self, sandbox_id: str, meta: dict, image_dir: Path) -> None:
        """Turn a full-stream checkpoint into a RAM-file one, so its restores map memory copy-on-write.

        A VM restored from a RAM-file image maps that file privately (share=off), so its own
        migration must carry its RAM. A helper QEMU with the same devices (never running the guest:
        -S) loads that stream into a fresh shared RAM file, then saves again with x-ignore-shared:
        the image ends up as RAM file + small device state, like a cold-booted VM's.
        """
        b = self._bundle(sandbox_id)
        full = image_dir / FULL_STATE_FILE
        ram = image_dir / RAM_FILE
        with open(ram, "wb") as f:
            f.truncate(int(meta["memory_mb"]) << 20)
        sock, pidf = b / "helper-qmp.sock", b / "helper.pid"
        for f in (sock, pidf):
            f.unlink(missing_ok=True)
        argv, it = [], iter(meta["argv"])
        for a in it:
            if a in ("-object", "-qmp", "-pidfile", "-serial", "-incoming"):
                v = next(it)
                if a == "-object" and v.startswith("memory-backend-file,"):
                    v = f"memory-backend-file,id=mem,size={meta['memory_mb']}M,mem-path={ram},share=on"
                elif a == "-qmp":
                    v = f"unix:{sock},server=on,wait=off"
                elif a == "-pidfile":
                    v = str(pidf)
                elif a == "-serial":
                    v = "null"
                elif a == "-incoming":
                    continue
                argv += [a, v]
            else:
                argv.append(a)
        argv += ["-S", "-incoming", "defer"]
        t0 = time.monotonic()
        with open(b / QEMU_LOG, "ab") as logf:
            logf.write(f"--- helper {time.strftime('%Y-%m-%dT%H:%M:%S')} {shlex.join(argv)}\n".encode())
            logf.flush()
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True)
        c = None
        try:
            deadline = time.monotonic() + START_TIMEOUT
            while not sock.exists():
                if proc.returncode is not None or time.monotonic() > deadline:
                    raise RuntimeFailure(f"helper qemu did not start: {_tail(b / QEMU_LOG)}")
                await asyncio.sleep(0.01)
            c = await _qmp_connect(sock, f"agentenv-helper-{sandbox_id}", lambda: proc.returncode is None)

            async def wait(cmd: str, done) -> None:
                end = time.monotonic() + MIGRATE_TIMEOUT
                while True:
                    st = await asyncio.wait_for(c.execute(cmd), QMP_TIMEOUT)
                    if done(st):
                        return
                    if st.get("status") in ("failed", "cancelled") or time.monotonic() > end:
                        raise RuntimeFailure(f"helper {cmd}: {st}: {_tail(b / QEMU_LOG)}")
                    await asyncio.sleep(0.02)

            caps = {"capabilities": [{"capability": "x-ignore-shared", "state": False}]}
            await c.execute("migrate-set-capabilities", caps)
            await c.execute("migrate-incoming", {"uri": f"exec:cat {shlex.quote(str(full))}"})
            await wait("query-status", lambda st: st.get("status") not in ("inmigrate", "prelaunch"))
            caps["capabilities"][0]["state"] = True
            await c.execute("migrate-set-capabilities", caps)
            await c.execute("migrate", {"uri": f"exec:cat > {shlex.quote(str(image_dir / STATE_FILE))}"})
            await wait("query-migrate", lambda st: st.get("status") == "completed")
        except BaseException:
            ram.unlink(missing_ok=True)
            raise
        finally:
            try:
                if c is not None:
                    await asyncio.wait_for(c.disconnect(), 5)
            except Exception:  # noqa: BLE001
                pass
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
            for f in (sock, pidf):
                f.unlink(missing_ok=True)
        full.unlink(missing_ok=True)
        log.debug("rewrote %s's full checkpoint as a RAM-file image in %.3fs", sandbox_id, time.monotonic() - t0)

    async def _kill(self, sandbox_id: str) -> None:
        await self._drop_client(sandbox_id)
        pid = self._pid(sandbox_id)
        proc = self._procs.pop(sandbox_id, None)
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc is not None:
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except asyncio.TimeoutError:
                raise RuntimeFailure(f"qemu of {sandbox_id} did not exit") from None
        elif pid is not None:  # not our child (started by a previous server process)
            deadline = time.monotonic() + 10
            while not _fully_exited(pid):
                if time.monotonic() > deadline:
                    raise RuntimeFailure(f"qemu of {sandbox_id} (pid {pid}) did not exit")
                await asyncio.sleep(0.02)

    async def stop(self, sandbox_id: str) -> None:
        await self._kill(sandbox_id)
        self._qmp_locks.pop(sandbox_id, None)
        await cgroups.remove(sandbox_id, owner=str(self._bundle(sandbox_id)))
        b = self._bundle(sandbox_id)
        for f in ("qmp.sock", "qemu.pid"):
            try:
                (b / f).unlink()
            except (FileNotFoundError, NotADirectoryError):
                pass

    @property
    def traits(self) -> RuntimeTraits:
        # builds its drives itself (same guest image; qcow2 instead of raw copies): not boots_from_spec
        return RuntimeTraits(vm=True, envd_timeout_s=self.envd_timeout)

    async def state(self, sandbox_id: str) -> str | None:
        return "running" if await self.is_alive(sandbox_id) else None

    async def close(self) -> None:
        """Server shutdown: drop the QMP sessions (the VMs themselves keep running or were stopped)."""
        for sid in list(self._qmp):
            await self._drop_client(sid)

    async def is_alive(self, sandbox_id: str) -> bool:
        return self._pid(sandbox_id) is not None

    async def pause(self, sandbox_id: str) -> None:
        await self.qmp(sandbox_id, "stop")

    async def resume(self, sandbox_id: str) -> None:
        await self.qmp(sandbox_id, "cont")

    async def list_ids(self) -> list[str]:
        if not self.paths.sandboxes.exists():
            return []
        return [d.name for d in self.paths.sandboxes.iterdir()
                if (d / "bundle" / "qemu.pid").exists() and self._pid(d.name) is not None]

    async def balloon(self, sandbox_id: str, target_mb: int) -> None:
        """Resize the guest's balloon (the guest returns freed pages by itself via free-page reporting)."""
        await self.qmp(sandbox_id, "balloon", {"value": target_mb << 20})

    async def query_balloon(self, sandbox_id: str) -> int:
        return int((await self.qmp(sandbox_id, "query-balloon"))["actual"]) >> 20


async def _qmp_connect(sock: Path, name: str, alive) -> Any:
    """A QMP session on `sock`, retried: the socket file appears (bind) a moment before QEMU
    listens, and a vanished client's session (a crashed server's) may still be being torn down."""
    from qemu.qmp import QMPClient

    for attempt in range(8):
        c = QMPClient(name)
        try:
            await asyncio.wait_for(c.connect(str(sock)), QMP_TIMEOUT)
            return c
        except Exception as e:  # noqa: BLE001 - qemu.qmp's ConnectError wraps the OSError
            if attempt == 7 or not alive():
                raise
            log.info("QMP connect to %s failed (%s); retrying", sock, e)
            await asyncio.sleep(0.05 * (attempt + 1))
    raise AssertionError("unreachable")


def _tail(path: Path, limit: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-limit:].strip()
    except OSError:
        return "(no log)"


# ---------------------------------------------------------------- probe (registered by agentenv.runtimes.select)


async def probe(settings: Settings, virt) -> "Any":
    """Available when the QEMU binary runs; KVM-backed (a real VM at near-native speed) only on
    hardware virtualization, else emulated (TCG: real Linux guest, slow; ranked below gVisor)."""
    from agentenv.runtimes import select

    binary = shutil.which(settings.qemu_path)
    if binary is None or shutil.which("qemu-img") is None:
        return select.Probe("qemu", False, select.STRENGTH_EMULATED_VM, "qemu-system-x86_64 / qemu-img not found",
                            "emulated VM", "apt-get install qemu-system-x86 qemu-utils")
    res = await run_cmd([binary, "-accel", "help"], timeout=CMD_TIMEOUT, check=False, what="qemu -accel help")
    if res.returncode != 0:
        return select.Probe("qemu", False, select.STRENGTH_EMULATED_VM, f"{binary} does not run: {res.stderr[-300:]}",
                            "emulated VM")
    accels = res.stdout.split()
    use_kvm = settings.qemu_accel == "kvm" or (settings.qemu_accel == "auto" and virt.hardware and virt.kvm_device)
    extra = {"binary": binary, "accelerators": accels, "machine": settings.qemu_machine}
    if use_kvm:
        if "kvm" not in accels:
            return select.Probe("qemu", False, select.STRENGTH_KVM_VM, f"{binary} was built without KVM", "hardware VM")
        return select.Probe("qemu", True, select.STRENGTH_KVM_VM, f"{binary} with KVM ({virt.detail})",
                            "hardware VM", None, {**extra, "accel": "kvm"})
    why = (f"{binary} under TCG emulation (no KVM for it: {virt.detail}); a real Linux guest, "
           "slow (cold boot 15-40 s here, restore ~1.5 s)")
    return select.Probe("qemu", "tcg" in accels, select.STRENGTH_EMULATED_VM, why, "emulated VM", None,
                        {**extra, "accel": "tcg"})

