"""Missing parent directories, created the way E2B's envd creates them (its `permissions.EnsureDirs`).

E2B's envd runs every file operation as root: each missing directory of a path is made with mode 0755
and then chowned to the selected user (directories that already exist are left alone). envd here acts
as the selected user instead, so that existing files and directories keep their permissions; only the
missing directories are made by root and given to the user, like E2B does. That is what lets
`files.write("/new/dir/file.txt")` work as user `user`, as it does on E2B.

One check keeps this from doing anything the user could not use: the deepest existing directory must
be searchable by the user (checked with the user's credentials), otherwise nothing is created and the
call fails with EACCES — the user could not reach what would be created (e.g. `/root/new/file`).
"""

from __future__ import annotations

import errno
import os
import stat

from agentenv.envd.users import User, UserExecutor

DIR_MODE = 0o755


def missing_dirs(directory: str) -> list[str]:
    """The directories of absolute `directory` that do not exist yet, outermost first.

    Run with the user's credentials. Raises NotADirectoryError when an existing component is not a
    directory and PermissionError when the user cannot search the deepest existing directory.
    """
    missing: list[str] = []
    current = directory
    while True:
        try:
            st = os.stat(current)
        except FileNotFoundError:
            parent = os.path.dirname(current)
            if parent == current:  # "/" missing: nothing sensible to do
                raise
            missing.append(current)
            current = parent
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), current)
        if missing and not os.access(current, os.X_OK, effective_ids=True):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), current)
        missing.reverse()
        return missing


def make_dirs(dirs: list[str], uid: int, gid: int) -> None:
    """Create `dirs` (outermost first) with mode 0755 and give each to uid:gid. Run as root.

    A directory that appeared meanwhile is chowned too (its creator may not have done it yet), as
    E2B's envd does.
    """
    for path in dirs:
        try:
            os.mkdir(path, DIR_MODE)
        except FileExistsError:
            if not os.path.isdir(path):
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path) from None
        os.chown(path, uid, gid, follow_symlinks=False)


async def ensure_dirs(executor: UserExecutor, user: User, directory: str) -> bool:
    """Make `directory` and its missing parents for `user` (see the module docstring).

    Returns whether anything was created. Raises OSError like the underlying calls.
    """
    missing = await executor.run(user, missing_dirs, directory)
    if not missing:
        return False
    await executor.run(None, make_dirs, missing, user.uid, user.gid)
    return True
