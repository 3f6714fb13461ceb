"""Per-sandbox disk quota on the writable layer: a sparse ext4 image per sandbox, loop-mounted.

Why this mechanism: a sandbox's writes land in its overlay upper directory on the host, so the
quota must bound that tree. Project quotas (XFS `prjquota`, ext4 `project`) would do it with no
per-sandbox filesystem, but kernels built without CONFIG_XFS_QUOTA / CONFIG_QFMT_V2 (ours) cannot
mount them. A sparse image of the sandbox's disk size, formatted ext4 and loop-mounted at
`<sandbox_dir>/disk` holding `upper/` and `work/`, works on any kernel with loop devices: the
filesystem is full at the limit (ENOSPC inside the sandbox), the host only pays for blocks written,
and deleting the sandbox frees everything. Costs: ~40-80 ms per new upper (mkfs + mount), and
sealing an upper into a layer becomes an extraction of its tar instead of a rename (different
filesystems).
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

from agentenv.errors import RuntimeFailure
from agentenv.proc import run_cmd

log = logging.getLogger(__name__)

QUOTA_TIMEOUT = 60.0
IMAGE = "disk.img"
MOUNT = "disk"


class DiskQuota:
    """Creates, mounts and measures per-sandbox disk images (mode "loop"); does nothing when "off"."""

    def __init__(self, mode: str = "off") -> None:
        self.mode = mode

    @property
    def enabled(self) -> bool:
        return self.mode == "loop"

    def probe(self) -> None:
        if self.enabled and (shutil.which("mkfs.ext4") is None or not Path("/dev/loop-control").exists()):
            raise RuntimeFailure("disk_quota=loop needs mkfs.ext4 (e2fsprogs) and loop devices")

    @staticmethod
    def mount_point(sandbox_dir: Path) -> Path:
        return sandbox_dir / MOUNT

    @staticmethod
    def has_image(sandbox_dir: Path) -> bool:
        return (sandbox_dir / IMAGE).exists()

    async def ensure(self, sandbox_dir: Path, size_mb: int) -> Path | None:
        """Mount the sandbox's disk image (created at `size_mb` MiB the first time, when quotas are
        on); returns the directory to hold upper/ and work/, or None for a sandbox without one.
        An existing image is mounted whatever the mode, so turning quotas off loses no data."""
        img, mnt = sandbox_dir / IMAGE, self.mount_point(sandbox_dir)
        if not img.exists() and (not self.enabled or size_mb <= 0):
            return None
        if mnt.is_mount():
            return mnt
        t0 = time.monotonic()
        mnt.mkdir(parents=True, exist_ok=True)
        if not img.exists():
            tmp = img.with_suffix(".partial")
            with open(tmp, "wb") as f:
                f.truncate(size_mb << 20)
            # No journal: the image lives and dies with one sandbox; root-owned reserve 0; lazy init.
            res = await run_cmd(["mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-m", "0",
                                 "-E", "lazy_itable_init=1,nodiscard", str(tmp)],
                                timeout=QUOTA_TIMEOUT, check=False, what="mkfs.ext4")
            if res.returncode != 0:
                tmp.unlink(missing_ok=True)
                raise RuntimeFailure(f"mkfs.ext4 for the sandbox disk failed: {res.stderr.strip()[-300:]}")
            tmp.rename(img)
        res = await run_cmd(["mount", "-o", "loop,noatime", str(img), str(mnt)], timeout=QUOTA_TIMEOUT,
                            check=False, what="mount sandbox disk")
        if res.returncode != 0:
            raise RuntimeFailure(f"cannot mount the sandbox disk {img}: {res.stderr.strip()[-300:]}")
        (mnt / "lost+found").is_dir() and shutil.rmtree(mnt / "lost+found", ignore_errors=True)
        log.debug("sandbox disk %s (%d MiB) ready in %.1f ms", img, size_mb, (time.monotonic() - t0) * 1000)
        return mnt
