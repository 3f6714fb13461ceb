"""gVisor (runsc) runtime: one OCI container per sandbox, networked through its slot's netns.

agentenv needs runsc 20240729 or newer (Debian 13, bookworm-backports): systrap, checkpoints of
epoll servers, `checkpoint --leave-running`, `--net-disconnect-ok`. What this module handles:
- The platform is chosen per host by measurement (`gvisor_platform.choose_platform`).
- `--network=sandbox` refuses to start on new kernels because /proc/sys/net/core/rmem_default is
  visible in every netns (fixed upstream after 20240807); each run/restore/checkpoint therefore runs
  in a throw-away private mount namespace where a tiny tmpfs, mounted from *inside* the target
  netns, hides /proc/sys/net/core.
- A capture never loses the sandbox: it is frozen (what `runsc pause` does, through the sandbox's
  control socket: `gvisor_control`), checkpointed with `--leave-running` (the call `runsc
  checkpoint` makes, through the same socket; a refused or failed checkpoint leaves it alive: it
  is resumed and the caller gets `CaptureRefused`) and only stopped once the image is complete.
  `--net-disconnect-ok` lets the checkpoint reset TCP connections instead of refusing; since an
  event-loop server whose connection is reset *during* the save can come back deaf after a
  restore, connections are reset first, by a throw-away checkpoint while the sandbox runs, when
  the caller says there are any.
- run/restore leave children holding the CLI's stdio: output goes to a file, never a pipe.
- A failed create leaves cgroup directories behind: stop() removes them.
- runsc saves a container's state file non-atomically; a runsc command killed while saving it
  leaves the sandbox unmanageable. runsc commands run in a session of their own (a signal to the
  server's process group does not reach them), and a cut state file is put back from the state
  agentenv expected (`gvisor_state`).
- Root must be writable in the spec (readonly=true gives EROFS); the host overlayfs rootfs plus
  `--overlay2=none` keeps checkpoints small and restorable.
- Container ids are matched by prefix by runsc: agentenv's ids have a fixed length.
- /tmp is a directory of the sandbox's disk, as in E2B: runsc mounts a tmpfs of its own over an
  *empty* /tmp of the root when the spec mounts nothing there (runsc/boot/vfs.go `mountTmp`, no flag
  turns it off), which kept /tmp out of layers, templates and filesystem snapshots. An explicit bind
  mount of the rootfs' own /tmp would be a second mount (rename(2) between /tmp and the rest of the
  disk failing with EXDEV), so instead a boot never sees /tmp empty (`keep_tmp_on_disk`).
"""

from __future__ import annotations

import asyncio
import glob
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from agentenv import constants
from agentenv.config import Settings
from agentenv.constants import CGROUP_PARENT
from agentenv.errors import CaptureRefused, RuntimeFailure
from agentenv.proc import CmdResult, run_cmd
from agentenv.runtimes.base import RuntimeTraits, SandboxSpec
from agentenv.runtimes import cgroups
from agentenv.runtimes.cgroups import CGROUP_FS, weigh_sandboxes_cpu
from agentenv.runtimes._reaper import ORPHAN_COMM, reap_killed
from agentenv.runtimes import gvisor_control
from agentenv.runtimes.gvisor_platform import MIN_RELEASE, PlatformChoice, choose_platform, default_cache_dir
from agentenv.runtimes.gvisor_state import StateFiles, unreadable_state_file

log = logging.getLogger(__name__)

RUN_TIMEOUT = 60.0
CHECKPOINT_TIMEOUT = 300.0
SHORT_TIMEOUT = 20.0
# After the connection-resetting checkpoint, time for the sandbox's programs to see the resets.
RESET_SETTLE_S = 0.1
CPU_PERIOD_US = 100_000
CONSOLE_LOG = "console.log"  # runsc + sandbox stdout/stderr, in the bundle dir
IMAGE_INFO = "agentenv-runsc.json"  # in each memory image: the runsc release and platform that wrote it

# Run as `sh -c SCRIPT sh <netns path> <runsc argv...>` inside `unshare -m --propagation private`.
_NETNS_WRAPPER = (
    'nsenter --net="$1" mount -t tmpfs -o size=4k agentenv-netcore /proc/sys/net/core || exit 97; '
    'shift; exec "$@"'
)

