"""Read-only filesystem layers: sealing a sandbox's writable upper into a content-addressed layer.

A layer is an overlayfs upper directory frozen in time, so it can contain overlay whiteouts
(0/0 character devices) and `trusted.overlay.*` xattrs (opaque directories). GNU tar with
`--xattrs` preserves both, which Python's tarfile does not; hence the tar CLI.

On disk, extracted layers live at `<data_dir>/layers/<sha256>/` and are used directly as overlay
lowers by every sandbox whose chain includes them. The digest is the sha256 of the layer's tar
stream, so the same layer uploaded twice is stored once.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
from pathlib import Path

from agentenv.errors import RuntimeFailure

_TAR_CREATE = ["tar", "--create", "--sort=name", "--numeric-owner", "--xattrs", "--xattrs-include=*",
               "--acls", "--format=posix", "--pax-option=delete=atime,delete=ctime", "-C"]
_TAR_EXTRACT = ["tar", "--extract", "--numeric-owner", "--same-owner", "--same-permissions", "--xattrs",
                "--xattrs-include=*", "--acls", "-C"]


async def pack(src_dir: Path, out_file: Path, *, sparse: bool = False) -> tuple[str, int]:
    """Tar `src_dir` into `out_file`, hashing while writing. Returns (sha256 hex, size).

    `sparse`: store holes as holes (a VM checkpoint's RAM file is mostly holes).
    """
    out_file.parent.mkdir(parents=True, exist_ok=True)
    argv = [*_TAR_CREATE[:2], "--sparse", *_TAR_CREATE[2:]] if sparse else _TAR_CREATE
    proc = await asyncio.create_subprocess_exec(
        *argv, str(src_dir), ".", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    h = hashlib.sha256()
    size = 0
    assert proc.stdout is not None
    with open(out_file, "wb") as f:
        while chunk := await proc.stdout.read(1 << 20):
            h.update(chunk)
            f.write(chunk)
            size += len(chunk)
    err = await proc.stderr.read() if proc.stderr else b""
    if await proc.wait() != 0:
        out_file.unlink(missing_ok=True)
        raise RuntimeFailure(f"tar of layer {src_dir} failed: {err.decode(errors='replace')[-400:]}")
    return h.hexdigest(), size


async def unpack(tar_file: Path, dst_dir: Path) -> None:
    """Extract a layer tar into `dst_dir` atomically (extract beside it, then rename)."""
    tmp = dst_dir.with_name(f".{dst_dir.name}.extract")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    proc = await asyncio.create_subprocess_exec(
        *_TAR_EXTRACT, str(tmp), "-f", str(tar_file), stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate()
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeFailure(f"extracting layer {tar_file.name} failed: {err.decode(errors='replace')[-400:]}")
    os.replace(tmp, dst_dir)


def dir_size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total
