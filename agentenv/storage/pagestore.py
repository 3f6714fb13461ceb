"""Deduplicated memory images: 4 KiB pages, content-addressed, appended to shared pack files.

A runtime checkpoint image (runsc: `pages.img` plus a few small files) of a sandbox that changed a
little since its last checkpoint holds almost all of the parent's pages, but in another order
(runsc writes them in a different order each time): ~98% of the 4 KiB pages recur, only ~half of
the 64 KiB blocks. So an image is stored as a *recipe*: for every file, its size, mode and the list
of its pages' digests (blake2b, 16 bytes); pages not stored yet are appended to a new pack file.
Rebuilding the image (`materialize`) reads the pages back in the recipe's order.

On disk, under `<data>/pages/`:
- `packs/<id>.pack`: pages, 4 KiB each, back to back; `packs/<id>.idx`: their digests in order.
  A pack is valid once its index exists: both are written to temporary names, fsynced and renamed,
  pack first. A pack without an index (a crash mid-seal) is removed the next time the store opens.
- recipes are written by the caller's path (`seal(..., recipe_path)`), after the packs they need
  are durable, by rename: a crash mid-seal leaves the old state or a complete recipe.

Snapshot stores that are not the node's own directory (S3 in a cluster) receive the packs a
recipe's pages live in, as blobs of kind `pages` under the pack's name (a pack never changes once
written), and the list of them as a `pagemaps` blob named after the recipe. A node that pulls the
recipe downloads the packs it lacks (`adopt`: the index is rebuilt by hashing the pages, so a page
that arrived damaged is simply absent and the rebuild fails with its name). Checkpoints of one
lineage share packs, so a store holds each page about once too.

Garbage collection (`sweep`) is mark-and-sweep over the recipes that exist: packs with no live page
are deleted; packs whose live fraction fell below half are compacted (their live pages copied to a
new pack, durable before the old packs go). All of it runs under one lock with seals and rebuilds,
so a seal never deduplicates against a page a concurrent sweep is removing.
"""

from __future__ import annotations

import base64
import hashlib
import json
import mmap
import os
import re
import secrets
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

PAGE = 4096
DIGEST = 16
RECIPE_KEY = "agentenv-memory-recipe"
RECIPE_PREFIX = b'{"' + RECIPE_KEY.encode() + b'"'
ZERO_PAGE = bytes(PAGE)
ZERO = hashlib.blake2b(ZERO_PAGE, digest_size=DIGEST).digest()  # never stored: a hole on rebuild
COMPACT_BELOW = 0.5  # a pack whose live fraction drops below this is rewritten
PACK_NAME = re.compile(r"[0-9a-z][0-9a-z-]{0,79}")  # `_PackWriter` names: <time_ns hex>-<8 hex>


