"""Image store: builds and caches the shared read-only base image and the tools layer.

Layout under `<data_dir>/images/`:
    base/rootfs/          the default image (debootstrap minbase + a few tools), never written after build
    base/manifest.json    name, created, suite, packages, size, build id, extras (Node.js), revision
    base.log              debootstrap + customisation output of the last build
    tools/<hash>/         the tools layer (own interpreter + envd), see `agentenv.storage.tools`
    .cache/nodejs/        the pinned Node.js/npm tarballs the base image unpacks (`agentenv.storage.nodejs`)
    .<name>.lock          flock serialising builds across processes

Builds happen in a hidden temp dir next to the target and are published with one rename, so a
reader sees either nothing or a complete image. An image built by an older agentenv is brought up to
date in place, under the build lock, by additive fix-ups (`_fix_up_base`): Node.js/npm added, the
statx preload line of runsc releases before 2023 removed. Each fix-up bumps the manifest's
`revision`, which names the rootfs in derived caches (microVM root drives).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from agentenv import constants
from agentenv.config import Settings
from agentenv.errors import BadRequest, NotFound, RuntimeFailure
from agentenv.storage._util import CommandError, file_lock, run, tree_size, umount_all_under
from agentenv.storage import nodejs

log = logging.getLogger(__name__)

ProgressFn = Callable[[str, float | None], None]  # (message, fraction 0..1 or None)

BASE_IMAGE = "base"
BASE_PACKAGES = [
    "bash", "coreutils", "python3", "python3-pip", "git", "curl", "ca-certificates", "procps", "sudo",
    # cheap extras that agents expect to find
    "python3-venv", "python-is-python3", "iproute2", "less", "unzip",
]
HOSTNAME = "sandbox"
# Public resolvers: the sandbox network NATs out through the host; the runtime may bind-mount its own.
NAMESERVERS = ["8.8.8.8", "1.1.1.1"]

DEBOOTSTRAP_TIMEOUT = 30 * 60
CHROOT_TIMEOUT = 120
_RESERVED = {"tools", "vm"}
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class ImageBuildError(RuntimeFailure):
    """Building an image failed; the message names the log file."""


class _DebootstrapProgress:
    """Turns debootstrap's `I:` lines into (message, fraction) calls.

    debootstrap prints no totals, but it lists every .deb it will fetch in <target>/debootstrap/deburis
    before downloading, and the resolved {required,base} lists right after, so counts are exact.
    """

    # (line prefix, phase start, phase end, which list sizes the phase)
    PHASES = [
        ("Retrieving ", 0.05, 0.45, "all"),
        ("Validating ", None, None, None),
        ("Extracting ", 0.45, 0.52, "required"),
        ("Installing core packages", 0.52, 0.52, None),
        ("Unpacking required packages", 0.52, 0.52, None),
        ("Configuring required packages", 0.62, 0.62, None),
        ("Unpacking the base system", 0.70, 0.70, None),
        ("Configuring the base system", 0.80, 0.80, None),
        ("Base system installed successfully", 0.92, 0.92, None),
    ]

    def __init__(self, target: Path, progress: ProgressFn | None, end: float = 0.92):
        self.target = target
        self.progress = progress
        self.scale = end / 0.92
        self.counts: dict[str, int] = {}
        self.totals: dict[str, int] | None = None
        self.stage = "resolve"  # which Unpacking/Configuring block we are in
        self.fraction = 0.0

    def _load_totals(self) -> dict[str, int]:
        if self.totals is None:
            d = self.target / "debootstrap"
            try:
                n_all = len((d / "deburis").read_text().splitlines())
            except OSError:
                return {}
            try:
                req = (d / "required").read_text().split()
                base = (d / "base").read_text().split()
            except OSError:  # not written yet (still downloading): only the total is known
                return {"all": n_all}
            self.totals = {"required": len(req), "base": len(base), "all": n_all}
        return self.totals

    def _emit(self, msg: str, frac: float | None) -> None:
        if frac is not None:
            self.fraction = max(self.fraction, min(frac, 0.92)) * self.scale
            frac = self.fraction
        if self.progress is not None:
            self.progress(msg, frac)

    def feed(self, line: str) -> None:
        if not line.startswith("I: "):
            return
        msg = line[3:].strip()
        headers = {
            "Unpacking required packages": "unpack-required",
            "Configuring required packages": "configure-required",
            "Unpacking the base system": "unpack-base",
            "Configuring the base system": "configure-base",
        }
        for header, stage in headers.items():
            if msg.startswith(header):
                self.stage = stage
                break
        else:
            header = ""
        # per-package dpkg lines inside the four install blocks
        blocks = {
            "unpack-required": ("Unpacking ", 0.52, 0.57, "required"),
            "configure-required": ("Configuring ", 0.62, 0.70, "required"),
            "unpack-base": ("Unpacking ", 0.70, 0.80, "base"),
            "configure-base": ("Configuring ", 0.80, 0.92, "base"),
        }
        if self.stage in blocks and not header:
            prefix, lo, hi, which = blocks[self.stage]
            if msg.startswith(prefix) and msg.endswith("..."):
                self._count(self.stage, msg, lo, hi, which)
                return
        for prefix, lo, hi, which in self.PHASES:
            if msg.startswith(prefix):
                if which is None:
                    self._emit(msg, self.fraction / self.scale if lo is None else lo)
                else:
                    self._count(prefix, msg, lo, hi, which)
                return
        self._emit(msg, None)

    def _count(self, key: str, msg: str, lo: float, hi: float, which: str) -> None:
        n = self.counts[key] = self.counts.get(key, 0) + 1
        total = self._load_totals().get(which)
        if not total:
            self._emit(msg, None)
            return
        self._emit(f"{msg} ({min(n, total)}/{total})", lo + (hi - lo) * min(n / total, 1.0))


class ImageStore:
    """Builds and hands out read-only images. Safe to use from several processes at once."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.paths = settings.paths
        self.images_dir = self.paths.images
        self._base_ready: Path | None = None  # set once the base image is known good in this process
        self._checked: set[str] = set()  # images already cleaned of the legacy preload line

    # --- lookup ------------------------------------------------------------------------------

    def image_dir(self, name: str) -> Path:
        if not _NAME_RE.match(name) or name in _RESERVED:
            raise BadRequest(f"invalid image name {name!r}")
        return self.images_dir / name

    def image_rootfs(self, name: str) -> Path:
        """'base' -> <data_dir>/images/base/rootfs; NotFound if that image was never built."""
        root = self.image_dir(name) / "rootfs"
        if not (self.image_dir(name) / "manifest.json").is_file() or not root.is_dir():
            raise NotFound(f"image {name!r} is not built (run `agentenv image build` or start the server)")
        if name not in self._checked:  # imported images carry the old preload line too
            if remove_legacy_preload(root):
                manifest = self.image_dir(name) / "manifest.json"
                m = json.loads(manifest.read_text())
                m["revision"] = int(m.get("revision", 0)) + 1
                _write_json(manifest, m)
            self._checked.add(name)
        return root

    def manifest(self, name: str) -> dict:
        try:
            return json.loads((self.image_dir(name) / "manifest.json").read_text())
        except FileNotFoundError:
            raise NotFound(f"image {name!r} is not built") from None

    def list_images(self) -> list[dict]:
        """[{name, size, created}] of every built image, sorted by name (for the CLI)."""
        out = []
        if not self.images_dir.is_dir():
            return out
        for d in sorted(self.images_dir.iterdir()):
            if d.name.startswith(".") or d.name in _RESERVED or not d.is_dir():
                continue
            try:
                m = json.loads((d / "manifest.json").read_text())
            except (OSError, ValueError):
                continue
            out.append({"name": m.get("name", d.name), "size": m.get("size"), "created": m.get("created")})
        return out

    # --- image references (template builds' fromImage) ---------------------------------------

    def image_digest(self, name: str) -> str:
        """What identifies the content of a built/imported image (its manifest's build id)."""
        m = self.manifest(name)
        return str(m.get("digest") or m.get("build_id") or m.get("created", ""))

    async def resolve_image_ref(self, ref: str, *, registry: dict | None = None,
                                progress: ProgressFn | None = None) -> str:
        """An image reference of a template build -> the name of a local image.

        `e2bdev/base` (the SDK's default) and `base` are our base image; other references must have
        been imported (`agentenv image import`) or be pullable from a reachable registry.
        """
        from agentenv.storage import oci

        if ref in oci.BASE_IMAGE_REFS:
            await self.ensure_base(progress)
            return BASE_IMAGE
        name = oci.local_name(ref)
        if (self.images_dir / name / "manifest.json").is_file():
            return name
        return await oci.pull(self, ref, registry=registry, progress=progress)

    # --- base image --------------------------------------------------------------------------

    async def ensure_base(self, progress: ProgressFn | None = None) -> Path:
        """Return the base image rootfs, building it first if absent (one builder across processes)."""
        if self._base_ready is not None:  # every create asks: the checks below run once per process
            return self._base_ready
        target = self.images_dir / BASE_IMAGE
        if (target / "manifest.json").is_file():
            if self._needs_fix_up(target):
                self.images_dir.mkdir(parents=True, exist_ok=True)
                async with file_lock(self.images_dir / f".{BASE_IMAGE}.lock"):
                    await self._fix_up_base(target, progress)
            ensure_sudo_shim(target / "rootfs")  # images cached before sudo over envd existed
            self._base_ready = target / "rootfs"
            return self._base_ready
        self.images_dir.mkdir(parents=True, exist_ok=True)
        if progress:
            progress("waiting for the image build lock", None)
        async with file_lock(self.images_dir / f".{BASE_IMAGE}.lock"):
            if (target / "manifest.json").is_file():  # another process built it while we waited
                return target / "rootfs"
            self._remove_stale(BASE_IMAGE)
            if target.exists():  # a directory without manifest is a broken leftover
                await asyncio.to_thread(shutil.rmtree, target)
            tmp = self.images_dir / f".{BASE_IMAGE}.tmp-{uuid.uuid4().hex[:8]}"
            try:
                await self._build_base(tmp, progress)
                os.rename(tmp, target)
            except BaseException:
                await asyncio.to_thread(self._remove_tree, tmp)
                raise
        if progress:
            progress("base image ready", 1.0)
        return target / "rootfs"

    @staticmethod
    def _needs_fix_up(target: Path) -> bool:
        rootfs = target / "rootfs"
        return has_legacy_preload(rootfs) or has_slow_profile(rootfs) or not nodejs.is_current(rootfs)

    async def _fix_up_base(self, target: Path, progress: ProgressFn | None) -> None:
        """Bring a base image built by an older agentenv up to date, in place (caller holds the lock)."""
        rootfs = target / "rootfs"
        changed = remove_legacy_preload(rootfs)
        changed = speed_up_profile(rootfs) or changed
        if not nodejs.is_current(rootfs):
            log.info("adding Node.js %s to the cached base image", nodejs.NODE_VERSION)
            try:
                await asyncio.to_thread(nodejs.install, rootfs, self._node_cache(),
                                        self.images_dir / f"{BASE_IMAGE}.log", progress, (0.0, 0.95))
                changed = True
            except (nodejs.NodeInstallError, OSError) as exc:
                # The image works without it; the next server start tries again.
                log.warning("cached base image kept without Node.js %s: %s", nodejs.NODE_VERSION, exc)
                if progress:
                    progress(f"Node.js not added to the cached base image: {exc}", None)
        if changed:
            manifest = json.loads((target / "manifest.json").read_text())
            manifest["extras"] = {"nodejs": nodejs.installed(rootfs)}
            manifest["revision"] = int(manifest.get("revision", 0)) + 1
            _write_json(target / "manifest.json", manifest)
            if progress:
                progress("base image updated", 1.0)

    def _node_cache(self) -> Path:
        return self.images_dir / ".cache" / "nodejs"

    def _remove_stale(self, name: str) -> None:
        """Temp dirs of builds that died (we hold the lock, so nobody else is using them)."""
        for d in self.images_dir.glob(f".{name}.tmp-*"):
            self._remove_tree(d)

    @staticmethod
    def _remove_tree(d: Path) -> None:
        if d.exists():
            umount_all_under(d)  # never recurse into a leftover /proc or /sys mount
            shutil.rmtree(d, ignore_errors=False)

    async def _build_base(self, tmp: Path, progress: ProgressFn | None) -> None:
        s = self.settings
        rootfs = tmp / "rootfs"
        rootfs.mkdir(parents=True)
        logfile = self.images_dir / f"{BASE_IMAGE}.log"
        logfile.write_text(f"# build of {BASE_IMAGE} started {datetime.now(timezone.utc).isoformat()}\n")
        started = time.monotonic()
        parser = _DebootstrapProgress(rootfs, progress, end=0.85)
        if progress:
            progress(f"debootstrap {s.debian_suite} from {s.debian_mirror}", 0.0)
        # A private mount namespace: whatever debootstrap mounts (proc, sys) dies with it.
        argv = [
            "unshare", "--mount", "--propagation", "private", "--",
            "debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
            s.debian_suite, str(rootfs), s.debian_mirror,
        ]
        try:
            await run(argv, timeout=DEBOOTSTRAP_TIMEOUT, log=logfile, on_line=parser.feed)
            if progress:
                progress("customising the image", 0.86)
            await self._customise(rootfs, logfile)
            await asyncio.to_thread(nodejs.install, rootfs, self._node_cache(), logfile, progress, (0.88, 0.96))
            if progress:
                progress("writing manifest", 0.97)
            manifest = await asyncio.to_thread(self._make_manifest, rootfs, started)
        except CommandError as exc:
            raise ImageBuildError(f"building image {BASE_IMAGE!r} failed: {exc} (full log: {logfile})") from None
        except nodejs.NodeInstallError as exc:
            raise ImageBuildError(f"building image {BASE_IMAGE!r} failed: {exc}") from None
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        with open(logfile, "a") as f:
            f.write(f"# done in {manifest['build_seconds']} s, {manifest['size']} bytes\n")
        log.info("built image %s in %.1fs", BASE_IMAGE, manifest["build_seconds"])

    async def _customise(self, rootfs: Path, logfile: Path) -> None:
        """User `user` (1000:1000, passwordless sudo), hostname, hosts, resolver, no apt caches."""
        chroot = ["chroot", str(rootfs)]
        uid = 1000
        await run(
            chroot + ["useradd", "--create-home", "--home-dir", constants.DEFAULT_HOME, "--shell", "/bin/bash",
                      "--uid", str(uid), "--user-group", constants.DEFAULT_USER],
            timeout=CHROOT_TIMEOUT, log=logfile,
        )
        sudoers = rootfs / "etc/sudoers.d" / constants.DEFAULT_USER
        sudoers.write_text(f"{constants.DEFAULT_USER} ALL=(ALL:ALL) NOPASSWD: ALL\n")
        sudoers.chmod(0o440)
        await run(chroot + ["visudo", "-c", "-f", f"/etc/sudoers.d/{constants.DEFAULT_USER}"],
                  timeout=CHROOT_TIMEOUT, log=logfile)
        ensure_sudo_shim(rootfs)  # gVisor forces no_new_privs: setuid /usr/bin/sudo cannot elevate
        speed_up_profile(rootfs)
        (rootfs / "etc/hostname").write_text(HOSTNAME + "\n")
        (rootfs / "etc/hosts").write_text(
            f"127.0.0.1\tlocalhost\n127.0.1.1\t{HOSTNAME}\n"
            "::1\tlocalhost ip6-localhost ip6-loopback\nff02::1\tip6-allnodes\nff02::2\tip6-allrouters\n"
        )
        resolv = rootfs / "etc/resolv.conf"
        if resolv.is_symlink() or resolv.exists():
            resolv.unlink()
        resolv.write_text("".join(f"nameserver {ns}\n" for ns in NAMESERVERS))
        suite, mirror = self.settings.debian_suite, self.settings.debian_mirror
        (rootfs / "etc/apt/sources.list").write_text(
            f"deb {mirror} {suite} main\ndeb {mirror} {suite}-updates main\n"
            f"deb http://security.debian.org/debian-security {suite}-security main\n"
        )
        await run(chroot + ["apt-get", "clean"], timeout=CHROOT_TIMEOUT, log=logfile)
        for d in ("var/lib/apt/lists", "var/cache/apt", "var/log"):
            for p in (rootfs / d).glob("*"):
                if p.is_file() and not p.is_symlink() and p.name != "lock":
                    p.unlink()
        shutil.rmtree(rootfs / "debootstrap", ignore_errors=True)
        (rootfs / constants.TOOLS_MOUNT.lstrip("/")).mkdir(mode=0o755, exist_ok=True)  # tools layer mount point
        machine_id = rootfs / "etc/machine-id"
        if machine_id.exists():
            machine_id.write_text("")  # each sandbox is its own machine

    def _make_manifest(self, rootfs: Path, started: float) -> dict:
        packages = _dpkg_packages(rootfs)
        return {
            "name": BASE_IMAGE,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "suite": self.settings.debian_suite,
            "mirror": self.settings.debian_mirror,
            "requested_packages": BASE_PACKAGES,
            "packages": packages,
            "extras": {"nodejs": nodejs.installed(rootfs)},
            "size": tree_size(rootfs),
            "build_id": uuid.uuid4().hex,
            "build_seconds": round(time.monotonic() - started, 1),
        }

    # --- tools layer -------------------------------------------------------------------------

    async def ensure_tools(self, progress: ProgressFn | None = None) -> Path:
        """The tools layer dir for the current envd sources (rebuilt only when they change)."""
        from agentenv.storage import tools

        return await tools.ensure_tools(self, progress)

    def envd_argv(self) -> list[str]:
        """argv (paths as seen inside the sandbox) that starts envd from the tools layer."""
        from agentenv.storage import tools

        return tools.envd_argv()

    def envd_env(self) -> dict[str, str]:
        """Environment of the envd process itself (no PYTHON*/LD_* vars: nothing leaks to children)."""
        from agentenv.storage import tools

        return tools.envd_env()


