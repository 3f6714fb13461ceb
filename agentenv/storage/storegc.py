"""Garbage collection of the snapshot store: mark and sweep over everything that references blobs.

**Mark**: the roots are every snapshot manifest in the store (snapshots and checkpoints: each
lists its whole layer chain, so deleting a checkpoint keeps what its descendants share) and every
row of the state store that names blobs — sandboxes (running ones mount layers pulled from the
store; paused ones published their layers and memory image), template builds and the template
build cache, the snapshot catalog — plus whatever the caller adds (a server: its warm images, pool
and restores in flight). A memory image marks the drives its `requires` record names and the page
packs its `pagemaps` record names (a recipe of deduplicated pages: `pagestore.py`).

**Sweep**: a blob nothing marks is removed only if it was last written more than `grace_s` ago.

**Why that is safe against concurrent publishes**: a publish uploads blobs first and writes the
reference (manifest, or state-store row) last, and it takes far less than the grace period. A blob
it uploads is new (younger than the grace period); a blob it reuses is *touched* by `put_blob` (S3:
a copy onto itself; a directory: utime), which makes it just as young. The blobs are listed before
the roots are read, and each one is checked again (HEAD) right before its delete, so a touch that
lands before that check keeps it. The one window left — a touch between that check and the delete,
milliseconds — is closed on the publisher's side: after writing its reference it checks its blobs
and uploads any that vanished again (`ArtifactPublisher._verify`, artifactpublish.py). Manifests
that cannot be read stop the collection (nothing is removed on a partial view).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from agentenv.models import SnapshotRecord
from agentenv.storage.snapshots import BLOB_KINDS, BlobInfo, SnapshotStore, get_record

log = logging.getLogger("agentenv.storage.storegc")


@dataclass
class Roots:
    layers: set[str] = field(default_factory=set)
    memory: set[str] = field(default_factory=set)
    sources: dict[str, int] = field(default_factory=dict)  # what referenced them: name -> count

    def add(self, source: str, layers, memory: str | None) -> None:
        self.layers.update(layers or [])
        if memory:
            self.memory.add(memory)
        self.sources[source] = self.sources.get(source, 0) + 1

    def merge(self, other: tuple[set[str], set[str]], source: str) -> None:
        self.layers |= other[0]
        self.memory |= {m for m in other[1] if m}
        self.sources[source] = self.sources.get(source, 0) + len(other[0]) + len(other[1])


@dataclass
class StoreGCResult:
    scanned: int = 0
    scanned_bytes: int = 0
    removed: list[BlobInfo] = field(default_factory=list)
    young: int = 0         # unreferenced, but inside the grace period
    referenced: int = 0
    seconds: float = 0.0
    dry_run: bool = False
    roots: dict[str, int] = field(default_factory=dict)

    @property
    def bytes_freed(self) -> int:
        return sum(b.size for b in self.removed)

    def summary(self) -> str:
        verb = "would remove" if self.dry_run else "removed"
        return (f"snapshot store: {verb} {len(self.removed)} of {self.scanned} blobs, "
                f"{self.bytes_freed / 1048576:.1f} MiB of {self.scanned_bytes / 1048576:.1f} MiB "
                f"({self.referenced} referenced, {self.young} unreferenced but younger than the grace period) "
                f"in {self.seconds:.2f}s")


async def state_roots(state, snapshot_store: SnapshotStore) -> Roots:
    """The roots every collector counts: store manifests and the state store's rows."""
    roots = Roots()
    for m in await snapshot_store.list_manifests():
        s = SnapshotRecord.from_manifest(m)
        roots.add("manifests", s.layers, s.memory_digest)
    for rec in await state.list_sandboxes():
        roots.add("sandboxes", rec.layers, rec.memory_digest)
    for snap in await state.list_snapshots():
        roots.add("snapshot catalog", snap.layers, snap.memory_digest)
    for b in await state.list_builds():
        roots.add("template builds", b.layers, b.memory_digest)
    for e in await state.list_cache_entries():
        roots.add("build cache", e.get("layers", []), e.get("memory"))
    return roots


async def _record(store: SnapshotStore, kind: str, memory: str, key: str) -> set[str] | None:
    """The names listed under `key` in the record `kind/<memory>`; None if there is none."""
    record = await get_record(store, kind, memory)
    return None if record is None else set(record.get(key) or [])


