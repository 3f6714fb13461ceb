"""EntryInfo (filesystem.EntryInfo in proto3-JSON) built from lstat, as the E2B SDKs expect it."""

from __future__ import annotations

import datetime as _dt
import errno
import os
import stat

from agentenv.envd.users import group_name, user_name

XATTR_PREFIX = "user.e2b."

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


def entry_info(path: str, st: os.stat_result | None = None) -> dict:
    """EntryInfo for `path` (not following a final symlink); raises OSError like os.lstat."""
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
        info["type"] = FILE_TYPE_SYMLINK
        info["isSymlink"] = True
        try:
            target = os.readlink(path)
            info["symlinkTarget"] = os.path.normpath(os.path.join(os.path.dirname(path), target))
        except OSError:
            pass
    elif stat.S_ISDIR(mode):
        info["type"] = FILE_TYPE_DIRECTORY
    else:
        info["type"] = FILE_TYPE_FILE
    meta = read_metadata(path)  # a symlink shows its target's, as E2B's envd does
    if meta:
        info["metadata"] = meta
    return info


def is_missing(exc: OSError) -> bool:
    return exc.errno in (errno.ENOENT, errno.ENOTDIR)