def _dpkg_packages(rootfs: Path) -> dict[str, str]:
    """{package: version} of everything installed, from the image's dpkg status file."""
    pkgs: dict[str, str] = {}
    status = rootfs / "var/lib/dpkg/status"
    if not status.exists():
        return pkgs
    for stanza in status.read_text(errors="replace").split("\n\n"):
        fields = dict(
            line.split(": ", 1) for line in stanza.splitlines() if ": " in line and not line.startswith(" ")
        )
        if fields.get("Status", "").endswith(" installed") and "Package" in fields:
            pkgs[fields["Package"]] = fields.get("Version", "")
    return dict(sorted(pkgs.items()))


# The line runsc releases before mid-2023 needed (a preload shim that dropped AT_NO_AUTOMOUNT from
# statx/fstatat); images built by older agentenv versions carry it. The shim is gone from the tools
# layer, and glibc's loader prints an error to stderr in *every* process while the line names a
# missing file, so images are cleaned of it (`remove_legacy_preload`).
LEGACY_PRELOAD = f"{constants.TOOLS_MOUNT}/compat/libagentenv_compat.so"


def has_legacy_preload(rootfs: Path) -> bool:
    try:
        return LEGACY_PRELOAD in (rootfs / "etc/ld.so.preload").read_text().split()
    except OSError:
        return False