async def collect(store: SnapshotStore, roots_fn: Callable[[], Awaitable[Roots]], *, grace_s: float,
                  dry_run: bool = False, progress: Callable[[str], None] | None = None) -> StoreGCResult:
    """Mark and sweep (see the module docstring). `progress` gets one line per step and per blob."""
    t0 = time.monotonic()
    say = progress or (lambda _line: None)
    res = StoreGCResult(dry_run=dry_run)
    blobs: dict[str, list[BlobInfo]] = {}
    for kind in BLOB_KINDS:  # listed BEFORE the roots are read: see the module docstring
        blobs[kind] = await store.list_blob_info(kind)
    res.scanned = sum(len(v) for v in blobs.values())
    res.scanned_bytes = sum(b.size for v in blobs.values() for b in v)
    say(f"listed {res.scanned} blobs ({res.scanned_bytes / 1048576:.1f} MiB) in the {store.name} snapshot store")
    roots = await roots_fn()
    res.roots = dict(roots.sources)
    log.debug("roots: layers %s memory %s", sorted(roots.layers), sorted(roots.memory))
    say("roots: " + (", ".join(f"{n} {k}" for k, n in sorted(roots.sources.items())) or "none")
        + f" -> {len(roots.layers)} layers, {len(roots.memory)} memory images referenced")
    cutoff = time.time() - grace_s

    def doomed(b: BlobInfo, marked: set[str]) -> bool:
        if b.digest in marked:
            res.referenced += 1
            return False
        if b.modified >= cutoff:
            res.young += 1
            return False
        return True

    gone_memory = [b for b in blobs["memory"] if doomed(b, roots.memory)]
    gone_set = {b.digest for b in gone_memory}
    kept_memory = {b.digest for b in blobs["memory"]} - gone_set
    # drives: marked by the requires record of every memory image that stays; one without a record
    # (published before records existed) could need any drive, so then no drive is removed.
    drives_needed: set[str] | None = set()
    for m in sorted(kept_memory) if blobs["drives"] else []:  # no drives (gVisor only): nothing to read
        req = await _record(store, "requires", m, "drives")
        if req is None:
            drives_needed = None
            break
        drives_needed |= req
    # page packs: marked by the pagemap of every memory image that stays (one without a pagemap is
    # a whole image, which needs none: a recipe's pagemap is uploaded before the recipe)
    packs_needed: set[str] = set()
    for m in sorted(kept_memory) if blobs["pages"] else []:
        packs_needed |= await _record(store, "pagemaps", m, "packs") or set()
    doomed_list = [b for b in blobs["layers"] if doomed(b, roots.layers)] + gone_memory
    doomed_list += [b for b in blobs["requires"] + blobs["pagemaps"] if doomed(b, kept_memory)]
    doomed_list += [b for b in blobs["pages"] if doomed(b, packs_needed)]
    if drives_needed is None:
        if blobs["drives"]:
            say(f"keeping all {len(blobs['drives'])} drives: a memory image has no requires record")
        res.referenced += len(blobs["drives"])
    else:
        doomed_list += [b for b in blobs["drives"] if doomed(b, drives_needed)]
    for b in doomed_list:
        if await _sweep(store, b, cutoff, dry_run):
            res.removed.append(b)
            say(f"{'would remove' if dry_run else 'removed'} {b.kind}/{b.digest} ({b.size / 1048576:.1f} MiB)")
        else:
            res.young += 1
    res.seconds = time.monotonic() - t0
    say(res.summary())
    log.info("%s", res.summary())
    return res


async def _sweep(store: SnapshotStore, b: BlobInfo, cutoff: float, dry_run: bool) -> bool:
    """Remove one blob if it is still as old as it was listed (a publish may have touched it since)."""
    now = await store.blob_info(b.kind, b.digest)
    if now is None or now.modified >= cutoff:
        return False
    if not dry_run:
        await store.delete_blob(b.kind, b.digest)
    return True


class StoreCollector:
    """The periodic job: `collect` every `interval_s` (0: never) on ONE role (a single server, or
    the cluster's scheduler), so nodes never sweep the shared store against each other."""

    def __init__(self, store: SnapshotStore, roots_fn: Callable[[], Awaitable[Roots]], *,
                 interval_s: float, grace_s: float,
                 after: Callable[[], Awaitable[object]] | None = None) -> None:
        """`after`: run when a round removed something (a single server then sweeps its own
        artifacts: memory pages only a removed recipe held)."""
        self.store = store
        self.roots_fn = roots_fn
        self.interval_s = interval_s
        self.grace_s = grace_s
        self.after = after
        self.last: StoreGCResult | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self.interval_s > 0 and self._task is None:
            self._task = asyncio.create_task(self._loop(), name="snapshot-store-gc")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.last = await collect(self.store, self.roots_fn, grace_s=self.grace_s)
                if self.last.removed and self.after is not None:
                    await self.after()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the next round tries again
                log.warning("snapshot store GC failed: %s", e)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
