"""Publication of a node's snapshot artifacts to the snapshot store, and the page packs both ways.

`ArtifactPublisher` is mixed into `artifacts.ArtifactCache` (on `artifactfiles.ArtifactFiles`).
`publish` uploads a snapshot's blobs — layers, the drives and `requires` record of its memory image,
then the image — and writes its manifest last, then re-uploads any blob the store's GC removed in
the meantime (`_verify`, see storegc.py). A memory image stored as a page recipe goes to a store that
is not the node's own after the page packs it needs and their list (`_put_pages`); a node that pulls
such a recipe downloads the packs it lacks (`_pull_pages`). Also: finding and deleting manifests.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
from pathlib import Path

from agentenv.errors import NotFound, RuntimeFailure
from agentenv.models import SnapshotRecord
from agentenv.storage.artifactfiles import ArtifactFiles
from agentenv.storage.pagestore import Recipe, is_recipe
from agentenv.storage.snapshots import get_record, put_record

log = logging.getLogger("agentenv.storage.artifacts")


PAGE_KINDS = ("pages", "pagemaps")  # the blobs of a memory recipe's pages in a store not the node's own


class ArtifactPublisher(ArtifactFiles):
    """Publication of a node's artifacts to the snapshot store, and page packs to and from it."""

    # ---------------------------------------------------------------- publication

    async def publish(self, snap: SnapshotRecord) -> None:
        """Upload blobs (idempotent, retried by the store client), then the manifest, last."""
        blobs = await self._upload(snap.layers, snap.memory_digest)
        await self.store.put_manifest(snap.snapshot_id, snap.to_manifest())
        await self._verify(blobs)

    async def publish_blobs(self, layers: list[str], memory: str | None) -> None:
        """Upload blobs (without a manifest): a paused sandbox's state for other nodes to resume."""
        await self._verify(await self._upload(layers, memory))

    async def _upload(self, layers: list[str], memory: str | None) -> list[tuple[str, str]]:
        """Every blob of a layer chain + memory image into the store (drives, the memory image's
        `requires` record and its page packs before the image: a reader or GC that sees the image sees
        what it needs). A blob the store already has is touched (`put_blob`), which keeps it from GC's
        grace period. Returns the blobs put, for `_verify`."""
        blobs = [("layers", d) for d in layers]
        if memory:
            blobs += self._drive_blobs(memory)
        for kind, digest in blobs:
            await self._put(kind, digest)
        if memory:
            await self._put_requires(memory)
            blobs += await self._put("memory", memory)
            blobs.append(("memory", memory))
        return blobs

    async def _put(self, kind: str, digest: str) -> list[tuple[str, str]]:
        """Put one blob; returns the page blobs put before it (a memory recipe's, else none)."""
        if await self.local.has_blob(kind, digest):
            return await self._put_local(kind, digest)
        if not await self.store.has_blob(kind, digest):
            raise NotFound(f"{kind} {digest[:12]} is neither on this node nor in the snapshot store")
        return []

    async def _put_requires(self, memory: str) -> None:
        """The drives a memory image needs, as a small blob named after the image (for the store's GC).
        Only from a memory image this node has: one published elsewhere already has its record."""
        if not self.has_memory(memory):
            return
        drives = sorted(e["digest"] for e in self.requires_of(memory).values() if e.get("digest"))
        await put_record(self.store, "requires", memory, {"drives": drives})

    async def _verify(self, blobs: list[tuple[str, str]]) -> None:
        """After the reference is written: a blob the store's GC removed in the instant between its
        last check and our touch is uploaded again (storegc.py explains the window). Page packs and
        their list come back with their memory image's pages (`_put_pages`)."""
        missing = [(kind, digest) for kind, digest in blobs if not await self.store.has_blob(kind, digest)]
        for kind, digest in missing:
            if kind not in PAGE_KINDS and await self.local.has_blob(kind, digest):
                log.warning("%s/%s vanished from the snapshot store during its publish; uploading it again",
                            kind, digest[:12])
                await self._put_local(kind, digest)  # a memory recipe: its pages with it
        memory = next((d for k, d in blobs if k == "memory"), None)
        if memory and ("memory", memory) not in missing and any(k in PAGE_KINDS for k, _ in missing):
            await self._put_pages(memory, self.local.blob_path("memory", memory), again=True)

    def _drive_blobs(self, memory_digest: str) -> list[tuple[str, str]]:
        return [("drives", e["digest"]) for e in self.requires_of(memory_digest).values() if e.get("digest")]

    async def _put_local(self, kind: str, digest: str) -> list[tuple[str, str]]:
        """Put a local blob into the store. A memory recipe goes as is to this node's own store, and
        to any other after its page packs and their list (returned: the page blobs put)."""
        blob = self.local.blob_path(kind, digest)
        if kind != "memory" or self._store_is_mine() or not is_recipe(blob):
            await self.store.put_blob(kind, digest, blob)
            return []
        if await self.store.touch_blob(kind, digest):  # there already (kept from GC's grace period)
            return []
        pages = await self._put_pages(digest, blob)
        await self.store.put_blob(kind, digest, blob)
        return pages

    # ---------------------------------------------------------------- page packs to and from the store

    async def _put_pages(self, digest: str, recipe_file: Path, *, again: bool = False) -> list[tuple[str, str]]:
        """Before a recipe goes to a store that is not this node's: the packs its pages are in
        (`pages` blobs; those the store has are touched), then their list (`pagemaps/<digest>`).
        Returns those blobs."""
        recipe = await asyncio.to_thread(Recipe.load, recipe_file)
        tmp = Path(tempfile.mkdtemp(dir=self._tmp_dir(), prefix="packs-"))
        try:
            packs = await asyncio.to_thread(self.pages.link_packs, recipe, tmp)
            sent = 0
            for name, path in packs:
                if not await self.store.touch_blob("pages", name):
                    await self.store.put_blob("pages", name, path)
                    sent += path.stat().st_size
            await put_record(self.store, "pagemaps", digest, {"packs": [name for name, _ in packs]})
        finally:
            await asyncio.to_thread(shutil.rmtree, tmp, True)
        if again and sent:
            log.warning("page packs of memory image %s vanished from the snapshot store during its publish; "
                        "uploaded %d MiB again", digest[:12], sent >> 20)
        elif not again:
            log.info("memory image %s: %d MiB in %d page pack(s), %d MiB of them uploaded to the %s snapshot "
                     "store", digest[:12], recipe.size >> 20, len(packs), sent >> 20, self.store.name)
        return [("pages", name) for name, _ in packs] + [("pagemaps", digest)]

    async def _pull_pages(self, digest: str, recipe_file: Path) -> None:
        """The packs a recipe pulled from the snapshot store needs and this node lacks."""
        recipe = await asyncio.to_thread(Recipe.load, recipe_file)
        if self._store_is_mine() or not await asyncio.to_thread(self.pages.lacks, recipe):
            return
        record = await get_record(self.store, "pagemaps", digest)
        if record is None:
            raise RuntimeFailure(f"memory image {digest[:12]} is a page recipe, but the {self.store.name} snapshot "
                                 "store has no list of its page packs")
        names = record["packs"]
        t0, got = time.monotonic(), 0
        for name in names:
            if self.pages.has_pack(name):
                continue
            dst = await asyncio.to_thread(self.pages.download_path, name)
            await self.store.get_blob("pages", name, dst)
            got += dst.stat().st_size
            await asyncio.to_thread(self.pages.adopt, name, dst)
        log.info("memory image %s: downloaded %d MiB of page packs (%d listed) from the %s snapshot store in %.2fs",
                 digest[:12], got >> 20, len(names), self.store.name, time.monotonic() - t0)

    # ---------------------------------------------------------------- manifests

    async def find_manifest(self, id_or_name: str) -> SnapshotRecord | None:
        m = await self.store.get_manifest(id_or_name) if _plain(id_or_name) else None
        if m is None:
            named = [x for x in await self.store.list_manifests() if id_or_name in x.get("names", [])]
            named.sort(key=lambda x: x.get("createdAt", ""))
            m = named[-1] if named else None
        return SnapshotRecord.from_manifest(m) if m else None

    async def delete_from_store(self, snap: SnapshotRecord) -> None:
        """Delete a snapshot's manifest (it disappears at once). Its blobs stay until the store's GC
        (`storegc.py`) finds nothing references them: another publish may be reusing one right now."""
        await self.store.delete_manifest(snap.snapshot_id)


def _plain(name: str) -> bool:
    return bool(name) and "/" not in name and not name.startswith(".")