# Docker's default set plus what an E2B-like sandbox expects of root (they are gVisor's
# capabilities, enforced by its own kernel, not the host's).
_CAPS = [
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
    "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE", "CAP_SYS_PTRACE", "CAP_SYS_NICE",
    "CAP_SYS_RESOURCE", "CAP_NET_ADMIN",
]
_DEFAULT_PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# What keeps /tmp non-empty at a boot: the X11 socket directory systemd-tmpfiles creates in /tmp on
# every booted Debian/Ubuntu (E2B's sandboxes have it), 1777 root:root as X servers require.
TMP_KEEPER = ".X11-unix"


def cgroup_path(sandbox_id: str) -> str:
    return f"/{CGROUP_PARENT}/{sandbox_id}"


def build_oci_spec(spec: SandboxSpec) -> dict[str, Any]:
    """The OCI runtime config for one sandbox."""
    env = {"PATH": _DEFAULT_PATH.split("=", 1)[1], **spec.env}
    if not spec.args:
        raise RuntimeFailure("SandboxSpec.args is empty: nothing to run as the sandbox's first process")
    mem = spec.memory_mb * 1024 * 1024
    oci: dict[str, Any] = {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": list(spec.args),
            "env": [f"{k}={v}" for k, v in env.items()],
            "cwd": "/",
            "capabilities": {k: list(_CAPS) for k in ("bounding", "effective", "inheritable", "permitted")},
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": spec.nofile, "soft": spec.nofile}],
        },
        "root": {"path": str(spec.rootfs), "readonly": False},
        "hostname": spec.hostname,
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs",
             "options": ["nosuid", "noexec", "nodev", "ro"]},
            {"destination": constants.TOOLS_MOUNT, "type": "bind", "source": str(spec.tools_dir),
             "options": ["rbind", "ro"]},
        ],
        "linux": {
            "cgroupsPath": cgroup_path(spec.sandbox_id),
            "resources": {
                "memory": {"limit": mem, "swap": mem},
                "cpu": {"quota": spec.cpu_count * CPU_PERIOD_US, "period": CPU_PERIOD_US},
                "pids": {"limit": spec.pids_limit},
            },
            "namespaces": [
                {"type": "pid"},
                {"type": "network", "path": spec.slot.netns_path},
                {"type": "ipc"},
                {"type": "uts"},
                {"type": "mount"},
            ],
        },
    }
    if spec.boot_id_file is not None:  # a restore must name the same mounts as its checkpoint
        oci["mounts"].append({"destination": "/proc/sys/kernel/random/boot_id", "type": "bind",
                              "source": str(spec.boot_id_file), "options": ["rbind", "ro"]})
    return oci


def keep_tmp_on_disk(rootfs: Path) -> None:
    """Make sure runsc boots with the rootfs' /tmp as /tmp, not a tmpfs of its own over it.

    runsc mounts its tmpfs only over an empty (or missing) /tmp: a missing one is created (1777
    root:root, like E2B's), an empty one gets `TMP_KEEPER`. Only a boot needs this; a restore gets
    its mount table from the memory image. A /tmp symlink is followed one level inside the rootfs.
    """
    tmp = rootfs / "tmp"
    if tmp.is_symlink():
        target = os.readlink(tmp)
        tmp = rootfs / target.lstrip("/") if target.startswith("/") else rootfs / target
        if tmp.is_symlink() or not tmp.resolve().is_relative_to(rootfs.resolve()):
            return
    if not tmp.exists():
        tmp.mkdir(parents=True)
        os.chmod(tmp, 0o1777)
    if not tmp.is_dir():
        return
    with os.scandir(tmp) as entries:
        if next(entries, None) is not None:
            return
    keeper = tmp / TMP_KEEPER
    keeper.mkdir()
    os.chmod(keeper, 0o1777)


