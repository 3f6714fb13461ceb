"""upperdiff: a delta of an overlay upper, stacked over the previous capture's copy, shows exactly the
live upper's view (real overlayfs mounts, no sandbox): new, changed, deleted and recreated files and
directories, an opaque directory over a lower one, a chmod, a hard link, a symlink."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest

from agentenv.storage import upperdiff
from agentenv.storage._util import mount, umount

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="overlayfs mounts need root")


def _overlay(target: Path, lowers: list[Path], upper: Path | None = None, work: Path | None = None) -> None:
    target.mkdir(parents=True, exist_ok=True)
    opts = f"lowerdir={':'.join(str(p) for p in lowers)}"
    if upper is not None:
        opts += f",upperdir={upper},workdir={work}"
    mount("overlay", str(target), "overlay", opts)


def _view(root: Path) -> dict[str, tuple]:
    """Everything a program sees below `root`: type, mode, owner, content or link target."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            st = os.lstat(p)
            rel = str(p.relative_to(root))
            if stat.S_ISREG(st.st_mode):
                out[rel] = ("f", stat.S_IMODE(st.st_mode), st.st_uid, p.read_bytes(), st.st_mtime_ns)
            elif stat.S_ISLNK(st.st_mode):
                out[rel] = ("l", os.readlink(p))
            else:
                out[rel] = ("d" if stat.S_ISDIR(st.st_mode) else "o", stat.S_IMODE(st.st_mode), st.st_uid)
    return out


async def test_delta_over_previous_copy_shows_the_live_upper(tmp_path: Path) -> None:
    lower, upper, work, live = (tmp_path / n for n in ("lower", "upper", "work", "live"))
    for d in (lower / "keep", lower / "gone", lower / "opaque"):
        d.mkdir(parents=True)
    (lower / "keep" / "a").write_text("lower a")
    (lower / "gone" / "x").write_text("lower x")
    (lower / "opaque" / "old").write_text("hidden after the rmdir")
    upper.mkdir()
    work.mkdir()
    _overlay(live, [lower], upper, work)
    mounts = [live]
    try:
        # the first capture: a whole copy of the upper
        (live / "keep" / "b").write_text("b1")
        (live / "new").mkdir()
        (live / "new" / "n1").write_text("n1")
        (live / "tmpdir").mkdir()
        (live / "tmpdir" / "t").write_text("t")
        (live / "linked").write_text("hard")
        (live / "stable").write_text("never touched again")
        idx1 = await upperdiff.index(upper)
        full = tmp_path / "full"
        await asyncio.to_thread(os.system, f"cp -a {upper} {full}")

        # what the sandbox does next
        (live / "keep" / "b").write_text("b2 longer")          # changed
        os.chmod(live / "keep" / "a", 0o600)                    # copied up by a chmod
        (live / "new" / "n1").unlink()                          # deleted (upper only)
        (live / "new" / "n2").write_text("n2")
        os.system(f"rm -rf {live / 'tmpdir'}")                  # a directory of the previous copy deleted
        os.system(f"rm -rf {live / 'gone'}")                    # a lower directory deleted
        os.system(f"rm -rf {live / 'opaque'}")                  # deleted and made again: opaque
        (live / "opaque").mkdir()
        (live / "opaque" / "fresh").write_text("only this")
        os.link(live / "linked", live / "linked2")              # a hard link
        os.symlink("keep/b", live / "sym")
        with open(os.path.join(os.fsencode(live), b"name-\xff latin1 \t tab"), "wb") as f:  # not UTF-8
            f.write(b"odd name")
        idx2 = await upperdiff.index(upper)
        copy, gone = upperdiff.changes(upper, idx1, idx2)
        assert "tmpdir" in gone and "new/n1" in gone and "tmpdir/t" not in gone
        delta = tmp_path / "delta"
        await upperdiff.write_delta(upper, delta, copy, gone)
        assert not (delta / "stable").exists(), "an unchanged file was copied again"
        assert not (delta / "new" / "n1").is_file()

        stacked = tmp_path / "stacked"
        _overlay(stacked, [delta, full, lower])
        mounts.append(stacked)
        assert _view(stacked) == _view(live)
        assert (stacked / "opaque").exists() and sorted(os.listdir(stacked / "opaque")) == ["fresh"]
        assert os.lstat(stacked / "linked").st_ino == os.lstat(stacked / "linked2").st_ino  # still one file
    finally:
        for m in reversed(mounts):
            umount(str(m))
