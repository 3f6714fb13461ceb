"""Per-sandbox root filesystems: overlayfs of read-only lowers + one writable upper.

Layout of `<data_dir>/sandboxes/<id>/`:
    upper/    the sandbox's writes (survives checkpoint; copied for fork children)
    work/     overlayfs scratch, same filesystem as upper
    rootfs/   the merged mount handed to the runtime

Mounting is done with mount(2) through ctypes rather than mount(8): no process spawn per sandbox
(forks create many at once) and the errno comes back to us directly.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
from pathlib import Path

from agentenv.config import Paths
from agentenv.constants import TOOLS_MOUNT
from agentenv.errors import BadRequest, NotFound, RuntimeFailure
from agentenv.storage._util import mount, mounts_under, read_mountinfo, run, umount, umount_all_under
from agentenv.storage.quota import DiskQuota

log = logging.getLogger(__name__)

_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
COPY_TIMEOUT = 30 * 60


class RootfsManager:
    """Creates and tears down the overlay root of each sandbox."""

    def __init__(self, paths: Paths, disk_quota: str = "off") -> None:
        self.paths = paths
        self.quota = DiskQuota(disk_quota)

    def _dir(self, sandbox_id: str) -> Path:
        if not _ID_RE.match(sandbox_id):
            raise BadRequest(f"invalid sandbox id {sandbox_id!r}")
        return self.paths.sandbox_dir(sandbox_id)

    def rootfs_path(self, sandbox_id: str) -> Path:
        return self._dir(sandbox_id) / "rootfs"

    def upper_path(self, sandbox_id: str) -> Path:
        """Where the writable layer is: inside the sandbox's disk image if it has one."""
        d = self._dir(sandbox_id)
        return self.quota.mount_point(d) / "upper" if self.quota.has_image(d) else d / "upper"

    def is_mounted(self, sandbox_id: str) -> bool:
        target = os.path.realpath(self.rootfs_path(sandbox_id))
        return any(m.mount_point == target for m in read_mountinfo())

    async def prepare(self, sandbox_id: str, lowers: list[Path], disk_mb: int | None = None) -> Path:
        """Mount overlay(lowers, top first; upper=<sandbox_dir>/upper) at <sandbox_dir>/rootfs.

        An existing upper (e.g. from `copy_upper`) is kept. Calling it again on a mounted
        sandbox returns the same path. With `disk_mb` a new upper gets a disk quota of that size
        where the filesystem supports it (see storage/quota.py).
        """
        if not lowers:
            raise BadRequest("at least one lower layer is required")
        for low in lowers:
            if not Path(low).is_dir():
                raise NotFound(f"lower layer {low} does not exist")
            if any(c in str(low) for c in ",:\\"):
                raise BadRequest(f"lower layer path {low} contains a character overlayfs cannot take")
        d = self._dir(sandbox_id)
        base = d
        if not self.is_mounted(sandbox_id) and not (d / "upper").exists():
            base = await self.quota.ensure(d, disk_mb or 0) or d
        return await asyncio.to_thread(self._prepare, d, [Path(p).resolve() for p in lowers], base)

    def _prepare(self, d: Path, lowers: list[Path], base: Path | None = None) -> Path:
        target = d / "rootfs"
        if self.is_mounted(d.name):
            return target
        base = base or d
        upper, work = base / "upper", base / "work"
        for p in (upper, work, target):
            p.mkdir(parents=True, exist_ok=True)
        # The runtime mounts the tools layer here; give it a mount point without writing into the sandbox later.
        mp = TOOLS_MOUNT.lstrip("/")
        if not any((low / mp).is_dir() for low in lowers) and not (upper / mp).exists():
            (upper / mp).mkdir(mode=0o755)
        opts = f"lowerdir={':'.join(map(str, lowers))},upperdir={upper.resolve()},workdir={work.resolve()}"
        try:
            mount("overlay", str(target.resolve()), "overlay", opts)
        except OSError as exc:
            raise RuntimeFailure(f"cannot mount the rootfs of sandbox {d.name}: {exc} (options: {opts})") from exc
        return target

    async def release(self, sandbox_id: str) -> None:
        """Unmount (lazily if busy) and delete <sandbox_dir>. Safe to call repeatedly."""
        await asyncio.to_thread(self._release, self._dir(sandbox_id))

    @staticmethod
    def _release(d: Path) -> None:
        if not d.exists():
            return
        _umount_rootfs_first(d)  # the overlay and anything a runtime mounted below the sandbox dir
        shutil.rmtree(d)

    async def unmount(self, sandbox_id: str, *, keep_disk: bool = False) -> None:
        """Unmount the overlay but keep upper/ and the rest of the sandbox dir (pause, sealing).

        `keep_disk` leaves the sandbox's disk image mounted, so its upper can be sealed (capture);
        otherwise the image is unmounted too (a paused sandbox holds no loop device)."""
        d = self._dir(sandbox_id)
        if d.exists():
            if keep_disk:
                await asyncio.to_thread(_umount_rootfs_only, d)
            else:
                await asyncio.to_thread(_umount_rootfs_first, d)

    async def cleanup_orphans(self, keep: set[str]) -> list[str]:
        """Unmount and delete sandbox dirs (and stray mounts below them) whose id is not in `keep`."""
        return await asyncio.to_thread(self._cleanup_orphans, set(keep))

    def _cleanup_orphans(self, keep: set[str]) -> list[str]:
        root = Path(os.path.realpath(self.paths.sandboxes))
        ids: set[str] = set()
        for mp in mounts_under(root):
            rel = Path(mp).relative_to(root).parts
            if rel and rel[0] not in keep:
                ids.add(rel[0])
        if root.is_dir():
            ids |= {p.name for p in root.iterdir() if p.name not in keep}
        removed = []
        for sid in sorted(ids):
            try:
                self._release(root / sid)
                removed.append(sid)
            except (OSError, RuntimeFailure) as exc:
                log.warning("could not clean up orphan sandbox dir %s: %s", sid, exc)
        return removed

    async def copy_upper(self, src_id: str, dst_id: str) -> Path:
        """Copy src's upper layer to dst (owners, modes, xattrs, whiteouts, hard links preserved).

        For fork children: call while the source is paused/checkpointed, then `prepare(dst_id, …)`
        with the same lowers. dst must not have an upper yet.
        """
        src, dst = self._dir(src_id) / "upper", self._dir(dst_id) / "upper"
        if not src.is_dir():
            raise NotFound(f"sandbox {src_id} has no upper layer")
        if dst.exists():
            raise RuntimeFailure(f"sandbox {dst_id} already has an upper layer")
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name("upper.partial")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            await run(["cp", "-a", "--reflink=auto", "--", str(src), str(tmp)], timeout=COPY_TIMEOUT)
            os.rename(tmp, dst)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return dst


def _umount_rootfs_only(d: Path) -> None:
    rootfs = os.path.realpath(d / "rootfs")
    for mp in mounts_under(Path(rootfs)):
        umount(mp)


def _umount_rootfs_first(d: Path) -> None:
    """The overlay before the disk image its upper lives on (same depth, so order it explicitly)."""
    rootfs = d / "rootfs"
    if os.path.realpath(rootfs) in mounts_under(rootfs):
        umount(os.path.realpath(rootfs))
    umount_all_under(d)