def remove_legacy_preload(rootfs: Path) -> bool:
    """Drop agentenv's old statx shim from the image's /etc/ld.so.preload; True if it was there.

    Other preload entries stay; a file left empty is removed (Debian ships none). The file is replaced
    by rename, never rewritten in place (image trees may share inodes through hard links).
    """
    f = rootfs / "etc/ld.so.preload"
    if not has_legacy_preload(rootfs):
        return False
    try:
        keep = [line for line in f.read_text().splitlines() if line.strip() != LEGACY_PRELOAD]
    except FileNotFoundError:  # another process cleaned it meanwhile
        return False
    if any(line.strip() for line in keep):
        tmp = f.with_name(f".ld.so.preload.tmp-{uuid.uuid4().hex[:8]}")
        tmp.write_text("\n".join(keep) + "\n")
        os.chmod(tmp, 0o644)
        os.rename(tmp, f)
    else:
        f.unlink(missing_ok=True)
    return True


# Debian's /etc/profile asks `id -u` (a fork and an exec) on every login shell, and every SDK command
# is one (`bash -l -c`): about 25 ms of each `commands.run` under gVisor. bash has it as $EUID.
SLOW_PROFILE_TEST = '"$(id -u)"'
FAST_PROFILE_TEST = '"${EUID:-$(id -u)}"'


