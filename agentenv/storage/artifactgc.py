"""Reclaiming a node's artifact cache: the size budget (`enforce_budget`) and garbage collection (`gc`).

`ArtifactCollector` is mixed into `artifacts.ArtifactCache` (on `artifactfiles.ArtifactFiles`, whose
use stamps give the eviction order). Eviction removes, least recently used first, what the snapshot
store also holds and nothing here needs; of a memory image stored as pages only the extracted copy.
Collection removes local artifacts nothing references, then sweeps the page store when a recipe it
counted is gone — never what a seal returned after the caller took its in-use sets, nor what a seal
under way wrote. The policy is described in artifacts.py.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path

from agentenv.storage.artifactfiles import ArtifactFiles
from agentenv.storage.pagestore import is_recipe

log = logging.getLogger("agentenv.storage.artifacts")


class ArtifactCollector(ArtifactFiles):
    """Eviction under the size budget and garbage collection of a node's artifact cache."""

    # ---------------------------------------------------------------- the size budget

    async def enforce_budget(self, max_bytes: int, layers_needed: set[str], memory_needed: set[str]) -> list[str]:
        """Evict, least recently used first, cached artifacts the snapshot store holds and nothing
        here needs, until the cache fits `max_bytes`. Returns the evicted `kind/digest`s."""
        entries = self.cached()
        sizes = dict(zip(entries, await asyncio.gather(*(asyncio.to_thread(self._size, k, d) for k, d in entries))))
        total = sum(sizes.values())
        if total <= max_bytes:
            return []
        drives_needed = {e.get("digest") for m in memory_needed for e in self.requires_of(m).values()}
        needed = {"layers": layers_needed, "memory": memory_needed, "drives": drives_needed}
        evicted: list[str] = []
        for kind, digest in sorted(entries, key=lambda e: self._last_used(*e)):
            if total <= max_bytes:
                break
            if digest in needed[kind]:
                continue
            if kind == "memory" and self.has_recipe(digest):  # only the rebuildable cache goes
                if self.memory_dir(digest).exists():
                    total -= await self._drop_extracted(digest)
                    evicted.append(f"{kind}/{digest}")
                continue
            if not await self.store.has_blob(kind, digest):
                continue
            async with self._locks[digest]:
                shutil.rmtree(self._extracted(kind, digest), ignore_errors=True)
                await self.local.delete_blob(kind, digest)
                self._stamp(kind, digest).unlink(missing_ok=True)
            total -= sizes[(kind, digest)]
            evicted.append(f"{kind}/{digest}")
        if evicted:
            log.info("artifact cache over budget: evicted %d least recently used artifact(s) (%s); %d MiB left",
                     len(evicted), ", ".join(e[:19] for e in evicted[:8]), total >> 20)
        if total > max_bytes:
            log.warning("artifact cache holds %d MiB, over its budget of %d MiB: the rest is in use here or only "
                        "here", total >> 20, max_bytes >> 20)
        return evicted

    # ---------------------------------------------------------------- garbage collection

    async def gc(self, layers_in_use: set[str], memory_in_use: set[str], *,
                 fresh_since: float | None = None) -> dict[str, int]:
        """Remove local artifacts nothing references (blobs in the store: `storegc.py`).

        `fresh_since`: when the caller began collecting the in-use sets. An artifact sealed or pulled
        after that (its use stamp is newer), or written by a seal still under way, is kept: its sealer
        pins it right after the seal returns, which the sets may have missed."""
        self._fresh = {d: t for d, t in self._fresh.items() if t > time.time() - 3600}
        removed = {"layers": 0, "memory": 0}
        if self._swept_roots is None and await asyncio.to_thread(self.local.remove_stale_temps):
            log.info("removed the temporary files of downloads a dead process left")  # first gc only
        for kind, in_use, dir_of in (("layers", layers_in_use, self.layer_dir),
                                     ("memory", memory_in_use, self.memory_dir)):
            base = self.root / kind
            for trash in base.glob(".drop-*") if base.exists() else ():  # a crash mid-drop
                shutil.rmtree(trash, ignore_errors=True)
            digests = {p.name for p in base.iterdir() if not p.name.startswith(".")} if base.exists() else set()
            digests |= set(await self.local.list_blobs(kind))
            for d in digests - in_use:
                if fresh_since is not None and self._maybe_unclaimed(kind, d, fresh_since):
                    continue
                async with self._locks[d]:
                    if fresh_since is not None and self._last_used(kind, d) >= fresh_since - 0.05:  # coarse file clocks
                        continue
                    shutil.rmtree(dir_of(d), ignore_errors=True)
                    await self.local.delete_blob(kind, d)
                    self._stamp(kind, d).unlink(missing_ok=True)
                    removed[kind] += 1
        # pages only a removed recipe used: reclaim them. Only when a recipe the last sweep counted
        # is gone (removed here, or from this node's own store by its GC): otherwise the sweep would
        # only read every recipe and mark every page again (seconds for 100 checkpoints of 256 MiB),
        # at every checkpoint deleted.
        roots = frozenset(p.name for p in await asyncio.to_thread(self._recipes))  # digests
        if (self._swept_roots - roots) if self._swept_roots is not None else removed["memory"]:
            removed.update(await asyncio.to_thread(self.pages.sweep, self._recipes))
        self._swept_roots = roots
        return removed

    def _maybe_unclaimed(self, kind: str, digest: str, since: float) -> bool:
        if self._fresh.get(digest, 0.0) >= since:
            return True
        if not self._active:
            return False
        blob = self.local.blob_path(kind, digest)
        try:
            return blob.stat().st_mtime >= min(self._active) - 1.0  # written by a seal under way
        except OSError:
            return False

    def _recipes(self) -> list[Path]:
        """Every memory recipe of this node (the live roots of the page store): the local blobs and
        those in this node's own snapshot store."""
        dirs = [self.local.root / "memory"]
        if self._store_is_mine():
            dirs.append(self.store.root / "memory")  # type: ignore[attr-defined]
        out: dict[str, Path] = {}  # one path per digest (the store's copy is a hard link of the local one)
        for d in dirs:
            if d.is_dir():
                out.update({p.name: p for p in d.iterdir() if not p.name.startswith(".") and p.name not in out
                            and is_recipe(p)})
        return list(out.values())
