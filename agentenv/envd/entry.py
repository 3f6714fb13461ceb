"""EntryInfo (filesystem.EntryInfo in proto3-JSON) built from lstat, as the E2B SDKs expect it."""

from __future__ import annotations

import datetime as _dt
import errno
import os
import stat

from agentenv.envd.users import group_name, user_name

XATTR_PREFIX = "user.e2b."

FILE_TYPE_UNSPECIFIED = "FILE_TYPE_UNSPECIFIED"
FILE_TYPE_FILE = "FILE_TYPE_FILE"
FILE_TYPE_DIRECTORY = "FILE_TYPE_DIRECTORY"
FILE_TYPE_SYMLINK = "FILE_TYPE_SYMLINK"


def go_mode_string(mode: int) -> str:
    """Render st_mode like Go's fs.FileMode.String() (e.g. "drwxr-xr-x", "Lrwxrwxrwx", "dtrwxrwxrwx")."""
    prefix = ""
    if stat.S_ISDIR(mode):
        prefix += "d"
    if stat.S_ISLNK(mode):
        prefix += "L"
    if stat.S_ISBLK(mode) or stat.S_ISCHR(mode):
        prefix += "D"
    if stat.S_ISFIFO(mode):
        prefix += "p"
    if stat.S_ISSOCK(mode):
        prefix += "S"
    if mode & stat.S_ISUID:
        prefix += "u"
    if mode & stat.S_ISGID:
        prefix += "g"
    if stat.S_ISCHR(mode):
        prefix += "c"
    if mode & stat.S_ISVTX:
        prefix += "t"
    perm = "".join(ch if mode & (1 << (8 - i)) else "-" for i, ch in enumerate("rwxrwxrwx"))
    return (prefix or "-") + perm


def rfc3339_ns(ns: int) -> str:
    secs, frac = divmod(ns, 1_000_000_000)
    base = _dt.datetime.fromtimestamp(secs, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{base}.{frac:09d}Z" if frac else f"{base}Z"


def read_metadata(target: str | int) -> dict[str, str]:
    """File metadata: the user.e2b.* extended attributes of a path (following symlinks) or an open fd,
    prefix stripped.

    Empty where the filesystem has no user xattrs. Entries whose name or value is not UTF-8 (possible
    when set inside the sandbox) are skipped: the protocol's map carries strings only.
    """
    out: dict[str, str] = {}
    try:
        names = os.listxattr(target)
    except OSError:
        return out
    for name in names:
        if not name.startswith(XATTR_PREFIX) or len(name) == len(XATTR_PREFIX):
            continue
        try:
            name.encode("utf-8")  # listxattr decodes with surrogateescape: a non-UTF-8 name raises here
            out[name[len(XATTR_PREFIX):]] = os.getxattr(target, name).decode("utf-8")
        except (OSError, UnicodeError):
            continue
    return out


def _resolve_link(path: str) -> str:
    """Where a symlink finally leads, as an absolute path with every link resolved (Go's
    filepath.EvalSymlinks, which E2B's envd uses); the link's own path when that fails (dangling,
    a loop, no permission)."""
    try:
        return os.path.realpath(path, strict=True)
    except (OSError, RuntimeError):
        return path


def entry_info(path: str, st: os.stat_result | None = None) -> dict:
    """EntryInfo for `path` (not following a final symlink); raises OSError like os.lstat.

    A symlink is described as E2B's envd describes it: `type` and `mode` are those of what it finally
    points to (FILE_TYPE_UNSPECIFIED and 0 when that does not exist), `symlinkTarget` is that absolute
    path, while `size`, `permissions` ("Lrwxrwxrwx"), owner, group and time are the link's own.
    """
    st = st or os.lstat(path)
    mode = st.st_mode
    info: dict = {
        "name": os.path.basename(path) or path,
        "path": path,
        "size": str(st.st_size),
        "mode": stat.S_IMODE(mode) & 0o777,
        "permissions": go_mode_string(mode),
        "owner": user_name(st.st_uid),
        "group": group_name(st.st_gid),
        "modifiedTime": rfc3339_ns(st.st_mtime_ns),
    }
    if stat.S_ISLNK(mode):
        target = _resolve_link(path)
        info["symlinkTarget"] = target
        try:
            tst = os.stat(target)
        except OSError:
            info["type"] = FILE_TYPE_UNSPECIFIED
            info["mode"] = 0
        else:
            info["type"] = _file_type(tst.st_mode)
            info["mode"] = stat.S_IMODE(tst.st_mode) & 0o777
    else:
        info["type"] = _file_type(mode)
    meta = read_metadata(path)  # a symlink shows its target's, as E2B's envd does
    if meta:
        info["metadata"] = meta
    return info


def _file_type(mode: int) -> str:
    """Go's classification: regular file, directory, else unspecified (devices, FIFOs, sockets)."""
    if stat.S_ISREG(mode):
        return FILE_TYPE_FILE
    if stat.S_ISDIR(mode):
        return FILE_TYPE_DIRECTORY
    return FILE_TYPE_UNSPECIFIED


def is_missing(exc: OSError) -> bool:
    return exc.errno in (errno.ENOENT, errno.ENOTDIR)
