"""Memory images in the node's artifact cache are recipes over deduplicated pages: the extracted
image is a cache (dropped, evicted by the budget, rebuilt on use with the same bytes), a snapshot
store outside the node gets the recipe and its page packs (another node rebuilds the image from
them), and gc reclaims the pages of deleted images only."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from agentenv.storage.artifacts import ArtifactCache
from agentenv.storage.snapshots import LocalSnapshotStore

MB = 1 << 20


def _image(path: Path, body: bytes, state: bytes) -> Path:
    path.mkdir(parents=True)
    (path / "pages.img").write_bytes(body)
    (path / "checkpoint.img").write_bytes(state)
    return path


def _same(a: Path, files: dict[str, bytes]) -> None:
    assert sorted(p.name for p in a.iterdir()) == sorted(files)
    for name, data in files.items():
        assert (a / name).read_bytes() == data, name


def test_memory_images_share_pages_and_rebuild(tmp_path):
    async def go():
        node = tmp_path / "node"
        cache = ArtifactCache(node, LocalSnapshotStore(node / "snapshots"))  # the single-node default
        base = os.urandom(8 * MB)
        one = _image(tmp_path / "one", base, b"state-1")
        two_body = base[4 * MB:] + os.urandom(MB) + base[:3 * MB]  # moved around, 1 MiB new
        two = _image(tmp_path / "two", two_body, b"state-2")
        d1 = await cache.seal_memory(one)
        packs_1 = cache.pages.stored_bytes()
        d2 = await cache.seal_memory(two)
        assert cache.pages.stored_bytes() - packs_1 <= MB + 8192  # only the new MiB (and the small file)
        assert cache.memory_size(d2) == len(two_body) + len(b"state-2")
        # a checkpoint drops its extracted copy; a use rebuilds it, byte for byte
        await cache.drop_extracted(d1)
        assert not cache.memory_dir(d1).exists()
        _same(await cache.ensure_memory(d1), {"pages.img": base, "checkpoint.img": b"state-1"})
        # the budget evicts the extracted copy of an image not needed here (recipe and pages stay),
        # never the one in use; both restore afterwards
        evicted = await cache.enforce_budget(1, set(), {d2})
        assert evicted == [f"memory/{d1}"] and cache.memory_dir(d2).is_dir()
        assert cache.has_recipe(d1)
        _same(await cache.ensure_memory(d1), {"pages.img": base, "checkpoint.img": b"state-1"})
        # published to the node's own store: the recipe (a hard link), not a second image
        await cache.publish_blobs([], d2)
        stored = node / "snapshots" / "memory" / d2
        assert stored.stat().st_size < 64 * 1024
        assert stored.stat().st_ino == cache.local.blob_path("memory", d2).stat().st_ino

        # another node, through a store that is not its own directory: the recipe and the packs of
        # its pages (tests/snapshots/test_store_pages.py does this on S3 too), same bytes
        shared = LocalSnapshotStore(tmp_path / "shared")
        cache.store = shared
        await cache.publish_blobs([], d2)
        assert (tmp_path / "shared" / "memory" / d2).stat().st_size < 64 * 1024
        assert await shared.has_blob("pagemaps", d2) and await shared.list_blobs("pages")
        other = ArtifactCache(tmp_path / "other", shared)
        _same(await other.ensure_memory(d2), {"pages.img": two_body, "checkpoint.img": b"state-2"})
        cache.store = LocalSnapshotStore(node / "snapshots")

        # gc: deleting image 2 (and its store copy) reclaims its own pages; image 1 still rebuilds
        await cache.store.delete_blob("memory", d2)
        held = cache.pages.stored_bytes()
        removed = await cache.gc(set(), {d1})
        assert removed["memory"] == 1 and held - cache.pages.stored_bytes() >= MB
        await cache.drop_extracted(d1)
        _same(await cache.ensure_memory(d1), {"pages.img": base, "checkpoint.img": b"state-1"})
        # and with nothing left, nothing is stored
        await cache.gc(set(), set())
        assert cache.pages.stored_bytes() == 0

    asyncio.run(go())


def test_gc_keeps_what_was_sealed_after_the_in_use_sets_were_taken(tmp_path):
    """A collection whose in-use sets were taken before a seal returned (its caller had no chance to
    pin it yet) keeps the fresh layer and memory image; a later one removes them if unreferenced."""
    async def go():
        cache = ArtifactCache(tmp_path / "node", LocalSnapshotStore(tmp_path / "node" / "snapshots"))
        taken = time.time()
        mem = await cache.seal_memory(_image(tmp_path / "img", os.urandom(MB), b"s"))
        upper = tmp_path / "upper"
        upper.mkdir()
        (upper / "f").write_bytes(b"x")
        layer = await cache.seal_upper(upper)
        assert await cache.gc(set(), set(), fresh_since=taken) == {"layers": 0, "memory": 0}
        assert cache.has_memory(mem) and cache.layer_dir(layer).is_dir()
        await asyncio.sleep(0.1)  # past the coarse file-clock margin of the use stamps
        removed = await cache.gc(set(), set(), fresh_since=time.time())
        assert removed["layers"] == 1 and removed["memory"] == 1 and not cache.has_memory(mem)
        assert cache.pages.stored_bytes() == 0

    asyncio.run(go())


def test_pages_are_swept_once_no_copy_of_a_recipe_is_left(tmp_path):
    """Removing a node's local recipe while the node's own store still holds it (a deleted checkpoint
    before the store's GC) reclaims nothing and costs no sweep; the store's removal then reclaims."""
    async def go():
        node = tmp_path / "node"
        cache = ArtifactCache(node, LocalSnapshotStore(node / "snapshots"))
        body = os.urandom(2 * MB)
        d = await cache.seal_memory(_image(tmp_path / "img", body, b"s"))
        await cache.publish_blobs([], d)
        assert await cache.gc(set(), {d}) == {"layers": 0, "memory": 0}
        held = cache.pages.stored_bytes()
        removed = await cache.gc(set(), set())
        assert removed == {"layers": 0, "memory": 1}, removed  # no sweep: the store's copy needs every page
        assert cache.pages.stored_bytes() == held
        _same(await cache.ensure_memory(d), {"pages.img": body, "checkpoint.img": b"s"})  # from the store's recipe
        await cache.store.delete_blob("memory", d)  # the store's GC
        removed = await cache.gc(set(), set())
        assert removed["memory"] == 1 and removed["packs_deleted"] == 1 and cache.pages.stored_bytes() == 0

    asyncio.run(go())


def test_a_layer_sealed_before_its_memory_image_survives_a_gc_in_between(tmp_path):
    """`SandboxHost.seal` seals the upper, then the memory image: a collection that takes its in-use
    sets while the memory image is sealed (no record names the new layer yet) and removes what is
    unclaimed after that seal returned keeps the layer (the soak of stop 37 lost a paused
    sandbox's upper this way)."""
    from agentenv.config import Settings
    from agentenv.orchestrator.host import SandboxHost
    from agentenv.runtimes.gvisor import GVisorRuntime
    from agentenv.storage.rootfs import RootfsManager

    async def go():
        settings = Settings(data_dir=tmp_path / "data")
        cache = ArtifactCache(settings.paths.root, LocalSnapshotStore(settings.paths.root / "snapshots"))
        host = SandboxHost(settings, None, RootfsManager(settings.paths), None, GVisorRuntime(settings), cache)
        sid = "iseal0gc0race0000000"
        upper = host.rootfs.upper_path(sid)
        upper.mkdir(parents=True)
        (upper / "work.txt").write_bytes(b"the sandbox's only copy")
        taken: dict[str, object] = {}

        async def gc_in_the_window(layer: str | None) -> None:
            # a GC starting now takes its sets here: the live records do not name `layer` yet
            await asyncio.sleep(0.1)  # past the coarse file-clock margin of the use stamps
            taken["since"], taken["layers"] = time.time(), host.pinned_layers()

        sealed = await host.seal(sid, _image(tmp_path / "img", os.urandom(MB), b"s"), on_layer=gc_in_the_window)
        # the seal is over (nothing under way): the GC goes on with the sets it took
        assert await cache.gc(set(taken["layers"]), {sealed.memory}, fresh_since=taken["since"]) == \
            {"layers": 0, "memory": 0}
        assert cache.layer_dir(sealed.layer).is_dir() and await cache.local.has_blob("layers", sealed.layer)
        assert (cache.layer_dir(sealed.layer) / "work.txt").read_bytes() == b"the sandbox's only copy"
        assert host.pinned_layers() == set()  # the caller names it from here on

    asyncio.run(go())