def is_recipe(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(RECIPE_PREFIX)) == RECIPE_PREFIX
    except OSError:
        return False


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, data: bytes) -> None:
    """Write `data` to `path` by temporary file + fsync + rename + directory fsync."""
    tmp = path.with_name(f".tmp-{path.name}-{secrets.token_hex(4)}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


@dataclass
class Recipe:
    files: list[dict]  # {"path", "mode", "size", "digests": bytes}

    @staticmethod
    def load(path: Path) -> "Recipe":
        raw = json.loads(path.read_bytes())
        if raw.get(RECIPE_KEY) != 1:
            raise ValueError(f"{path} is not a memory recipe of a known version")
        return Recipe([{**f, "digests": zlib.decompress(base64.b64decode(f["pages"]))} for f in raw["files"]])

    def dumps(self) -> bytes:
        files = [{"path": f["path"], "mode": f["mode"], "size": f["size"],
                  "pages": base64.b64encode(zlib.compress(bytes(f["digests"]), 1)).decode()} for f in self.files]
        return json.dumps({RECIPE_KEY: 1, "page": PAGE, "files": files}, separators=(",", ":")).encode()

    @property
    def size(self) -> int:
        return sum(f["size"] for f in self.files)

    def digests(self):
        for f in self.files:
            d = f["digests"]
            for i in range(0, len(d), DIGEST):
                yield d[i:i + DIGEST]


class _PackWriter:
    """A new pack being written: pages appended, made durable (pack, then index) by `commit`."""

    def __init__(self, packs: Path) -> None:
        self.packs = packs
        self.name = f"{time.time_ns():x}-{secrets.token_hex(4)}"
        self.tmp = packs / f".tmp-{self.name}.pack"
        self.f = open(self.tmp, "wb")
        self.index = bytearray()
        self.count = 0

    def add(self, digest: bytes, page) -> int:
        self.f.write(page)
        self.index += digest
        self.count += 1
        return self.count - 1

    def commit(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.tmp, self.packs / f"{self.name}.pack")
        _write_durably(self.packs / f"{self.name}.idx", bytes(self.index))

    def abort(self) -> None:
        self.f.close()
        self.tmp.unlink(missing_ok=True)


class PageStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.packs = self.root / "packs"
        self._index: dict[bytes, tuple[str, int]] | None = None  # digest -> (pack, page number)
        self._lock = threading.Lock()  # seals, rebuilds and sweeps run in threads, one at a time

    # ---------------------------------------------------------------- the index

    def _loaded(self) -> dict[bytes, tuple[str, int]]:
        if self._index is not None:
            return self._index
        self.packs.mkdir(parents=True, exist_ok=True)
        index: dict[bytes, tuple[str, int]] = {}
        names = {p.name for p in self.packs.iterdir()}
        for name in sorted(names):
            if name.startswith(".tmp-"):
                (self.packs / name).unlink(missing_ok=True)  # a crash mid-write
            elif name.endswith(".pack") and name[:-5] + ".idx" not in names:
                (self.packs / name).unlink(missing_ok=True)  # a crash before its index: nothing uses it
            elif name.endswith(".idx"):
                stem = name[:-4]
                if stem + ".pack" not in names:
                    (self.packs / name).unlink(missing_ok=True)
                    continue
                for n, digest in _digests((self.packs / name).read_bytes()):
                    index.setdefault(digest, (stem, n))
        self._index = index
        return index

    def stored_bytes(self) -> int:
        """Bytes the packs take on disk."""
        if not self.packs.exists():
            return 0
        return sum(p.stat().st_blocks * 512 for p in self.packs.iterdir() if p.name.endswith(".pack"))

    # ---------------------------------------------------------------- sealing

    def seal(self, src: Path, recipe_path_of) -> tuple[str, Recipe, int]:
        """Store the pages of every file under `src` not stored yet, then write the recipe durably at
        `recipe_path_of(digest)` (digest: sha256 of the recipe). Returns (digest, recipe, new bytes)."""
        with self._lock:
            index = self._loaded()
            writer = _PackWriter(self.packs)
            fresh: dict[bytes, tuple[str, int]] = {}
            try:
                files = [self._seal_file(src, rel, index, fresh, writer) for rel in _files(src)]
                if writer.count:
                    writer.commit()
                else:
                    writer.abort()
            except BaseException:
                writer.abort()
                raise
            index.update(fresh)
            recipe = Recipe(files)
            data = recipe.dumps()
            digest = hashlib.sha256(data).hexdigest()
            path = recipe_path_of(digest)
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.exists():
                _write_durably(path, data)
            return digest, recipe, writer.count * PAGE

    @staticmethod
    def _seal_file(src: Path, rel: str, index: dict, fresh: dict, writer: _PackWriter) -> dict:
        path = src / rel
        st = path.stat()
        digests = bytearray()
        blake2b = hashlib.blake2b
        with open(path, "rb") as f:
            for page in _pages(f):
                if page == ZERO_PAGE:
                    digests += ZERO
                    continue
                d = blake2b(page, digest_size=DIGEST).digest()
                digests += d
                if d not in index and d not in fresh:
                    fresh[d] = (writer.name, writer.add(d, page))
        return {"path": rel, "mode": st.st_mode & 0o7777, "size": st.st_size, "digests": bytes(digests)}

    # ---------------------------------------------------------------- rebuilding

    def materialize(self, recipe: Recipe, dst: Path) -> None:
        """Write the image `recipe` describes into the (new, empty) directory `dst`."""
        with self._lock:
            index = self._loaded()
            maps: dict[str, mmap.mmap] = {}
            try:
                for f in recipe.files:
                    self._write_file(f, dst / f["path"], index, maps)
            finally:
                for m in maps.values():
                    m.close()

    def _write_file(self, f: dict, out: Path, index: dict, maps: dict) -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, f["mode"])
        try:
            parts: list = []
            start = pos = 0
            d = f["digests"]
            for i in range(0, len(d), DIGEST):
                digest = d[i:i + DIGEST]
                if digest == ZERO:
                    if parts:
                        os.pwrite(fd, b"".join(parts), start)
                        parts = []
                    pos += PAGE
                    start = pos
                    continue
                try:
                    pack, n = index[digest]
                except KeyError:
                    raise FileNotFoundError(f"page {digest.hex()} of {f['path']} is missing from the page store") \
                        from None
                m = maps.get(pack)
                if m is None:
                    with open(self.packs / f"{pack}.pack", "rb") as pf:
                        m = maps[pack] = mmap.mmap(pf.fileno(), 0, access=mmap.ACCESS_READ)
                parts.append(m[n * PAGE:(n + 1) * PAGE])
                pos += PAGE
                if len(parts) >= 256:
                    os.pwrite(fd, b"".join(parts), start)
                    parts, start = [], pos
            if parts:
                os.pwrite(fd, b"".join(parts), start)
            os.ftruncate(fd, f["size"])
            os.fchmod(fd, f["mode"])
        finally:
            os.close(fd)

    # ---------------------------------------------------------------- packs to and from a snapshot store

    def _packs_of(self, recipe: Recipe, index: dict) -> set[str]:
        names: set[str] = set()
        for d in recipe.digests():
            if d != ZERO:
                try:
                    names.add(index[d][0])
                except KeyError:
                    raise FileNotFoundError(f"page {d.hex()} is missing from the page store") from None
        return names

    def link_packs(self, recipe: Recipe, into: Path) -> list[tuple[str, Path]]:
        """The packs holding `recipe`'s pages, hard-linked into `into` (same file system) under the
        lock, so a sweep that compacts them meanwhile cannot pull them from under an upload."""
        with self._lock:
            out = []
            for name in sorted(self._packs_of(recipe, self._loaded())):
                dst = into / f"{name}.pack"
                os.link(self.packs / f"{name}.pack", dst)
                out.append((name, dst))
            return out

    def lacks(self, recipe: Recipe) -> bool:
        """Some page of `recipe` is not stored here (it came from another node)."""
        with self._lock:
            index = self._loaded()
            return any(d != ZERO and d not in index for d in recipe.digests())

    def has_pack(self, name: str) -> bool:
        return (self.packs / f"{name}.idx").exists()

    def download_path(self, name: str) -> Path:
        """Where a pack being downloaded goes (removed by the next open if the process dies)."""
        if not PACK_NAME.fullmatch(name):
            raise ValueError(f"invalid pack name {name!r}")
        with self._lock:
            self._loaded()  # its first load clears leftover temporary files: not this download's
        return self.packs / f".tmp-pull-{name}-{secrets.token_hex(4)}.pack"  # two pulls of one pack: two files

    def adopt(self, name: str, downloaded: Path) -> int:
        """Make a pack downloaded to `download_path(name)` part of this store (pages, then index,
        durably); returns its pages. Its index is rebuilt by hashing its pages."""
        size = downloaded.stat().st_size
        if size % PAGE:
            downloaded.unlink(missing_ok=True)
            raise ValueError(f"pack {name} is {size} bytes, not whole {PAGE}-byte pages")
        index_bytes = bytearray()
        blake2b = hashlib.blake2b
        with open(downloaded, "rb") as f:
            for page in _pages(f):
                index_bytes += blake2b(page, digest_size=DIGEST).digest()
            os.fsync(f.fileno())
        with self._lock:
            index = self._loaded()
            if self.has_pack(name):  # pulled meanwhile (or this node's own)
                downloaded.unlink(missing_ok=True)
                return 0
            os.replace(downloaded, self.packs / f"{name}.pack")
            _write_durably(self.packs / f"{name}.idx", bytes(index_bytes))
            for n, digest in _digests(bytes(index_bytes)):
                index.setdefault(digest, (name, n))
            return len(index_bytes) // DIGEST

    # ---------------------------------------------------------------- garbage collection

    def sweep(self, recipe_files) -> dict[str, int]:
        """Reclaim pages no recipe among `recipe_files` (a callable listing them, called under the
        lock) uses: delete dead packs, compact packs less than half live. Returns counts and bytes."""
        with self._lock:
            index = self._loaded()
            live: set[bytes] = set()
            for path in recipe_files():
                try:
                    live.update(Recipe.load(path).digests())
                except FileNotFoundError:
                    continue
            members: dict[str, list[bytes]] = {p.name[:-4]: [] for p in self.packs.glob("*.idx")}
            for digest, (pack, _n) in index.items():
                members.setdefault(pack, []).append(digest)
            stats = {"packs_deleted": 0, "packs_compacted": 0, "bytes_reclaimed": 0}
            before = self.stored_bytes()
            dead, sparse = [], []
            for pack, digests in members.items():
                n_live = sum(1 for d in digests if d in live)
                total = (self.packs / f"{pack}.idx").stat().st_size // DIGEST
                if n_live == 0:
                    dead.append(pack)
                elif n_live < COMPACT_BELOW * total:
                    sparse.append(pack)
            if sparse:
                self._compact(sparse, index, live)
                stats["packs_compacted"] = len(sparse)
            lost: set[bytes] = set()
            for pack in dead + sparse:
                lost |= self._drop_pack(pack, index, members[pack])
            if lost:
                self._refind(lost, index)
            stats["packs_deleted"] = len(dead)
            stats["bytes_reclaimed"] = max(0, before - self.stored_bytes())
            return stats

    def _compact(self, packs: list[str], index: dict, live: set[bytes]) -> None:
        """Copy the live pages of `packs` into one new durable pack and point the index at it."""
        writer = _PackWriter(self.packs)
        moved: dict[bytes, tuple[str, int]] = {}
        try:
            for pack in packs:
                with open(self.packs / f"{pack}.pack", "rb") as pf:
                    for n, d in _digests((self.packs / f"{pack}.idx").read_bytes()):
                        if d in live and index.get(d) == (pack, n) and d not in moved:
                            moved[d] = (writer.name, writer.add(d, os.pread(pf.fileno(), PAGE, n * PAGE)))
            writer.commit()  # durable before any old pack goes
        except BaseException:
            writer.abort()
            raise
        index.update(moved)

    def _drop_pack(self, pack: str, index: dict, digests: list[bytes]) -> set[bytes]:
        """Delete a pack; returns the digests the index no longer finds (another pack may hold them)."""
        (self.packs / f"{pack}.idx").unlink(missing_ok=True)  # index first: a pack without one is garbage
        (self.packs / f"{pack}.pack").unlink(missing_ok=True)
        lost = set()
        for d in digests:
            if index.get(d, ("",))[0] == pack:
                del index[d]
                lost.add(d)
        return lost

    def _refind(self, lost: set[bytes], index: dict) -> None:
        """Point the index at the packs left that hold pages of a dropped one. A page is indexed once
        (`adopt` of a pulled pack keeps the older entry for a page this node had), so a pack kept here
        may hold a page whose entry went with the pack it pointed to; a node then saw that pack and
        pulled nothing, but could not find the page."""
        for p in sorted(self.packs.glob("*.idx")):
            for n, d in _digests(p.read_bytes()):
                if d in lost and d not in index:
                    index[d] = (p.name[:-4], n)


def _digests(raw: bytes):
    """(page number, digest) for each entry of a pack's `.idx` bytes."""
    for i in range(0, len(raw), DIGEST):
        yield i // DIGEST, raw[i:i + DIGEST]


def _pages(f):
    """The 4 KiB pages of an open file, read 4 MiB at a time (the last page zero-padded)."""
    while chunk := f.read(4 << 20):
        mv = memoryview(chunk)
        for off in range(0, len(chunk), PAGE):
            page = mv[off:off + PAGE]
            yield page if len(page) == PAGE else bytes(page) + bytes(PAGE - len(page))


def _files(src: Path) -> list[str]:
    out = []
    for dirpath, _dirs, names in os.walk(src):
        for name in names:
            p = Path(dirpath) / name
            if p.is_symlink() or not p.is_file():
                raise ValueError(f"memory image {src} holds {p}, which is not a regular file")
            out.append(str(p.relative_to(src)))
    return sorted(out)
