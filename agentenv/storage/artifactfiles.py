"""Where a node's cached snapshot artifacts live, and what is known about them without a store.

`ArtifactFiles` is the base of `artifacts.ArtifactCache`: it holds the cache's state (the local
blobs, the page store, a lock per digest, the seals under way) and answers questions about it —
the paths of layers, memory images and pulled drives (`drive_path`), their use stamps (the LRU order
of the size budget) and sizes, which memory images are stored here as page recipes and which VM
drives one requires (`requires.json`), and drops the rebuildable extracted copy of a recipe's image.
artifacts.py describes the layout; the cache's other concerns are in artifactgc.py (size budget and
garbage collection) and artifactpublish.py (publication to the snapshot store).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path

from agentenv.storage.pagestore import PageStore, Recipe, is_recipe
from agentenv.storage.snapshots import LocalSnapshotStore, SnapshotStore

REQUIRES_FILE = "requires.json"
DRIVE_FILE = "drive.ext4"


def drive_path(data_dir: Path, digest: str) -> Path:
    """Where a pulled VM drive lives on a node (see artifacts.py)."""
    return Path(data_dir) / "drives" / digest / DRIVE_FILE


class ArtifactFiles:
    """The state of a node's artifact cache and what its files say (the base of `ArtifactCache`)."""

    def __init__(self, data_dir: Path, store: SnapshotStore) -> None:
        self.root = Path(data_dir)
        self.store = store
        self.local = LocalSnapshotStore(self.root / "cache")  # tars, by kind/digest
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.pages = PageStore(self.root / "pages")
        self._active: list[float] = []  # start times of the seals under way
        self._fresh: dict[str, float] = {}  # digest -> when its seal returned (its caller pins it then)
        self._swept_roots: frozenset[str] | None = None  # the recipes the last gc saw (None: no gc yet)

    # ---------------------------------------------------------------- use stamps and sizes

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

    # ---------------------------------------------------------------- where artifacts live; memory images

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

    @staticmethod
    def required_drives(image_dir: Path) -> dict[str, dict]:
        """The drives a memory image needs: role -> {"path", "digest"} (empty for non-VM images)."""
        try:
            return dict(json.loads((image_dir / REQUIRES_FILE).read_text()).get("drives") or {})
        except (OSError, ValueError):
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

    # ---------------------------------------------------------------- helpers

    def _tmp_dir(self) -> Path:
        d = self.root / "cache" / ".tmp"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def _store_is_mine(self) -> bool:
        """The snapshot store is a directory inside this node's data dir (the single-node default):
        it can hold a recipe whose pages are in this node's page store."""
        if not isinstance(self.store, LocalSnapshotStore):
            return False
        return self.store.root.resolve().is_relative_to(self.root.resolve())