def raise_memory_limit(spec: SandboxSpec) -> None:
    """Give the sandbox's host cgroup `memory_headroom_mb` above its size, after runsc applied the spec.

    The spec's limit is what the sandbox sees as MemTotal and what envd's OOM guard enforces by
    killing the largest process; the host limit (which kills the whole Sentry) is the backstop.
    cgroup v1 needs memsw >= limit, so memsw goes up first.
    """
    if spec.memory_headroom_mb <= 0:
        return
    limit = str((spec.memory_mb + spec.memory_headroom_mb) << 20)
    cg = cgroup_path(spec.sandbox_id).lstrip("/")
    v1 = CGROUP_FS / "memory" / cg
    if v1.is_dir():
        files = ("memory.memsw.limit_in_bytes", "memory.limit_in_bytes")
        base = v1
    else:
        files, base = ("memory.max",), CGROUP_FS / cg
    for name in files:
        f = base / name
        if f.exists():
            f.write_text(limit)


class GVisorRuntime:
    """Runtime protocol implementation on top of the runsc CLI."""

    name = "gvisor"

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.runsc = settings.runsc_path
        self.root = settings.paths.runsc_root
        self.platform: str | None = None if settings.runsc_platform == "auto" else settings.runsc_platform
        self.platform_choice: PlatformChoice | None = None
        self._overlay_flag: str | None = None
        self._old_runsc: bool | None = None
        self._flags_lock = asyncio.Lock()
        self._frozen_at: dict[str, float] = {}  # sandbox id -> when its capture froze it
        # sandbox id -> the bundle it was run or restored from by this process: a capture needs its
        # netns and console log, and asking `runsc state` costs a runsc start (~20 ms) each time.
        self._bundles: dict[str, Path] = {}
        self._states = StateFiles(self.root)
        self._control = gvisor_control.Control(self._states)

    # ---------------------------------------------------------------- plumbing

    @property
    def traits(self) -> RuntimeTraits:
        return RuntimeTraits(resets_connections=self.modern, may_stay_frozen=True, captures_running=self.modern,
                             shares_rootfs=True, restore_advances_clock=True)

    async def close(self) -> None:
        """Nothing held across sandboxes (each runsc call is its own process)."""

    @property
    def modern(self) -> bool:
        """runsc >= 20240729: captures keep the sandbox alive when they fail (probed by the first call)."""
        return self._old_runsc is False

    async def _global_flags(self) -> list[str]:
        if self._overlay_flag is None:
            async with self._flags_lock:
                if self._overlay_flag is None:
                    await self._probe()
        assert self._overlay_flag is not None and self.platform is not None
        flags = [f"--root={self.root}", f"--platform={self.platform}", "--network=sandbox", self._overlay_flag]
        if not self._old_runsc:
            # A checkpoint resets TCP connections instead of refusing (and, on old runsc, killing).
            flags.append("--net-disconnect-ok")
        return flags

    async def _probe(self) -> None:
        """The runsc release and the platform this host runs it on (cached across server starts)."""
        choice = await choose_platform(self.runsc, self.settings.runsc_platform,
                                       default_cache_dir(self.settings.data_dir))
        self.platform_choice, self.platform = choice, choice.platform
        self._old_runsc = not choice.runsc_version or choice.runsc_version < MIN_RELEASE
        if self._old_runsc:
            log.warning("runsc %s is release %s, older than %s: a refused checkpoint loses the sandbox; "
                        "run `bash scripts/setup.sh` or `agentenv doctor`", self.runsc,
                        choice.runsc_version or "?", MIN_RELEASE)
        res = await run_cmd([self.runsc, "flags"], timeout=SHORT_TIMEOUT, check=False, what="runsc flags")
        # Newer runsc has --overlay2 (we want it off); very old ones only the boolean --overlay.
        self._overlay_flag = "--overlay2=none" if "overlay2" in (res.stdout + res.stderr) else "--overlay=false"
        weighed = weigh_sandboxes_cpu(self.settings.sandbox_cpu_weight)
        if weighed:
            log.info("sandboxes' CPU weight: %s", weighed)
        log.info("gVisor: runsc %s (release %s), platform %s: %s", self.runsc, choice.runsc_version or "?",
                 choice.platform, choice.reason)

    async def _runsc(self, *args: str, timeout: float = SHORT_TIMEOUT, check: bool = True,
                     netns_path: str | None = None, output_file: Path | None = None) -> CmdResult:
        self.root.mkdir(parents=True, exist_ok=True)
        argv = [self.runsc, *(await self._global_flags()), *args]
        if netns_path is not None:
            argv = ["unshare", "-m", "--propagation", "private", "sh", "-c", _NETNS_WRAPPER, "sh",
                    netns_path, *argv]
        what = f"runsc {args[0]}"
        t0 = time.monotonic()
        for attempt in range(2):
            if output_file is not None:
                with open(output_file, "ab") as f:
                    f.write(f"--- runsc {' '.join(args)} at {time.strftime('%Y-%m-%dT%H:%M:%S')}\n".encode())
                    f.flush()
                    res = await run_cmd(argv, timeout=timeout, check=False, output_file=f, what=what,
                                        new_session=True)
                error = _tail(output_file) if res.returncode != 0 else ""
            else:
                res = await run_cmd(argv, timeout=timeout, check=False, what=what, new_session=True)
                error = (res.stderr.strip() or res.stdout.strip())[-2000:] if res.returncode != 0 else ""
            cut = unreadable_state_file(error) if error else None
            if attempt or cut is None or not await asyncio.to_thread(self._states.repair, cut):
                break
        if res.returncode != 0 and check:
            raise RuntimeFailure(f"{what} failed (rc={res.returncode}): {error}")
        log.debug("runsc %s took %.3fs", " ".join(args), time.monotonic() - t0)
        return res

    async def _set_status(self, command: str, sandbox_id: str, *, check: bool = True) -> CmdResult | None:
        """`runsc pause|resume <id>`: done through the sandbox's control socket (`gvisor_control`,
        ~1 ms instead of a runsc start), else by runsc with the state it will save kept first
        (`gvisor_state`). None when the socket did it."""
        if self.modern:
            t0 = time.monotonic()
            freezer = self._control.freeze if command == "pause" else self._control.thaw
            if await asyncio.to_thread(freezer, sandbox_id):
                log.debug("%s of %s through its control socket took %.4fs", command, sandbox_id,
                          time.monotonic() - t0)
                return None
        self._states.expect(sandbox_id, {"pause": "paused", "resume": "running"}[command])
        return await self._runsc(command, sandbox_id, check=check)

    async def _state(self, sandbox_id: str) -> dict[str, Any] | None:
        res = await self._runsc("state", sandbox_id, check=False)
        if res.returncode != 0:
            return None
        try:
            return json.loads(res.stdout)
        except json.JSONDecodeError:
            return None

    async def _bundle_of(self, sandbox_id: str) -> Path:
        """The running container's bundle dir (after a server restart: from `runsc state`)."""
        bundle = self._bundles.get(sandbox_id)
        if bundle is not None and (bundle / "config.json").is_file():
            return bundle
        st = await self._state(sandbox_id)
        if st is None:
            raise RuntimeFailure(f"runsc knows no container {sandbox_id}")
        self._bundles[sandbox_id] = bundle = Path(st["bundle"])
        return bundle

    async def _netns_and_log(self, sandbox_id: str) -> tuple[str, Path]:
        """The netns path from the container's spec, and its console log."""
        bundle = await self._bundle_of(sandbox_id)
        cfg = json.loads((bundle / "config.json").read_text())
        for ns in cfg.get("linux", {}).get("namespaces", []):
            if ns.get("type") == "network" and ns.get("path"):
                return ns["path"], bundle / CONSOLE_LOG
        raise RuntimeFailure(f"container {sandbox_id} has no network namespace path in its spec")

    def _write_bundle(self, spec: SandboxSpec) -> None:
        spec.bundle_dir.mkdir(parents=True, exist_ok=True)
        self._bundles[spec.sandbox_id] = spec.bundle_dir
        tmp = spec.bundle_dir / "config.json.tmp"
        tmp.write_text(json.dumps(build_oci_spec(spec), indent=2))
        tmp.replace(spec.bundle_dir / "config.json")

    def _tune_host(self, spec: SandboxSpec) -> None:
        """What the host sets on a sandbox's processes once runsc has started them: the memory
        headroom of their cgroup, and their timer slack (`sandbox_timer_slack_us`)."""
        raise_memory_limit(spec)
        if self.settings.sandbox_timer_slack_us > 0:
            cgroups.set_timer_slack(spec.sandbox_id, self.settings.sandbox_timer_slack_us * 1000)

    # ---------------------------------------------------------------- Runtime protocol

    async def start(self, spec: SandboxSpec) -> None:
        await self._global_flags()  # probes the runsc release the bundle must be written for
        self._write_bundle(spec)
        try:
            await asyncio.to_thread(keep_tmp_on_disk, spec.rootfs)
        except OSError as e:  # the boot still works, with gVisor's in-memory /tmp
            log.warning("sandbox %s: cannot keep /tmp on its disk: %s", spec.sandbox_id, e)
        try:
            await self._runsc("run", "--detach", f"--bundle={spec.bundle_dir}", spec.sandbox_id,
                              timeout=RUN_TIMEOUT, netns_path=spec.slot.netns_path,
                              output_file=spec.bundle_dir / CONSOLE_LOG)
            await asyncio.to_thread(self._tune_host, spec)
        except BaseException:
            await asyncio.shield(self.stop(spec.sandbox_id))
            raise

    async def restore(self, spec: SandboxSpec, image_dir: Path) -> None:
        await self._global_flags()  # probes the runsc release the bundle must be written for
        self._write_bundle(spec)
        written_by = image_release(image_dir)
        try:
            await self._runsc("restore", "--detach", f"--image-path={image_dir}", f"--bundle={spec.bundle_dir}",
                              spec.sandbox_id, timeout=RUN_TIMEOUT, netns_path=spec.slot.netns_path,
                              output_file=spec.bundle_dir / CONSOLE_LOG)
            await asyncio.to_thread(self._tune_host, spec)
        except BaseException as e:
            await asyncio.shield(self.stop(spec.sandbox_id))
            ours = self.platform_choice.runsc_version if self.platform_choice else ""
            if isinstance(e, RuntimeFailure) and written_by != ours:
                # gVisor restores only images of its own release (an upgrade from Debian 12's runsc)
                raise RuntimeFailure(
                    f"this memory image was written by runsc {written_by or 'older than ' + MIN_RELEASE} and this "
                    f"node runs runsc {ours or '?'}; gVisor cannot restore a checkpoint across releases "
                    f"(docs/limitations.md, upgrades): {e.message}", error_code="image_incompatible") from e
            raise

    async def checkpoint(self, sandbox_id: str, image_dir: Path, *, reset_connections: bool = False,
                         leave_frozen: bool = False) -> None:
        """Write the sandbox's memory image to `image_dir`, then stop and delete the container
        (`leave_frozen`: on runsc >= 20240729 it is left frozen instead; the caller stops it).

        On runsc >= 20240729 the sandbox is never lost here: if the checkpoint fails it is resumed
        and `CaptureRefused` says why (the sandbox runs on as before). `reset_connections`: the
        sandbox holds TCP connections; they are reset while it runs, before the image is taken.
        """
        await self._global_flags()
        netns_path, log_file = await self._netns_and_log(sandbox_id)
        image_dir.mkdir(parents=True, exist_ok=True)
        if not self.modern:  # old runsc: the checkpoint stops the sandbox, and a refusal kills it
            try:
                await self._runsc("checkpoint", f"--image-path={image_dir}", sandbox_id,
                                  timeout=CHECKPOINT_TIMEOUT, netns_path=netns_path, output_file=log_file)
            finally:
                await asyncio.shield(self.stop(sandbox_id))
            return
        await self._save_frozen(sandbox_id, image_dir, reset_connections, netns_path, log_file)
        self._frozen_at.pop(sandbox_id, None)
        if leave_frozen:  # `runsc delete` (~0.12 s: the sandbox's memory goes) after the caller answered
            return
        # stopped while still frozen: a thawed sandbox would change its disk after the image
        # (files it holds open renamed or deleted), and the image would not restore on that disk
        await asyncio.shield(self.stop(sandbox_id))

    async def checkpoint_running(self, sandbox_id: str, image_dir: Path, *,
                                 while_frozen: Callable[[], Awaitable[None]], reset_connections: bool = False) -> float:
        """Write the sandbox's memory image to `image_dir` and keep it running: frozen (`_set_status`)
        for the image and `while_frozen` (the caller copies its disk: the two describe one instant),
        then thawed. A failure anywhere thaws it and raises `CaptureRefused` (RuntimeFailure if it
        died); a refused image leaves nothing in `image_dir`. Returns how long it was frozen (from
        the freeze until the thaw returned), in seconds."""
        if not self.modern:
            raise CaptureRefused("this runsc cannot checkpoint a sandbox and leave it running")
        netns_path, log_file = await self._netns_and_log(sandbox_id)
        image_dir.mkdir(parents=True, exist_ok=True)
        await self._save_frozen(sandbox_id, image_dir, reset_connections, netns_path, log_file)
        t_image = time.monotonic()
        try:
            await while_frozen()
        except BaseException as e:
            await asyncio.shield(self._thaw(sandbox_id))
            if isinstance(e, Exception) and await self.state(sandbox_id) == "running":
                raise CaptureRefused(f"capturing the disk of the frozen sandbox failed: {e}; "
                                     "the sandbox keeps running unchanged") from e
            raise
        t_disk = time.monotonic()
        await self._thaw(sandbox_id)
        t_end = time.monotonic()
        t0 = self._frozen_at.pop(sandbox_id, t_image)
        log.info("sandbox %s frozen %.3fs: pause + image %.3fs, disk %.3fs, resume %.3fs", sandbox_id, t_end - t0,
                 t_image - t0, t_disk - t_image, t_end - t_disk)
        return t_end - t0

    async def _thaw(self, sandbox_id: str) -> None:
        res = await self._set_status("resume", sandbox_id, check=False)
        if res is not None and res.returncode != 0 and await self.state(sandbox_id) != "running":
            res = await self._set_status("resume", sandbox_id, check=False)  # once more, then say so
            if res is not None and res.returncode != 0:
                raise RuntimeFailure(f"runsc resume {sandbox_id} after its checkpoint failed: "
                                     f"{res.stderr.strip()[-500:]}")

    async def _save_frozen(self, sandbox_id: str, image_dir: Path, reset_connections: bool, netns_path: str,
                           log_file: Path | None) -> None:
        """Freeze the sandbox and write its memory image with `--leave-running`: on success it is left
        frozen (the image and its disk describe the same instant); a failure thaws it and raises
        `CaptureRefused` (or RuntimeFailure if it died)."""
        if reset_connections:
            # A throw-away checkpoint while the sandbox runs: --net-disconnect-ok resets every TCP
            # endpoint, and the programs that held them see ECONNRESET/ECONNABORTED and carry on.
            scratch = image_dir.with_name(image_dir.name + ".reset")
            shutil.rmtree(scratch, ignore_errors=True)
            scratch.mkdir(parents=True)
            try:
                failed = await self._checkpoint_leaving_running(sandbox_id, scratch, netns_path, log_file)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            if failed is not None:
                await self._refused(sandbox_id, failed, "resetting its connections", frozen=False)
            await asyncio.sleep(RESET_SETTLE_S)
        self._frozen_at[sandbox_id] = time.monotonic()
        await self._set_status("pause", sandbox_id)  # kept "paused": also what the checkpoint saves
        failed = await self._checkpoint_leaving_running(sandbox_id, image_dir, netns_path, log_file)
        if failed is not None:
            await self._refused(sandbox_id, failed, "writing its memory image", frozen=True, image_dir=image_dir)
        (image_dir / IMAGE_INFO).write_text(json.dumps({
            "runsc_release": self.platform_choice.runsc_version if self.platform_choice else "",
            "platform": self.platform}))

    async def _checkpoint_leaving_running(self, sandbox_id: str, image_dir: Path, netns_path: str,
                                          log_file: Path | None) -> str | None:
        """`runsc checkpoint --leave-running` into `image_dir`, through the sandbox's control socket
        where it can be (`gvisor_control`; `runsc_checkpoint_via`), else by runsc. None when the image
        is written; else what runsc or the Sentry said (for `_checkpoint_error`)."""
        compression = self.settings.runsc_compression
        if self.settings.runsc_checkpoint_via == "socket":
            t0 = time.monotonic()
            try:
                if await self._control.checkpoint(sandbox_id, image_dir, compression, CHECKPOINT_TIMEOUT):
                    log.debug("checkpoint of %s through its control socket took %.3fs", sandbox_id,
                              time.monotonic() - t0)
                    return None
            except (gvisor_control.Failed, RuntimeFailure, OSError) as e:  # OSError: creating its files
                why = str(e.message if isinstance(e, RuntimeFailure) else e)
                if log_file is not None:  # where runsc's own words would be (`agentenv logs`, support)
                    with open(log_file, "a") as f:
                        f.write(f"--- runsc checkpoint through the control socket at "
                                f"{time.strftime('%Y-%m-%dT%H:%M:%S')}\ncheckpoint failed: {why}\n")
                return why
        self._states.expect(sandbox_id)  # a checkpoint that leaves it running saves it as it was
        res = await self._runsc("checkpoint", "--leave-running", f"--image-path={image_dir}",
                                f"--compression={compression}", sandbox_id, timeout=CHECKPOINT_TIMEOUT,
                                netns_path=netns_path, output_file=log_file, check=False)
        if res.returncode == 0:
            return None
        return _tail(log_file, 20000) if log_file else (res.stderr or res.stdout)

    async def _refused(self, sandbox_id: str, failed: str, step: str, *, frozen: bool,
                       image_dir: Path | None = None) -> None:
        """A checkpoint failed (`failed`: what runsc said): thaw the sandbox and raise CaptureRefused,
        or RuntimeFailure if it died."""
        why = _checkpoint_error(failed)
        full = _disk_full(image_dir) if image_dir is not None else None
        if full:  # runsc 20240729 reports a write failing with ENOSPC as a nil-pointer panic
            why = f"{full} ({why[:200]})"
        if frozen:
            await self._set_status("resume", sandbox_id, check=False)
        if await self.state(sandbox_id) == "running":
            raise CaptureRefused(f"gVisor could not checkpoint the sandbox ({step}): {why}; "
                                 "the sandbox keeps running unchanged")
        raise RuntimeFailure(f"gVisor checkpoint failed ({step}) and the sandbox stopped: {why}")

    async def stop(self, sandbox_id: str) -> None:
        # The sandbox's runsc helpers (Sentry and gofer; never a runsc command, which could be writing
        # its state file) are SIGKILLed and reaped here, and once both are gone what `runsc delete`
        # would still do (its state, lock and control socket, its cgroups) is done here too: no runsc
        # start (~20 ms, as much CPU) per kill. Otherwise `delete --force` (it kills a running or
        # frozen sandbox itself, and looks every 100 ms whether it is gone: killed first, its first
        # look finds it gone); the slow path only runs when that did not remove it.
        self._bundles.pop(sandbox_id, None)
        killed = cgroups.kill_sandbox(sandbox_id, owner=f"--root={self.root}", comm=ORPHAN_COMM)
        deleted = False
        if killed:
            reaped = await asyncio.to_thread(reap_killed, killed)
            log.debug("sandbox %s: killed %d runsc helper(s), reaped %d", sandbox_id, len(killed), reaped)
            deleted = await asyncio.to_thread(self._states.delete_stopped, sandbox_id)
        if not deleted:
            await self._runsc_delete(sandbox_id)
        await cgroups.remove(sandbox_id, owner=f"--root={self.root}")
        # a state file runsc cannot read (cut by a killed runsc, nothing to put back): its processes
        # are gone with the cgroup; what runsc keeps of it would be listed forever
        self._states.remove(sandbox_id)
        self._states.forget(sandbox_id)

    async def _runsc_delete(self, sandbox_id: str) -> None:
        res = await self._runsc("delete", "--force", sandbox_id, check=False)
        if res.returncode != 0 and await self._state(sandbox_id) is not None:
            await self._runsc("kill", sandbox_id, "KILL", check=False)
            res = await self._runsc("delete", "--force", sandbox_id, check=False)
            if res.returncode != 0 and await self._state(sandbox_id) is not None:
                raise RuntimeFailure(f"runsc delete {sandbox_id} failed: {res.stderr.strip()[-1000:]}")

    async def cleanup_orphans(self, keep: set[str]) -> list[str]:
        """Stop our containers not in `keep` and remove empty agentenv cgroups left by failed creates.

        HOST-WIDE for cgroups: only safe when no other agentenv server runs on the host (a sandbox
        another server is creating has an empty cgroup for a moment). The orchestrator's gc scopes
        cleanup to its own data dir instead and does not call this.

        Cgroups are host-wide (shared with other data dirs): only empty ones of ids that runsc does
        not know are removed, rmdir refuses a cgroup that still has processes anyway.
        """
        removed = []
        known = await self.list_ids()
        for sid in known:
            if sid not in keep:
                await self.stop(sid)
                removed.append(sid)
        for d in glob.glob(str(CGROUP_FS / "*" / CGROUP_PARENT / "*")) + glob.glob(str(CGROUP_FS / CGROUP_PARENT / "*")):
            sid = os.path.basename(d)
            if not os.path.isdir(d) or sid in keep or sid in known:
                continue
            try:
                os.rmdir(d)
            except OSError:
                continue  # busy (someone else's live sandbox) or already gone
            if sid not in removed:
                removed.append(sid)
        return removed

    async def is_alive(self, sandbox_id: str) -> bool:
        st = await self._state(sandbox_id)
        return st is not None and st.get("status") in ("running", "paused")

    async def pause(self, sandbox_id: str) -> None:
        await self._set_status("pause", sandbox_id)

    async def resume(self, sandbox_id: str) -> None:
        await self._set_status("resume", sandbox_id)

    async def list_ids(self) -> list[str]:
        if not self.root.exists():
            return []
        res = await self._runsc("list", "--quiet")
        return [line.strip() for line in res.stdout.splitlines() if line.strip()]

    async def state(self, sandbox_id: str) -> str | None:
        """runsc's status string ('running', 'paused', 'stopped', ...) or None if unknown."""
        st = await self._state(sandbox_id)
        return st.get("status") if st else None


