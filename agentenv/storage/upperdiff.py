"""What changed in a sandbox's writable upper since its last capture, as an overlay layer of its own.

A capture that leaves the sandbox running (time travel's checkpoints, fork, snapshot) must seal its
upper as it is at the freeze, while the sandbox keeps writing to it afterwards. The first capture
copies the whole upper into a layer; the next ones copy only the entries whose metadata changed
since the previous capture (`index`: mode, owner, size, mtime, ctime and inode of every entry —
ctime changes with every write, chmod, chown or xattr change and cannot be set by the sandbox) and
add an overlay whiteout for every entry that disappeared. Stacked over the previous capture's
chain, that layer shows exactly the upper of the freeze, so a checkpoint costs what changed since
its parent, not everything the sandbox ever wrote.

Entries under an overlay *opaque* directory (a directory deleted and made again: it hides what the
lowers have there) that changed are copied with that whole directory, since the delta's opaque mark
would hide the previous captures' copy of it too.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from agentenv.proc import run_cmd

OPAQUE_XATTR = "trusted.overlay.opaque"

Entry = tuple[str, ...]  # type+mode, uid, gid, size, mtime, ctime, inode (as find prints them)

# `find -printf`: the metadata fields (no spaces in any), then the path (anything but NUL), NUL-ended.
_FIND_FORMAT = "%y%m %U %G %s %T@ %C@ %i %P\\0"


async def index(upper: Path) -> dict[str, Entry]:
    """Every entry below `upper` (relative path → metadata), directories included: one `find`, which
    walks a 10,000-entry upper several times faster than Python can (this runs while the sandbox is
    frozen)."""
    res = await run_cmd(["find", str(upper), "-mindepth", "1", "-printf", _FIND_FORMAT], timeout=600,
                        what="find upper", errors="surrogateescape")
    out: dict[str, Entry] = {}
    for rec in res.stdout.split("\0"):
        if rec:
            *meta, path = rec.split(" ", 7)
            out[path] = tuple(meta)
    return out


def is_dir(entry: Entry) -> bool:
    return entry[0].startswith("d")


def _opaque(path: Path) -> bool:
    try:
        return os.getxattr(path, OPAQUE_XATTR, follow_symlinks=False) == b"y"
    except OSError:
        return False


def _parents(rel: str) -> list[str]:
    parts = rel.split("/")[:-1]
    return ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]


def changes(upper: Path, base: dict[str, Entry], now: dict[str, Entry]) -> tuple[list[str], list[str]]:
    """(entries to copy, parents first; top-most entries that disappeared) between two indexes."""
    changed = {p for p, m in now.items() if base.get(p) != m}
    gone = [p for p in base if p not in now and not any(q in base and q not in now for q in _parents(p))]
    # a changed entry inside an opaque directory: copy that whole directory
    opaque_dirs = {d for p in changed for d in _parents(p) if _opaque(upper / d)}
    for d in opaque_dirs:
        changed |= {p for p in now if p == d or p.startswith(d + "/")}
    # the directories holding what is copied or whited out, so the layer has them (metadata included)
    needed = set(changed) | {d for p in list(changed) + gone for d in _parents(p)}
    copy = sorted(needed, key=lambda p: (p.count("/"), p))
    return copy, sorted(gone)


async def write_delta(upper: Path, dst: Path, copy: list[str], gone: list[str]) -> None:
    """`dst` = the entries `copy` of `upper` (with owners, modes, xattrs, hard links, holes) and a
    whiteout (a 0/0 character device) for each of `gone`."""
    dst.mkdir(parents=True)
    if copy:
        listing = dst.with_name(dst.name + ".list")
        listing.write_bytes(b"\0".join(os.fsencode(p) for p in copy) + b"\0")
        try:
            # one tar pipeline: metadata as the layers' tar keeps it (no recursion: the list is exact)
            script = ('tar --create --null --no-recursion --numeric-owner --xattrs --xattrs-include="*" --acls '
                      '--sparse -C "$1" -T "$2" | tar --extract --numeric-owner --same-owner --same-permissions '
                      '--xattrs --xattrs-include="*" --acls -C "$3"')
            await run_cmd(["bash", "-c", "set -o pipefail; " + script, "bash", str(upper), str(listing), str(dst)],
                          timeout=600, what="tar upper delta")
        finally:
            listing.unlink(missing_ok=True)
    for rel in gone:
        target = dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        os.mknod(target, stat.S_IFCHR | 0o000, os.makedev(0, 0))
    # directories as the upper has them: the root, and those a whiteout was made in (mtime)
    for rel in {""} | {str(Path(g).parent) if "/" in g else "" for g in gone}:
        src, out = upper / rel if rel else upper, dst / rel if rel else dst
        st = os.lstat(src)
        if not rel:
            os.chown(out, st.st_uid, st.st_gid)
            os.chmod(out, stat.S_IMODE(st.st_mode))
        os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def load(raw: dict) -> dict[str, Entry]:
    """An index read back from JSON (lists → tuples, so entries compare)."""
    return {k: tuple(v) for k, v in raw.items()}  # type: ignore[misc]
