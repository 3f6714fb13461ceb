"""The page store behind memory images: deduplication across images whose pages moved, exact
rebuilds (holes, odd sizes, modes), what a crash mid-seal leaves, and reclaiming by reference."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest

from agentenv.storage.pagestore import PAGE, PageStore, Recipe

MIB = 1 << 20


def image(d: Path, pages: list[bytes], small: bytes, holes: int = 0) -> Path:
    """A runsc-like image dir: a big pages file (optionally with a hole in it) and a small file."""
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "pages.img", "wb") as f:
        f.write(b"".join(pages))
        f.seek(holes * PAGE, os.SEEK_CUR)
        f.write(b"tail-not-page-aligned")
    (d / "checkpoint.img").write_bytes(small)
    os.chmod(d / "checkpoint.img", 0o600)
    return d


def same(a: Path, b: Path) -> None:
    for name in ("pages.img", "checkpoint.img"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
        assert (a / name).stat().st_mode == (b / name).stat().st_mode, name


def seal(ps: PageStore, src: Path, recipes: Path) -> tuple[str, int]:
    digest, _recipe, new = ps.seal(src, lambda d: recipes / d)
    return digest, new


def rebuild(ps: PageStore, recipes: Path, digest: str, dst: Path) -> Path:
    ps.materialize(Recipe.load(recipes / digest), dst)
    return dst


@pytest.fixture
def pages() -> list[bytes]:
    rng = random.Random(1)
    return [rng.randbytes(PAGE) for _ in range(1024)]  # 4 MiB


def test_moved_pages_are_stored_once_and_rebuilt_exactly(tmp_path, pages):
    ps, recipes = PageStore(tmp_path / "pages"), tmp_path / "recipes"
    a = image(tmp_path / "a", pages, b"state-a" * 100, holes=300)
    da, new_a = seal(ps, a, recipes)
    assert new_a <= 4 * MIB + 2 * PAGE  # the hole is not stored
    changed = pages[:]
    random.Random(2).shuffle(changed)  # every page moved
    changed[:16] = [os.urandom(PAGE) for _ in range(16)]  # 64 KiB changed
    b = image(tmp_path / "b", changed, b"state-b" * 100)
    db, new_b = seal(ps, b, recipes)
    assert new_b <= 16 * PAGE + 2 * PAGE + PAGE  # the changed pages, the small file, the tail
    same(a, rebuild(ps, recipes, da, tmp_path / "ra"))
    same(b, rebuild(ps, recipes, db, tmp_path / "rb"))
    assert (tmp_path / "ra" / "pages.img").stat().st_blocks * 512 < (a / "pages.img").stat().st_size  # a hole again
    # a store opened afresh (a restarted server) finds every page
    same(b, rebuild(PageStore(tmp_path / "pages"), recipes, db, tmp_path / "rb2"))


def test_a_crash_mid_seal_leaves_the_old_state(tmp_path, pages):
    ps, recipes = PageStore(tmp_path / "pages"), tmp_path / "recipes"
    da, _ = seal(ps, image(tmp_path / "a", pages, b"a"), recipes)
    # What a seal killed before its index (or before its rename) leaves behind; no recipe refers to it.
    packs = tmp_path / "pages" / "packs"
    (packs / "dead-beef.pack").write_bytes(os.urandom(8 * PAGE))
    (packs / ".tmp-dead-beef.pack").write_bytes(os.urandom(8 * PAGE))
    # A seal that fails part-way (the image holds something that is not a regular file): no recipe.
    bad = image(tmp_path / "bad", [os.urandom(PAGE) for _ in range(64)], b"bad")
    os.symlink("/etc/hostname", bad / "link")
    with pytest.raises(ValueError):
        seal(ps, bad, recipes)
    assert sorted(p.name for p in recipes.iterdir()) == [da]
    reopened = PageStore(tmp_path / "pages")
    same(tmp_path / "a", rebuild(reopened, recipes, da, tmp_path / "ra"))
    assert not (packs / "dead-beef.pack").exists() and not (packs / ".tmp-dead-beef.pack").exists()
    assert reopened.stored_bytes() <= 4 * MIB + 3 * PAGE


def test_sweep_reclaims_unreferenced_pages_and_compacts(tmp_path, pages):
    ps, recipes = PageStore(tmp_path / "pages"), tmp_path / "recipes"
    da, _ = seal(ps, image(tmp_path / "a", pages, b"a"), recipes)
    keep = pages[:256] + [os.urandom(PAGE) for _ in range(64)]  # a quarter of a's pages, plus new ones
    db, _ = seal(ps, image(tmp_path / "b", keep, b"b"), recipes)
    dc, _ = seal(ps, image(tmp_path / "c", [os.urandom(PAGE) for _ in range(128)], b"c"), recipes)
    listing = lambda: list(recipes.iterdir())  # noqa: E731
    assert ps.sweep(listing)["bytes_reclaimed"] == 0  # everything referenced
    before = ps.stored_bytes()
    (recipes / da).unlink()
    (recipes / dc).unlink()
    got = ps.sweep(listing)
    assert got["packs_deleted"] == 1 and got["packs_compacted"] == 1  # c's pack; a's (a quarter live)
    assert before - ps.stored_bytes() >= (768 + 128) * PAGE
    same(tmp_path / "b", rebuild(ps, recipes, db, tmp_path / "rb"))
    same(tmp_path / "b", rebuild(PageStore(tmp_path / "pages"), recipes, db, tmp_path / "rb2"))
    (recipes / db).unlink()
    ps.sweep(listing)
    assert ps.stored_bytes() == 0


def test_a_page_two_packs_hold_stays_found_when_one_of_them_goes(tmp_path, pages):
    """Node a seals its own pack, then pulls node b's, which holds some of the same pages. When a's
    own pack goes (nothing here uses it any longer), those pages are still in b's pack, which stays:
    pulling b's image again needs nothing downloaded and rebuilds it exactly (the cluster soak once
    found such a page 'missing from the page store' while its pack sat here)."""
    shared, own, theirs = pages[:128], pages[128:384], pages[384:]
    a, ra = PageStore(tmp_path / "a"), tmp_path / "ra"
    b, rb = PageStore(tmp_path / "b"), tmp_path / "rb"
    d1, _ = seal(a, image(tmp_path / "i1", shared + own, b"one"), ra)
    d2, _ = seal(b, image(tmp_path / "i2", shared + theirs, b"two"), rb)
    recipe2 = Recipe.load(rb / d2)

    def pull() -> list[str]:  # as a node pulls a recipe from the snapshot store: the packs it lacks
        wire = tmp_path / "wire"
        wire.mkdir(exist_ok=True)
        got = []
        for name, path in b.link_packs(recipe2, wire):
            if not a.has_pack(name):
                dst = a.download_path(name)
                shutil.copyfile(path, dst)
                a.adopt(name, dst)
                got.append(name)
            path.unlink()
        return got

    assert a.lacks(recipe2) and len(pull()) == 1 and not a.lacks(recipe2)
    shutil.copyfile(rb / d2, ra / d2)
    # an image of b's pages only is the one a keeps; images 1 and 2 go
    d3, new = seal(a, image(tmp_path / "i3", theirs[::-1], b"three"), ra)
    assert new <= 2 * PAGE  # b's pack had them
    (ra / d1).unlink()
    (ra / d2).unlink()
    swept = a.sweep(lambda: list(ra.iterdir()))
    assert swept["packs_deleted"] + swept["packs_compacted"] == 1  # a's own pack went (its live page moved)
    # image 2 again: b's pack is still here, and so are the shared pages in it
    assert pull() == [] and not a.lacks(recipe2)
    shutil.copyfile(rb / d2, ra / d2)
    same(tmp_path / "i2", rebuild(a, ra, d2, tmp_path / "r2"))
    same(tmp_path / "i3", rebuild(a, ra, d3, tmp_path / "r3"))