def image_release(image_dir: Path) -> str:
    """The runsc release that wrote a memory image ("" for images from before agentenv recorded it,
    which were all written by Debian 12's runsc 20221219)."""
    try:
        return str(json.loads((image_dir / IMAGE_INFO).read_text()).get("runsc_release") or "")
    except (OSError, ValueError):
        return ""


def _disk_full(image_dir: Path) -> str | None:
    """'no space left on device ...' when the file system of a failed checkpoint's image is full."""
    try:
        st = os.statvfs(image_dir)
    except OSError:
        return None
    free = st.f_bfree * st.f_frsize  # runsc writes as root: reserved blocks count
    if free >= 1 << 20:
        return None
    return f"no space left on device for the memory image ({image_dir}: {free // 1024} KiB free)"


_DEAD_DENTRY = re.compile(r'gofer\.dentry\(\\?"([^"\\]*)\\?"\)\.beforeSave: deleted and invalidated dentries')


def _checkpoint_error(log_text: str) -> str:
    """The line of runsc's log that says why a checkpoint failed (its panics are long)."""
    text = log_text[log_text.rfind("--- runsc checkpoint"):] if "--- runsc checkpoint" in log_text else log_text
    dead = _DEAD_DENTRY.search(text)
    if dead:
        return (f"a process in the sandbox holds the deleted file /{dead.group(1)} open, and runsc 20240729 cannot "
                "save deleted files of the sandbox's disk (gVisor added that in 2025, google/gvisor#11425); "
                "close it first, or keep such files in /dev/shm")
    for pat in (r"checkpoint failed: .*", r"(?i)no space left on device.*", r"(?i)error[^\n]*"):
        m = re.search(pat, text)
        if m:
            return m.group(0).strip()[:500]
    if text.startswith("--- runsc checkpoint"):  # our header line, not runsc's words
        text = text.partition("\n")[2]
    return text.strip()[-300:] or "runsc checkpoint failed without a word (killed?)"


def _tail(path: Path, limit: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-limit:].strip()
    except OSError:
        return "(no log)"
