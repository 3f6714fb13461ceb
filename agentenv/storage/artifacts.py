"""Node-local cache of snapshot artifacts, and their publication to the snapshot store.

Artifacts are content-addressed by the sha256 of their tar stream:
- layers: a sealed writable upper. Kept extracted at `<data>/layers/<digest>/` (used directly as an
  overlay lower by every sandbox whose chain includes it) and as a tar in `<data>/cache/layers/`.
- memory: a runtime checkpoint image, stored deduplicated in 4 KiB pages (`pagestore`): its local
  blob `<data>/cache/memory/<digest>` is a *recipe* (the digest is the recipe's sha256) whose pages
  live in shared pack files under `<data>/pages/`, so a checkpoint that changed little since its
  parent costs about the pages it changed. `<data>/memory/<digest>/` (the image path a restore
  reads) is a cache rebuilt from the recipe on demand (`ensure_memory`): sealing keeps it (the
  caller may restore from it at once), `drop_extracted` and the size budget remove it. Images
  sealed before page storage are tars (kept as before). A node-local store receives the recipe (a
  hard link); any other store (S3) the recipe after the page packs it needs and their list
  (`_put_pages`), and a node that pulls such a recipe downloads the packs it lacks (`_pull_pages`).

- drives: a read-only VM drive (the guest's root or tools ext4) a memory image needs, because the
  guest kernel inside it has that exact drive's blocks cached. A memory image names them in its
  `requires.json` (`{"drives": {"<role>": {"path": ..., "digest": ...}}}`; the runtime writes the
  paths, sealing adds the digests). Drives are kept at their original path on the node that built
  them and extracted at `<data>/drives/<digest>/drive.ext4` on nodes that pull them; a node builds
  its own drives byte-differently, hence the transfer. Drives built here are not collected (one
  per guest build); pulled ones are, like layers and memory images, by the size budget below.

The size budget (`enforce_budget`, `Settings.artifact_cache_max_mb`): when the cached artifacts of
a node (tar or recipe + extracted copy; pulled drives) exceed it, those the snapshot store also
holds and no sandbox, warm image or restore of this node needs are removed, least recently used
first; the next use pulls them again. Of a memory image stored here as pages only the extracted
copy is removed (rebuilt on its next use; the page packs are not counted). Use is stamped at every
`ensure_*` and seal (`<data>/cache/.used/`).

Garbage collection (`gc`): local artifacts no longer referenced are removed, then the page store
is swept (mark-and-sweep over the remaining recipes). A collection never removes what a seal
returned after the caller took its in-use sets (`fresh_since`), nor what a seal under way wrote.

`publish` uploads a snapshot's blobs to the configured SnapshotStore and writes its manifest last;
`ensure_*` pulls what a node lacks from the store on demand, so a node with an empty data dir can
start a sandbox from a snapshot that exists only in the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import shutil
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from agentenv.errors import NotFound, RuntimeFailure
from agentenv.models import SnapshotRecord
from agentenv.storage import layers as layer_tar
from agentenv.storage.pagestore import PageStore, Recipe, is_recipe
from agentenv.storage.snapshots import LocalSnapshotStore, SnapshotStore, get_record, put_record

log = logging.getLogger("agentenv.storage.artifacts")


REQUIRES_FILE = "requires.json"
PAGE_KINDS = ("pages", "pagemaps")  # the blobs of a memory recipe's pages in a store not the node's own
DRIVE_FILE = "drive.ext4"


def drive_path(data_dir: Path, digest: str) -> Path:
    """Where a pulled VM drive lives on a node (see the module docstring)."""
    return Path(data_dir) / "drives" / digest / DRIVE_FILE


def _empty_upper(upper: Path) -> bool:
    """An upper with nothing but the tools mount point is no change at all."""
    for entry in os.scandir(upper):
        if entry.name == ".agentenv" and entry.is_dir() and not os.listdir(entry.path):
            continue
        return False
    return True


class ArtifactCache:
    def __init__(self, data_dir: Path, store: SnapshotStore) -> None:
        self.root = Path(data_dir)
        self.store = store
        self.local = LocalSnapshotStore(self.root / "cache")  # tars, by kind/digest
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.pages = PageStore(self.root / "pages")
        self._active: list[float] = []  # start times of the seals under way
        self._fresh: dict[str, float] = {}  # digest -> when its seal returned (its caller pins it then)
        self._swept_roots: frozenset[str] | None = None  # the recipes the last gc saw (None: no gc yet)

    # ---------------------------------------------------------------- use stamps and the size budget

    def _stamp(self, kind: str, digest: str) -> Path:
        return self.root / "cache" / ".used" / f"{kind}-{digest}"

    def touch(self, kind: str, digest: str) -> None:
        """Record a use of an artifact (its place in the LRU order)."""
        p = self._stamp(kind, digest)
        try:
            p.touch()
        except FileNotFoundError:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.touch()

    def _last_used(self, kind: str, digest: str) -> float:
        try:
            return self._stamp(kind, digest).stat().st_mtime
        except OSError:
            return 0.0  # never stamped (cached before stamps existed): oldest

    def _extracted(self, kind: str, digest: str) -> Path:
        return drive_path(self.root, digest).parent if kind == "drives" else self.root / kind / digest

    def _size(self, kind: str, digest: str) -> int:
        blob = self.local.blob_path(kind, digest)
        total = blob.stat().st_blocks * 512 if blob.exists() else 0
        return total + self._size_of_dir(self._extracted(kind, digest))

    def cached(self) -> list[tuple[str, str]]:
        """Every (kind, digest) this node caches: layers, memory images, pulled drives."""
        out: set[tuple[str, str]] = set()
        for kind in ("layers", "memory", "drives"):
            base = self.root / kind
            if base.exists():
                out |= {(kind, p.name) for p in base.iterdir() if not p.name.startswith(".")}
            blobs = self.local.root / kind
            if blobs.exists():
                out |= {(kind, p.name) for p in blobs.iterdir() if not p.name.startswith(".")}
        return sorted(out)

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

    def layer_dir(self, digest: str) -> Path:
        return self.root / "layers" / digest

    def memory_dir(self, digest: str) -> Path:
        return self.root / "memory" / digest

    def has_memory(self, digest: str) -> bool:
        """The memory image `digest` is on this node: extracted, or as a recipe (`ensure_memory`)."""
        return self.memory_dir(digest).is_dir() or self.has_recipe(digest)

    def has_recipe(self, digest: str) -> bool:
        """The memory image `digest` is stored here as a recipe of deduplicated pages."""
        return is_recipe(self.local.blob_path("memory", digest))

    def memory_size(self, digest: str) -> int:
        """The size of the memory image `digest` (its files' sizes), as stored here."""
        blob = self.local.blob_path("memory", digest)
        if is_recipe(blob):
            return Recipe.load(blob).size
        return blob.stat().st_size

    def requires_of(self, digest: str) -> dict[str, dict]:
        """`required_drives` of the memory image `digest`, from its extracted copy or its recipe."""
        image = self.memory_dir(digest)
        if image.is_dir():
            return self.required_drives(image)
        blob = self.local.blob_path("memory", digest)
        if not is_recipe(blob):
            return {}
        recipe = Recipe.load(blob)
        for f in recipe.files:
            if f["path"] == REQUIRES_FILE:
                with tempfile.TemporaryDirectory(dir=self._tmp_dir()) as tmp:
                    self.pages.materialize(Recipe([f]), Path(tmp))
                    return self.required_drives(Path(tmp))
        return {}

    async def drop_extracted(self, digest: str, in_use=lambda: False) -> None:
        """Remove the extracted copy of a memory image stored as a recipe (rebuilt when next needed),
        unless `in_use()` (checked under the image's lock, e.g. a pin taken meanwhile) says otherwise."""
        if self.has_recipe(digest):
            await self._drop_extracted(digest, in_use)

    async def _drop_extracted(self, digest: str, in_use=lambda: False) -> int:
        dst = self.memory_dir(digest)
        size = await asyncio.to_thread(self._size_of_dir, dst)
        async with self._locks[digest]:
            if in_use() or not dst.exists():
                return 0
            trash = dst.with_name(f".drop-{digest}-{os.getpid()}")
            os.replace(dst, trash)  # at once: a concurrent ensure_memory rebuilds it, never sees it half gone
        await asyncio.to_thread(shutil.rmtree, trash, True)
        return size

    @staticmethod
    def _size_of_dir(path: Path) -> int:
        total = 0
        for dirpath, _dirs, files in os.walk(path):
            for f in files:
                try:
                    total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
                except OSError:
                    pass
        return total

    # ---------------------------------------------------------------- sealing

    async def seal_upper(self, upper: Path) -> str | None:
        """Turn a (no longer mounted) upper dir into a layer; returns its digest, None if empty.

        The upper directory itself becomes the extracted layer (a rename, no copy).
        """
        if _empty_upper(upper):
            shutil.rmtree(upper, ignore_errors=True)
            return None
        with self._sealing():
            digest = await self._seal("layers", upper, self.layer_dir)
            self._fresh[digest] = time.time()
        return digest

    @contextlib.contextmanager
    def _sealing(self):
        t = time.time()
        self._active.append(t)
        try:
            yield
        finally:
            self._active.remove(t)

    async def seal_memory(self, image_dir: Path) -> str:
        """Turn a checkpoint image dir into a memory artifact; returns its digest.

        Its pages go to the page store (those not stored yet) and its recipe becomes the local blob,
        durably, before `image_dir` moves to the image's extracted place (a rename, no copy)."""
        with self._sealing():
            digest = await self._seal_memory(image_dir)
            self._fresh[digest] = time.time()
        return digest

    async def _seal_memory(self, image_dir: Path) -> str:
        await self._seal_required_drives(image_dir)
        t0 = time.monotonic()
        digest, recipe, new = await asyncio.to_thread(self.pages.seal, image_dir,
                                                      lambda d: self.local.blob_path("memory", d))
        self.touch("memory", digest)
        log.info("sealed memory image %s: %d MiB, %d MiB of it new pages, in %.2fs", digest[:12],
                 recipe.size >> 20, new >> 20, time.monotonic() - t0)
        async with self._locks[digest]:
            dst = self.memory_dir(digest)
            if dst.exists():
                await asyncio.to_thread(shutil.rmtree, image_dir, True)
                return digest
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.replace(image_dir, dst)
            except OSError as e:
                if e.errno != errno.EXDEV:
                    raise
                # on another filesystem (a per-sandbox disk image): rebuilt from the recipe when needed
                await asyncio.to_thread(shutil.rmtree, image_dir, True)
        return digest

    async def _seal_required_drives(self, image_dir: Path) -> None:
        """Give every drive the image requires a digest (sealing the drive once per node)."""
        req_file = image_dir / REQUIRES_FILE
        if not req_file.is_file():
            return
        req = json.loads(req_file.read_text())
        for entry in (req.get("drives") or {}).values():
            if not entry.get("digest"):
                entry["digest"] = await self.seal_drive(Path(entry["path"]))
        req_file.write_text(json.dumps(req, indent=1, sort_keys=True))

    async def seal_drive(self, path: Path) -> str:
        """The digest of a read-only drive file, sealed into the local blob cache (once: the result is
        remembered beside the drive, valid while its size and mtime are unchanged)."""
        st = path.stat()
        stamp = f"{st.st_size}:{st.st_mtime_ns}"
        side = path.with_name(path.name + ".digest")
        try:
            saved_stamp, digest = side.read_text().split()
            if saved_stamp == stamp and await self.local.has_blob("drives", digest):
                return digest
        except (OSError, ValueError):
            pass
        tmp_dir = Path(tempfile.mkdtemp(dir=self._tmp_dir(), prefix="drive-"))
        fd, tmp = tempfile.mkstemp(dir=self._tmp_dir(), suffix=".tar")
        os.close(fd)
        try:
            os.link(path, tmp_dir / DRIVE_FILE)  # same file system (both under the data dir): no copy
            t0 = asyncio.get_running_loop().time()
            digest, size = await layer_tar.pack(tmp_dir, Path(tmp), sparse=True)
            self.touch("drives", digest)
            async with self._locks[digest]:
                await self.local.put_blob("drives", digest, Path(tmp))
            log.info("sealed VM drive %s as %s (%d MiB tar) in %.1fs", path.name, digest[:12], size >> 20,
                     asyncio.get_running_loop().time() - t0)
        finally:
            Path(tmp).unlink(missing_ok=True)
            shutil.rmtree(tmp_dir, ignore_errors=True)
        side.write_text(f"{stamp} {digest}\n")
        return digest

    def _tmp_dir(self) -> Path:
        d = self.root / "cache" / ".tmp"
        d.mkdir(parents=True, exist_ok=True)
        return d

    @staticmethod
    def required_drives(image_dir: Path) -> dict[str, dict]:
        """The drives a memory image needs: role -> {"path", "digest"} (empty for non-VM images)."""
        try:
            return dict(json.loads((image_dir / REQUIRES_FILE).read_text()).get("drives") or {})
        except (OSError, ValueError):
            return {}

    async def _seal(self, kind: str, src: Path, dir_of, sparse: bool = False) -> str:
        """Tar + hash `src` into the local blob cache, then move `src` to its extracted place."""
        fd, tmp = tempfile.mkstemp(dir=self._tmp_dir(), suffix=".tar")
        os.close(fd)
        try:
            digest, _size = await layer_tar.pack(src, Path(tmp), sparse=sparse)
            self.touch(kind, digest)
            async with self._locks[digest]:
                await self.local.put_blob(kind, digest, Path(tmp))
                dst = dir_of(digest)
                if dst.exists():
                    shutil.rmtree(src, ignore_errors=True)
                else:
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    try:
                        os.replace(src, dst)
                    except OSError as e:
                        if e.errno != errno.EXDEV:
                            raise
                        # src is on another filesystem (a per-sandbox disk image): extract the blob.
                        await layer_tar.unpack(self.local.blob_path(kind, digest), dst)
                        shutil.rmtree(src, ignore_errors=True)
        finally:
            Path(tmp).unlink(missing_ok=True)
        self.touch(kind, digest)  # sealed now, and no await until the caller pins it: `gc` spares it
        return digest

    # ---------------------------------------------------------------- fetching

    async def _ensure(self, kind: str, digest: str, dst: Path) -> Path:
        self.touch(kind, digest)
        if dst.exists():
            return dst
        async with self._locks[digest]:
            if dst.exists():
                return dst
            if not await self.local.has_blob(kind, digest):
                if not await self.store.has_blob(kind, digest):
                    raise NotFound(f"{kind[:-1] if kind.endswith('s') else kind} {digest[:12]} is missing "
                                   "from the snapshot store")
                tmp = self.local.blob_path(kind, digest)
                log.info("downloading %s/%s from the %s snapshot store", kind, digest[:12], self.store.name)
                await self.store.get_blob(kind, digest, tmp)
            dst.parent.mkdir(parents=True, exist_ok=True)
            blob = self.local.blob_path(kind, digest)
            if kind == "memory" and is_recipe(blob):
                await self._pull_pages(digest, blob)
                await self._materialize(blob, dst)
            else:
                await layer_tar.unpack(blob, dst)
        return dst

    async def _materialize(self, recipe_file: Path, dst: Path) -> None:
        """Rebuild an image from its recipe beside `dst`, then rename it into place."""
        tmp = dst.with_name(f".{dst.name}.extract")
        await asyncio.to_thread(shutil.rmtree, tmp, True)
        t0 = time.monotonic()
        try:
            recipe = Recipe.load(recipe_file)
            await asyncio.to_thread(self.pages.materialize, recipe, tmp)
        except BaseException as e:
            await asyncio.to_thread(shutil.rmtree, tmp, True)
            if isinstance(e, (OSError, ValueError)):
                raise RuntimeFailure(f"memory image {dst.name[:12]} could not be rebuilt from its pages: {e}") from e
            raise
        os.replace(tmp, dst)
        log.info("rebuilt memory image %s (%d MiB) from its pages in %.2fs", dst.name[:12], recipe.size >> 20,
                 time.monotonic() - t0)

    async def ensure_layer(self, digest: str) -> Path:
        return await self._ensure("layers", digest, self.layer_dir(digest))

    async def ensure_memory(self, digest: str) -> Path:
        image = await self._ensure("memory", digest, self.memory_dir(digest))
        for entry in self.required_drives(image).values():  # built elsewhere: pull the exact drive
            if not Path(entry["path"]).is_file():
                await self.ensure_drive(entry["digest"])
        return image

    async def ensure_drive(self, digest: str) -> Path:
        path = drive_path(self.root, digest)
        await self._ensure("drives", digest, path.parent)
        side = path.with_name(path.name + ".digest")
        if not side.exists():  # its digest is known: a later capture of a VM on it need not re-seal it
            st = path.stat()
            side.write_text(f"{st.st_size}:{st.st_mtime_ns} {digest}\n")
        return path

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

    def _store_is_mine(self) -> bool:
        """The snapshot store is a directory inside this node's data dir (the single-node default):
        it can hold a recipe whose pages are in this node's page store."""
        if not isinstance(self.store, LocalSnapshotStore):
            return False
        return self.store.root.resolve().is_relative_to(self.root.resolve())

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

    async def find_manifest(self, id_or_name: str) -> SnapshotRecord | None:
        m = await self.store.get_manifest(id_or_name) if _plain(id_or_name) else None
        if m is None:
            named = [x for x in await self.store.list_manifests() if id_or_name in x.get("names", [])]
            named.sort(key=lambda x: x.get("createdAt", ""))
            m = named[-1] if named else None
        return SnapshotRecord.from_manifest(m) if m else None

    # ---------------------------------------------------------------- garbage collection

    async def gc(self, layers_in_use: set[str], memory_in_use: set[str], *,
                 fresh_since: float | None = None) -> dict[str, int]:
        """Remove local artifacts nothing references (blobs in the store: `storegc.py`).

        `fresh_since`: when the caller began collecting the in-use sets. An artifact sealed or pulled
        after that (its use stamp is newer), or written by a seal still under way, is kept: its sealer
        pins it right after the seal returns, which the sets may have missed."""
        self._fresh = {d: t for d, t in self._fresh.items() if t > time.time() - 3600}
        removed = {"layers": 0, "memory": 0}
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

    async def delete_from_store(self, snap: SnapshotRecord) -> None:
        """Delete a snapshot's manifest (it disappears at once). Its blobs stay until the store's GC
        (`storegc.py`) finds nothing references them: another publish may be reusing one right now."""
        await self.store.delete_manifest(snap.snapshot_id)


def _plain(name: str) -> bool:
    return bool(name) and "/" not in name and not name.startswith(".")
