"""Both snapshot stores, driven through the SnapshotStore interface; S3 against a real rclone server."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from agentenv.storage import layers


def _blob(tmp_path: Path, size: int) -> tuple[Path, str]:
    p = tmp_path / f"blob-{size}"
    data = os.urandom(size)
    p.write_bytes(data)
    return p, hashlib.sha256(data).hexdigest()


async def test_blob_roundtrip_and_idempotent_put(store, tmp_path):
    src, digest = _blob(tmp_path, 9 * 1024 * 1024)  # > boto3's multipart threshold (8 MiB)
    assert not await store.has_blob("memory", digest)
    await store.put_blob("memory", digest, src)
    await store.put_blob("memory", digest, src)
    assert await store.has_blob("memory", digest)
    assert await store.list_blobs("memory") == [digest]
    out = tmp_path / "out" / "blob"
    await store.get_blob("memory", digest, out)
    assert hashlib.sha256(out.read_bytes()).hexdigest() == digest
    assert not out.with_name("blob.part").exists()
    await store.delete_blob("memory", digest)
    assert not await store.has_blob("memory", digest)


async def test_manifest_visible_only_after_put(store):
    assert await store.get_manifest("snap1") is None
    assert await store.list_manifests() == []
    await store.put_manifest("snap1", {"snapshotID": "snap1", "layers": ["a"], "names": ["n"]})
    assert (await store.get_manifest("snap1"))["layers"] == ["a"]
    assert [m["snapshotID"] for m in await store.list_manifests()] == ["snap1"]
    await store.delete_manifest("snap1")
    assert await store.get_manifest("snap1") is None


async def test_missing_blob_download_leaves_nothing(store, tmp_path):
    out = tmp_path / "dl" / "x"
    with pytest.raises(Exception):
        await store.get_blob("layers", "0" * 64, out)
    assert not out.exists()
    assert not out.with_name("x.part").exists()


async def test_invalid_names_rejected(store, tmp_path):
    src, _ = _blob(tmp_path, 10)
    for bad in ("../x", "", ".hidden", "a/b"):
        with pytest.raises(ValueError):
            await store.put_blob("layers", bad, src)
    with pytest.raises(ValueError):
        await store.put_blob("nope", "abc", src)


async def test_layer_pack_keeps_whiteouts_xattrs_and_is_content_addressed(tmp_path):
    src = tmp_path / "upper"
    (src / "dir").mkdir(parents=True)
    (src / "dir" / "f.txt").write_text("hello")
    os.chown(src / "dir" / "f.txt", 1000, 1000)
    os.symlink("dir/f.txt", src / "link")
    subprocess.run(["mknod", str(src / "gone"), "c", "0", "0"], check=True)  # overlay whiteout
    os.setxattr(src / "dir", "trusted.overlay.opaque", b"y")
    os.setxattr(src / "dir" / "f.txt", "user.e2b.origin", b"sdk")  # E2B file metadata
    d1, n1 = await layers.pack(src, tmp_path / "a.tar")
    d2, _ = await layers.pack(src, tmp_path / "b.tar")
    assert d1 == d2 and n1 > 0  # deterministic: same content, same digest
    (src / "dir" / "f.txt").write_text("changed")
    d3, _ = await layers.pack(src, tmp_path / "c.tar")
    assert d3 != d1
    dst = tmp_path / "extracted"
    await layers.unpack(tmp_path / "a.tar", dst)
    assert (dst / "dir" / "f.txt").read_text() == "hello"
    assert os.stat(dst / "dir" / "f.txt").st_uid == 1000
    assert os.readlink(dst / "link") == "dir/f.txt"
    st = os.stat(dst / "gone")
    assert os.major(st.st_rdev) == 0 and os.minor(st.st_rdev) == 0
    assert os.getxattr(dst / "dir", "trusted.overlay.opaque") == b"y"
    assert os.getxattr(dst / "dir" / "f.txt", "user.e2b.origin") == b"sdk"


# ---------------------------------------------------------------- garbage collection (storage/storegc.py)


GRACE_S = 2.0  # HTTP dates have whole seconds: blobs are aged by waiting past the grace period


async def _age_everything() -> None:
    await asyncio.sleep(GRACE_S + 1.2)


async def _put(store, tmp_path, kind: str, size: int) -> str:
    src, digest = _blob(tmp_path, size)
    await store.put_blob(kind, digest, src)
    return digest


async def test_gc_removes_exactly_the_unreferenced_blobs_past_the_grace_period(store, tmp_path):
    from agentenv.storage.storegc import Roots, collect

    kept_layer, old_layer = [await _put(store, tmp_path, "layers", n) for n in (100, 200)]
    kept_mem, old_mem = [await _put(store, tmp_path, "memory", n) for n in (400, 500)]
    needed_drive, old_drive = [await _put(store, tmp_path, "drives", n) for n in (600, 700)]
    for mem, drives in ((kept_mem, [needed_drive]), (old_mem, [old_drive])):
        req = tmp_path / f"req-{mem}"
        req.write_text(json.dumps({"drives": drives}))
        await store.put_blob("requires", mem, req)
    await store.put_manifest("s1", {"snapshotID": "s1", "layers": [kept_layer], "memoryDigest": kept_mem})
    await _age_everything()
    young_layer = await _put(store, tmp_path, "layers", 300)

    async def roots() -> Roots:
        r = Roots()
        for m in await store.list_manifests():
            r.add("manifests", m["layers"], m.get("memoryDigest"))
        return r

    dry = await collect(store, roots, grace_s=GRACE_S, dry_run=True)
    assert {(b.kind, b.digest) for b in dry.removed} == {("layers", old_layer), ("memory", old_mem),
                                                         ("drives", old_drive), ("requires", old_mem)}
    assert await store.has_blob("layers", old_layer)  # a dry run removes nothing
    res = await collect(store, roots, grace_s=GRACE_S)
    assert {(b.kind, b.digest) for b in res.removed} == {(b.kind, b.digest) for b in dry.removed}
    assert res.bytes_freed == 200 + 500 + 700 + len(json.dumps({"drives": [old_drive]}))
    assert sorted(await store.list_blobs("layers")) == sorted([kept_layer, young_layer])  # young: grace
    assert await store.list_blobs("memory") == [kept_mem]
    assert await store.list_blobs("drives") == [needed_drive]
    assert await store.list_blobs("requires") == [kept_mem]


async def test_put_of_an_existing_blob_touches_it_so_gc_keeps_it(store, tmp_path):
    """A publish that reuses an old unreferenced blob makes it young again: GC's grace period covers it."""
    from agentenv.storage.storegc import Roots, collect

    src, digest = _blob(tmp_path, 1000)
    await store.put_blob("layers", digest, src)
    other = await _put(store, tmp_path, "layers", 10)
    await _age_everything()
    assert (await store.blob_info("layers", digest)).modified < time.time() - GRACE_S
    await store.put_blob("layers", digest, src)  # the reuse: no upload, a touch
    assert (await store.blob_info("layers", digest)).modified > time.time() - GRACE_S
    res = await collect(store, lambda: _no_roots(Roots), grace_s=GRACE_S)
    assert [b.digest for b in res.removed] == [other] and res.young == 1
    assert await store.list_blobs("layers") == [digest]


async def _no_roots(cls):
    return cls()
