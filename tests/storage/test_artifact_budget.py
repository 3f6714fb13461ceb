"""The node artifact cache's size budget: over it, the least recently used artifacts that the
snapshot store also holds and nothing on the node needs are evicted (layers, memory images and
pulled VM drives alike), never one in use or held only here, and an evicted one comes back from the
store on its next use."""

from __future__ import annotations

import asyncio
import os
import time

from agentenv.storage.artifacts import ArtifactCache
from agentenv.storage.snapshots import LocalSnapshotStore

MB = 1 << 20


def _upper(path, seed: int):
    path.mkdir(parents=True)
    (path / "data.bin").write_bytes(os.urandom(MB) + bytes([seed]))
    return path


def test_lru_eviction_within_budget(tmp_path):
    async def go():
        cache = ArtifactCache(tmp_path / "node", LocalSnapshotStore(tmp_path / "store"))
        digests = []
        for i in range(4):
            d = await cache.seal_upper(_upper(tmp_path / f"upper{i}", i))
            digests.append(d)
            time.sleep(0.02)  # distinct use stamps
        old, in_use, unpublished, recent = digests
        await cache.publish_blobs([old, in_use, recent], None)  # `unpublished` exists only here
        drive = await cache.seal_drive(_upper(tmp_path / "vm", 9) / "data.bin")  # a pulled drive's blob
        await cache.store.put_blob("drives", drive, cache.local.blob_path("drives", drive))
        await cache.ensure_layer(recent)  # a use: most recent of all
        each = cache._size("layers", old)
        assert each >= 2 * MB  # tar + extracted copy

        # the whole cache fits: nothing goes
        assert await cache.enforce_budget(100 * MB, {in_use}, set()) == []
        # over budget: the least recently used evictable one goes, never the layer in use nor the
        # one the store lacks
        evicted = await cache.enforce_budget(4 * each, {in_use}, set())
        assert evicted == [f"layers/{old}"], evicted
        assert not cache.layer_dir(old).exists() and not await cache.local.has_blob("layers", old)
        for d in (in_use, unpublished, recent):
            assert cache.layer_dir(d).is_dir()
        # a tiny budget: everything evictable goes, oldest first (the drive, then the recent layer);
        # what is needed or only here stays
        evicted = await cache.enforce_budget(1, {in_use}, set())
        assert evicted == [f"drives/{drive}", f"layers/{recent}"], evicted
        assert cache.layer_dir(in_use).is_dir() and cache.layer_dir(unpublished).is_dir()
        # an evicted layer is pulled back on its next use, with its content
        back = await cache.ensure_layer(old)
        assert (back / "data.bin").read_bytes()[-1] == 0

    asyncio.run(go())