def has_slow_profile(rootfs: Path) -> bool:
    try:
        return SLOW_PROFILE_TEST in (rootfs / "etc/profile").read_text()
    except OSError:
        return False


def speed_up_profile(rootfs: Path) -> bool:
    """Let /etc/profile take the uid from bash's $EUID (other shells still ask `id -u`); True if changed.

    Replaced by rename, never rewritten in place (image trees may share inodes through hard links)."""
    f = rootfs / "etc/profile"
    if not has_slow_profile(rootfs):
        return False
    st = f.stat()
    tmp = f.with_name(f".profile.tmp-{uuid.uuid4().hex[:8]}")
    tmp.write_text(f.read_text().replace(SLOW_PROFILE_TEST, FAST_PROFILE_TEST))
    os.chmod(tmp, st.st_mode & 0o7777)
    os.rename(tmp, f)
    return True


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.rename(tmp, path)


SUDO_SHIM_PATH = "usr/local/bin/sudo"
_SUDO_SHIM_MARKER = "# agentenv sudo shim"


def sudo_shim_text() -> str:
    """/usr/local/bin/sudo: runs `agentenv.envd.sudo` (sudo over envd) with the tools layer's interpreter."""
    from agentenv.storage.tools import envd_argv

    argv = envd_argv()
    argv = [a for a in argv[: argv.index("-m")] if a != "-u"] + ["-m", "agentenv.envd.sudo"]
    return (
        "#!/bin/sh\n"
        f"{_SUDO_SHIM_MARKER}: gVisor sets no_new_privs on every process, so the setuid /usr/bin/sudo cannot\n"
        "# elevate; envd (root) runs the command instead, see agentenv/envd/sudo.py. /usr/bin/sudo is untouched.\n"
        f"exec {' '.join(argv)} \"$@\"\n"
    )


def ensure_sudo_shim(rootfs: Path) -> None:
    """Install /usr/local/bin/sudo -> sudo over envd in an image (idempotent).

    /usr/local/bin precedes /usr/bin in every PATH the sandbox sets up, so `sudo` resolves to the shim;
    the real sudo stays at /usr/bin/sudo (it works only on gVisor releases that honour the OCI
    `noNewPrivileges: false`). A /usr/local/bin/sudo that is not our shim is left alone. The file is
    replaced by rename, never rewritten in place (image trees may share inodes through hard links).
    """
    f = rootfs / SUDO_SHIM_PATH
    text = sudo_shim_text()
    try:
        current = f.read_text(errors="replace")
    except FileNotFoundError:
        current = None
    except OSError:
        return
    if current == text and (f.stat().st_mode & 0o777) == 0o755:
        return
    if current is not None and _SUDO_SHIM_MARKER not in current:
        log.warning("%s exists and is not agentenv's sudo shim; leaving it alone", f)
        return
    f.parent.mkdir(parents=True, exist_ok=True)
    tmp = f.with_name(f".sudo.tmp-{uuid.uuid4().hex[:8]}")
    tmp.write_text(text)
    tmp.chmod(0o755)
    os.rename(tmp, f)
