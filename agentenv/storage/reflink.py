"""Copy-on-write files for microVM disks and memory images: reflink copies (FICLONE).

A VM's writable disk is a raw file; giving every sandbox (and every fork child) its own copy must
not cost a full copy. XFS and btrfs share the unchanged blocks of a reflink copy (a 1 GiB copy in
8-21 ms on our machines); ext4 cannot. When the data dir's filesystem cannot reflink, the store
lives on an XFS filesystem in a sparse image file under the data dir, loop-mounted at
`<data_dir>/vm` (loop devices and XFS are built into common kernels; device-mapper, NBD and ublk,
the usual alternatives, are not on ours).

The same reflinks make snapshot files cheap: a memory image moved into a capture directory, a
full image rebuilt from a base image plus a diff snapshot's dirty pages, a child's disk.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import subprocess
import uuid
from pathlib import Path

log = logging.getLogger(__name__)

FICLONE = 0x40049409          # _IOW(0x94, 9, int)
SEEK_DATA, SEEK_HOLE = 3, 4
_CHUNK = 1 << 20


def reflink(src: Path, dst: Path) -> None:
    """dst = a copy-on-write clone of src (same filesystem, XFS/btrfs); raises OSError otherwise."""
    tmp = dst.with_name(f".{dst.name}.{uuid.uuid4().hex[:8]}")
    with open(src, "rb") as s, open(tmp, "wb") as d:
        try:
            fcntl.ioctl(d.fileno(), FICLONE, s.fileno())
        except OSError:
            d.close()
            tmp.unlink(missing_ok=True)
            raise
    os.replace(tmp, dst)


def sparse_copy(src: Path, dst: Path) -> None:
    """A plain copy that keeps holes (memory images are mostly holes)."""
    tmp = dst.with_name(f".{dst.name}.{uuid.uuid4().hex[:8]}")
    size = src.stat().st_size
    with open(src, "rb") as s, open(tmp, "wb") as d:
        d.truncate(size)
        for start, end in data_extents(s.fileno(), size):
            _copy_range(s.fileno(), d.fileno(), start, end)
    os.replace(tmp, dst)


def clone(src: Path, dst: Path) -> bool:
    """Reflink if possible, else a sparse copy. Returns True when it was a reflink."""
    try:
        reflink(src, dst)
        return True
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EXDEV, errno.EINVAL, errno.ENOTTY, errno.EPERM):
            raise
    sparse_copy(src, dst)
    return False


def data_extents(fd: int, size: int) -> list[tuple[int, int]]:
    """[(start, end)] of the regions of a sparse file that hold data."""
    out = []
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:  # no data after pos
                break
            raise
        end = os.lseek(fd, start, SEEK_HOLE)
        out.append((start, end))
        pos = end
    return out


def _copy_range(src_fd: int, dst_fd: int, start: int, end: int) -> None:
    off = start
    while off < end:
        try:
            n = os.copy_file_range(src_fd, dst_fd, min(_CHUNK * 64, end - off), off, off)
        except OSError as e:   # across filesystems (EXDEV on kernels >= 5.19): plain reads and writes
            if e.errno not in (errno.EXDEV, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            buf = os.pread(src_fd, min(_CHUNK, end - off), off)
            n = os.pwrite(dst_fd, buf, off) if buf else 0
        if n == 0:
            break
        off += n


def apply_diff(base: Path, diff: Path, out: Path) -> int:
    """out = base with every data region of the (sparse) diff written over it; returns bytes applied.

    A Firecracker diff snapshot's memory file holds only the pages dirtied since the last snapshot,
    at their guest-physical offsets, holes elsewhere. `base` is never modified: restored VMs map it
    copy-on-write, and writing into a file they map would change their memory.
    """
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}")
    clone(base, tmp)
    applied = 0
    size = diff.stat().st_size
    with open(diff, "rb") as d, open(tmp, "r+b") as o:
        if size > o.seek(0, os.SEEK_END):
            o.truncate(size)
        for start, end in data_extents(d.fileno(), size):
            _copy_range(d.fileno(), o.fileno(), start, end)
            applied += end - start
    os.replace(tmp, out)
    return applied


def supports_reflink(directory: Path) -> bool:
    directory.mkdir(parents=True, exist_ok=True)
    a = directory / f".reflink-probe-{uuid.uuid4().hex[:8]}"
    b = a.with_suffix(".clone")
    try:
        a.write_bytes(b"x" * 4096)
        reflink(a, b)
        return True
    except OSError:
        return False
    finally:
        a.unlink(missing_ok=True)
        b.unlink(missing_ok=True)


class ReflinkStore:
    """A directory where reflink copies work: `<data_dir>/vm`, loop-mounting XFS there if needed."""

    IMAGE_NAME = "vm.xfs"

    def __init__(self, data_dir: Path, *, size_gb: int = 256) -> None:
        self.data_dir = data_dir
        self.root = data_dir / "vm"
        self.image = data_dir / self.IMAGE_NAME
        self.size_gb = size_gb
        self.mounted_by_us = False

    def is_mounted(self) -> bool:
        try:
            with open("/proc/self/mountinfo") as f:
                return any(line.split()[4] == str(self.root) for line in f)
        except OSError:
            return False

    def ensure(self) -> Path:
        """Make `root` reflink-capable (idempotent) and return it."""
        if self.is_mounted():
            return self.root
        self.root.mkdir(parents=True, exist_ok=True)
        if supports_reflink(self.root):
            return self.root
        if any(self.root.iterdir()):
            raise OSError(f"{self.root} cannot reflink and is not empty: refusing to mount over it")
        if shutil.which("mkfs.xfs") is None:
            raise OSError("the data dir's filesystem cannot reflink and mkfs.xfs is missing "
                          "(apt-get install xfsprogs, or put the data dir on XFS/btrfs)")
        if not self.image.exists():
            with open(self.image, "wb") as f:
                f.truncate(self.size_gb << 30)   # sparse: costs what is written
            _run(["mkfs.xfs", "-q", "-m", "reflink=1", str(self.image)])
        _run(["mount", "-o", "loop", str(self.image), str(self.root)])
        self.mounted_by_us = True
        log.info("VM store: XFS image %s loop-mounted at %s (reflink copies)", self.image, self.root)
        return self.root

    def unmount(self) -> None:
        """Unmount the loop-mounted store (its files stay in the image)."""
        if self.is_mounted():
            _run(["umount", str(self.root)])
        self.mounted_by_us = False

    def destroy(self) -> None:
        """Unmount and delete the store and its image (tests; `agentenv gc --all`)."""
        self.unmount()
        shutil.rmtree(self.root, ignore_errors=True)
        self.image.unlink(missing_ok=True)


def _run(argv: list[str]) -> None:
    p = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        raise OSError(f"{' '.join(argv)} failed: {(p.stderr or p.stdout).strip()[-500:]}")
