"""Memory images in a shared snapshot store (S3 on a real rclone server, and a plain directory) are
deduplicated like on a node: a publish uploads the page packs the store lacks, a node that pulls
an image downloads the packs it lacks and rebuilds the same bytes, and the store's GC keeps exactly
the packs the remaining images list (`storage/pagestore.py`, `storage/storegc.py`)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from agentenv.storage.artifacts import ArtifactCache
from agentenv.storage.storegc import Roots, collect

MB = 1 << 20
GRACE_S = 2.0


def _image(path: Path, body: bytes, state: bytes) -> Path:
    path.mkdir(parents=True)
    (path / "pages.img").write_bytes(body)
    (path / "checkpoint.img").write_bytes(state)
    return path


async def _pages_bytes(store) -> int:
    return sum(b.size for b in await store.list_blob_info("pages"))


def _same(image: Path, body: bytes, state: bytes) -> None:
    assert (image / "pages.img").read_bytes() == body and (image / "checkpoint.img").read_bytes() == state


async def _publish_step(cache: ArtifactCache, store, path: Path, body: bytes, state: bytes) -> tuple[str, int]:
    """Seal and publish one memory image: its digest, and the bytes of page packs the store grew by."""
    before = await _pages_bytes(store)
    digest = await cache.seal_memory(_image(path, body, state))
    await cache.publish_blobs([], digest)
    return digest, await _pages_bytes(store) - before


async def test_checkpoints_share_pages_in_the_store_across_nodes(store, tmp_path):
    base = os.urandom(8 * MB)
    a = ArtifactCache(tmp_path / "a", store)
    d1, grew = await _publish_step(a, store, tmp_path / "i1", base, b"state-1")
    assert (await store.blob_info("memory", d1)).size < 64 * 1024  # a recipe, not the image
    assert 8 * MB <= grew <= 8 * MB + 64 * 1024

    # step 2 on node A: moved around, 1 MiB new -> about 1 MiB more in the store
    body2 = base[4 * MB:] + os.urandom(MB) + base[:3 * MB]
    d2, grew = await _publish_step(a, store, tmp_path / "i2", body2, b"state-2")
    assert MB <= grew <= MB + 64 * 1024

    # node B pulls step 2: it downloads the packs, rebuilds the same bytes; step 1 needs nothing more
    b = ArtifactCache(tmp_path / "b", store)
    _same(await b.ensure_memory(d2), body2, b"state-2")
    held = b.pages.stored_bytes()
    _same(await b.ensure_memory(d1), base, b"state-1")
    assert b.pages.stored_bytes() == held

    # step 3 on node B, from step 2's content: only B's new pages go up; node C gets it whole
    body3 = body2[:6 * MB] + os.urandom(MB)
    d3, grew = await _publish_step(b, store, tmp_path / "i3", body3, b"state-3")
    assert MB <= grew <= MB + 64 * 1024
    c = ArtifactCache(tmp_path / "c", store)
    _same(await c.ensure_memory(d3), body3, b"state-3")

    # the store's GC with only step 3 referenced: steps 1 and 2 go with their pagemaps; every pack
    # step 3 lists stays (step 1's pack holds most of step 3's pages), so a fresh node still rebuilds it
    await _age()

    async def roots() -> Roots:
        r = Roots()
        r.add("test", [], d3)
        return r

    res = await collect(store, roots, grace_s=GRACE_S)
    gone = {(x.kind, x.digest) for x in res.removed}
    assert {("memory", d1), ("memory", d2), ("pagemaps", d1), ("pagemaps", d2)} <= gone
    assert not any(k in ("memory", "pagemaps") and d == d3 for k, d in gone)
    fresh = ArtifactCache(tmp_path / "fresh", store)
    _same(await fresh.ensure_memory(d3), body3, b"state-3")
    # and with nothing referenced, everything goes
    await _age()
    await collect(store, _no_roots, grace_s=GRACE_S)
    for kind in ("memory", "pagemaps", "pages"):
        assert await store.list_blobs(kind) == [], kind


async def test_a_pack_collected_between_publishes_is_uploaded_again(store, tmp_path):
    """A recipe republished after the store lost one of its packs (collected meanwhile) brings it back."""
    a = ArtifactCache(tmp_path / "a", store)
    body = os.urandom(2 * MB)
    d = await a.seal_memory(_image(tmp_path / "i", body, b"s"))
    await a.publish_blobs([], d)
    [pack] = await store.list_blobs("pages")
    await store.delete_blob("memory", d)  # as the GC would, once nothing referenced it
    await store.delete_blob("pages", pack)
    await a.publish_blobs([], d)
    assert await store.list_blobs("pages") == [pack]
    _same(await ArtifactCache(tmp_path / "b", store).ensure_memory(d), body, b"s")


async def _age() -> None:
    await asyncio.sleep(GRACE_S + 1.2)


async def _no_roots() -> Roots:
    return Roots()


async def test_pulls_of_shared_pages_survive_each_other_and_a_concurrent_gc(store, tmp_path):
    """Two images that share page packs, pulled at once by a node whose artifact GC runs meanwhile
    (CI, cluster soak: a GC took a download under way for an unused blob, and the resume failed
    with `….part: no such file`): both rebuild, and nothing temporary is left behind."""
    base = os.urandom(8 * MB)
    a = ArtifactCache(tmp_path / "a", store)
    d1, _ = await _publish_step(a, store, tmp_path / "i1", base, b"state-1")
    body2 = base[:6 * MB] + os.urandom(2 * MB)
    d2, _ = await _publish_step(a, store, tmp_path / "i2", body2, b"state-2")
    for i in range(4):
        node = ArtifactCache(tmp_path / f"n{i}", store)
        since = time.time()
        pulls = asyncio.gather(node.ensure_memory(d1), node.ensure_memory(d2))
        while not pulls.done():
            await node.gc(set(), set(), fresh_since=since)
            await asyncio.sleep(0)
        i1, i2 = await pulls
        _same(i1, base, b"state-1")
        _same(i2, body2, b"state-2")
        assert not [p for p in (tmp_path / f"n{i}").rglob(".tmp-*")]
    # a download a dead process left: removed by the next process's first GC once it is an hour
    # old, not before
    stale, fresh = (node.local.root / "memory" / f".tmp-get-{d}-dead" for d in (d1, d2))
    for p in (stale, fresh):
        p.write_bytes(b"partial")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    await ArtifactCache(node.root, store).gc(set(), set(), fresh_since=time.time())
    assert not stale.exists() and fresh.exists()
