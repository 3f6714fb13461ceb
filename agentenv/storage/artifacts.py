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
That holds only if the caller names (or pins) what a seal returned before its next `await`: a
sequence of seals pins the first one's result while the next runs (`SandboxHost.seal`).

`publish` uploads a snapshot's blobs to the configured SnapshotStore and writes its manifest last;
`ensure_*` pulls what a node lacks from the store on demand, so a node with an empty data dir can
start a sandbox from a snapshot that exists only in the store.

The class is split by concern: `ArtifactCache` (here) seals and fetches artifacts; its bases hold
the rest — `artifactfiles.ArtifactFiles` (paths, use stamps, sizes, memory-image bookkeeping),
`artifactgc.ArtifactCollector` (size budget, garbage collection) and
`artifactpublish.ArtifactPublisher` (publication, page packs to and from the store).
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
from pathlib import Path

from agentenv.errors import NotFound, RuntimeFailure
from agentenv.storage import layers as layer_tar
from agentenv.storage.artifactfiles import DRIVE_FILE, REQUIRES_FILE, drive_path
from agentenv.storage.artifactgc import ArtifactCollector
from agentenv.storage.artifactpublish import ArtifactPublisher
from agentenv.storage.pagestore import Recipe, is_recipe

log = logging.getLogger("agentenv.storage.artifacts")


def _empty_upper(upper: Path) -> bool:
    """An upper with nothing but the tools mount point is no change at all."""
    for entry in os.scandir(upper):
        if entry.name == ".agentenv" and entry.is_dir() and not os.listdir(entry.path):
            continue
        return False
    return True


class ArtifactCache(ArtifactPublisher, ArtifactCollector):
    """A node's cache of snapshot artifacts (see the module docstring): sealing and fetching here,
    the rest in its bases."""

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
