"""Snapshot stores: where committed snapshots (layers + memory image + manifest) persist.

The seam is `SnapshotStore`, in the style of httpx transports: a small interface with two real
implementations — a local/POSIX directory (the embedded default; a shared filesystem in a cluster)
and any S3-compatible object store. Blobs are content-addressed (`<kind>/<sha256>`), so a layer
shared by many snapshots is stored once. A snapshot becomes visible only when its manifest is
written, and the manifest is written last: a reader never sees a snapshot whose blobs are missing,
and a failed upload leaves at most unreferenced blobs (removed by GC), never a half snapshot.

For the store's garbage collection (`storage/storegc.py`) every blob carries the time it was last
written: `put_blob` of a blob the store already has *touches* it (a fresh modification time), so
a publish that reuses an old blob makes it as young as a new upload, and GC's grace period covers both.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

BLOB_KINDS = ("layers", "memory", "drives", "requires", "pages", "pagemaps")
# drives: read-only VM drives memory images need; requires: for each published memory image, the
# drives it needs (its requires.json), so GC knows which drives are still referenced without
# downloading the memory images. pages: packs of deduplicated 4 KiB memory pages, named by the node
# that wrote them; pagemaps: for each memory image stored as a recipe of pages, the packs it needs
# (`pagestore.py`).


@dataclass(frozen=True)
class BlobInfo:
    kind: str
    digest: str
    size: int
    modified: float  # epoch seconds of its last write (upload or touch)


class SnapshotStore(Protocol):
    name: str

    async def has_blob(self, kind: str, digest: str) -> bool: ...
    async def put_blob(self, kind: str, digest: str, src: Path) -> None:
        """Store `src` under its digest; idempotent (an existing blob is touched); atomic for readers."""

    async def touch_blob(self, kind: str, digest: str) -> bool:
        """Mark an existing blob as just published (GC's grace period counts from now); False if
        the store does not have it."""

    async def get_blob(self, kind: str, digest: str, dst: Path) -> None:
        """Download to `dst` (atomically: a partial download never appears at `dst`)."""

    async def delete_blob(self, kind: str, digest: str) -> None: ...
    async def list_blobs(self, kind: str) -> list[str]: ...
    async def list_blob_info(self, kind: str) -> list[BlobInfo]: ...
    async def blob_info(self, kind: str, digest: str) -> BlobInfo | None: ...
    async def put_manifest(self, snapshot_id: str, manifest: dict) -> None: ...
    async def get_manifest(self, snapshot_id: str) -> dict | None: ...
    async def list_manifests(self) -> list[dict]: ...
    async def delete_manifest(self, snapshot_id: str) -> None: ...


async def put_record(store: SnapshotStore, kind: str, name: str, record: dict) -> None:
    """Store a small JSON blob (`requires`, `pagemaps`) under `name`."""
    with tempfile.TemporaryDirectory(prefix="agentenv-record-") as d:
        src = Path(d) / "record.json"
        src.write_text(json.dumps(record, sort_keys=True))
        await store.put_blob(kind, name, src)


async def get_record(store: SnapshotStore, kind: str, name: str) -> dict | None:
    """A small JSON blob, parsed; None if the store has none under `name`."""
    if await store.blob_info(kind, name) is None:
        return None
    with tempfile.TemporaryDirectory(prefix="agentenv-record-") as d:
        dst = Path(d) / "record.json"
        await store.get_blob(kind, name, dst)
        return json.loads(dst.read_text())


def download_temp(dst: Path) -> Path:
    """Where `get_blob` writes before its rename onto `dst`: hidden (no listing of blobs sees it,
    so a GC cannot take it for a blob nothing uses) and unique (concurrent downloads of one blob
    do not share it)."""
    return dst.with_name(f".tmp-get-{dst.name}-{secrets.token_hex(4)}")


def _check_kind(kind: str) -> None:
    if kind not in BLOB_KINDS:
        raise ValueError(f"unknown blob kind {kind!r}")


def _check_name(name: str) -> None:
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"invalid object name {name!r}")


class LocalSnapshotStore:
    """A directory: `<root>/{layers,memory}/<sha256>` and `<root>/manifests/<id>.json`."""

    name = "local"

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def blob_path(self, kind: str, digest: str) -> Path:
        """Where a blob lives in this directory (whether or not it exists yet)."""
        _check_kind(kind)
        _check_name(digest)
        return self.root / kind / digest

    async def has_blob(self, kind: str, digest: str) -> bool:
        return self.blob_path(kind, digest).exists()

    async def touch_blob(self, kind: str, digest: str) -> bool:
        try:
            os.utime(self.blob_path(kind, digest))
            return True
        except FileNotFoundError:
            return False

    async def put_blob(self, kind: str, digest: str, src: Path) -> None:
        dst = self.blob_path(kind, digest)
        if await self.touch_blob(kind, digest):  # already here: GC's grace period counts from this publish
            return
        dst.parent.mkdir(parents=True, exist_ok=True)

        def copy() -> None:
            fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=".tmp-")
            os.close(fd)
            try:
                try:
                    os.link(src, dst)  # same filesystem: free
                    os.utime(dst)  # the link keeps the source's (maybe old) mtime
                    os.unlink(tmp)
                    return
                except FileExistsError:
                    os.unlink(tmp)
                    return
                except OSError:
                    pass
                shutil.copyfile(src, tmp)
                with open(tmp, "rb") as f:
                    os.fsync(f.fileno())
                os.replace(tmp, dst)
            except BaseException:
                if os.path.exists(tmp):
                    os.unlink(tmp)
                raise

        await asyncio.to_thread(copy)

    async def get_blob(self, kind: str, digest: str, dst: Path) -> None:
        src = self.blob_path(kind, digest)
        if not src.exists():
            raise FileNotFoundError(f"{kind}/{digest} not in the snapshot store")

        def copy() -> None:
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = download_temp(dst)
            try:
                try:
                    os.link(src, tmp)
                except OSError:
                    shutil.copyfile(src, tmp)
                os.replace(tmp, dst)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise

        await asyncio.to_thread(copy)

    async def delete_blob(self, kind: str, digest: str) -> None:
        try:
            self.blob_path(kind, digest).unlink()
        except FileNotFoundError:
            pass

    def remove_stale_temps(self, older_than_s: float = 3600.0) -> int:
        """Remove the temporary files of puts and gets a dead process left (`.tmp-*`, untouched for
        `older_than_s`: one being written has a fresh mtime). Returns how many."""
        cutoff, n = time.time() - older_than_s, 0
        for kind in BLOB_KINDS:
            d = self.root / kind
            for tmp in d.glob(".tmp-*") if d.is_dir() else ():
                try:
                    if tmp.stat().st_mtime < cutoff:
                        tmp.unlink()
                        n += 1
                except FileNotFoundError:
                    pass
        return n

    async def list_blobs(self, kind: str) -> list[str]:
        d = self.root / kind
        return sorted(p.name for p in d.iterdir() if not p.name.startswith(".")) if d.exists() else []

    async def list_blob_info(self, kind: str) -> list[BlobInfo]:
        out = []
        for digest in await self.list_blobs(kind):
            info = await self.blob_info(kind, digest)
            if info is not None:
                out.append(info)
        return out

    async def blob_info(self, kind: str, digest: str) -> BlobInfo | None:
        try:
            st = self.blob_path(kind, digest).stat()
        except FileNotFoundError:
            return None
        return BlobInfo(kind, digest, st.st_size, st.st_mtime)

    def _manifest(self, snapshot_id: str) -> Path:
        _check_name(snapshot_id)
        return self.root / "manifests" / f"{snapshot_id}.json"

    async def put_manifest(self, snapshot_id: str, manifest: dict) -> None:
        p = self._manifest(snapshot_id)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.tmp")
        tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
        os.replace(tmp, p)

    async def get_manifest(self, snapshot_id: str) -> dict | None:
        try:
            return json.loads(self._manifest(snapshot_id).read_text())
        except (FileNotFoundError, ValueError):
            return None

    async def list_manifests(self) -> list[dict]:
        d = self.root / "manifests"
        out = []
        for p in sorted(d.glob("*.json")) if d.exists() else []:
            try:
                out.append(json.loads(p.read_text()))
            except ValueError:
                continue
        return out

    async def delete_manifest(self, snapshot_id: str) -> None:
        try:
            self._manifest(snapshot_id).unlink()
        except FileNotFoundError:
            pass


class S3SnapshotStore:
    """Any S3-compatible object store (AWS S3, MinIO, Ceph RGW, rclone serve s3, ...), via boto3.

    boto3's managed transfers give multipart uploads and retries; calls run in worker threads so
    the event loop never blocks. Object metadata is not relied upon (some S3 servers drop it):
    everything a reader needs is in the manifest object, which is uploaded last.
    """

    name = "s3"

    def __init__(self, *, bucket: str, prefix: str = "agentenv/", endpoint_url: str | None = None,
                 access_key: str | None = None, secret_key: str | None = None, region: str = "us-east-1",
                 touch_after_s: float = 0.0) -> None:
        import boto3
        from botocore.config import Config

        # A reused blob written less than this long ago is not touched (an S3 copy costs a read and
        # write of the object on some servers): safe while a publish takes less than the GC grace
        # period minus this (storegc.py); store_from_settings uses a quarter of the grace period.
        self.touch_after_s = touch_after_s
        self.bucket = bucket
        self.prefix = prefix if (not prefix or prefix.endswith("/")) else prefix + "/"
        self._s3 = boto3.client(
            "s3", endpoint_url=endpoint_url, aws_access_key_id=access_key, aws_secret_access_key=secret_key,
            region_name=region,
            config=Config(signature_version="s3v4", s3={"addressing_style": "path"},
                          retries={"max_attempts": 5, "mode": "standard"}))

    def _key(self, kind: str, name: str) -> str:
        _check_name(name)
        return f"{self.prefix}{kind}/{name}"

    async def _call(self, fn, *a, **kw):
        return await asyncio.to_thread(fn, *a, **kw)

    async def ensure_bucket(self) -> None:
        from botocore.exceptions import ClientError

        try:
            await self._call(self._s3.head_bucket, Bucket=self.bucket)
        except ClientError:
            try:
                await self._call(self._s3.create_bucket, Bucket=self.bucket)
            except ClientError as e:  # several nodes starting at once: another one created it
                if e.response.get("Error", {}).get("Code") not in ("BucketAlreadyExists", "BucketAlreadyOwnedByYou"):
                    raise

    async def _exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            await self._call(self._s3.head_object, Bucket=self.bucket, Key=key)
            return True
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise

    async def has_blob(self, kind: str, digest: str) -> bool:
        _check_kind(kind)
        return await self._exists(self._key(kind, digest))

    async def touch_blob(self, kind: str, digest: str) -> bool:
        _check_kind(kind)
        info = await self.blob_info(kind, digest)
        return info is not None and (info.modified > time.time() - self.touch_after_s
                                     or await self._touch(self._key(kind, digest)))

    async def put_blob(self, kind: str, digest: str, src: Path) -> None:
        if await self.touch_blob(kind, digest):
            return
        await self._call(self._s3.upload_file, str(src), self.bucket, self._key(kind, digest))

    async def _touch(self, key: str) -> bool:
        """Give an existing object a fresh LastModified (a copy onto itself); False if it is gone
        (collected meanwhile) or cannot be copied in one call (> 5 GiB): the caller uploads it."""
        from botocore.exceptions import ClientError

        try:
            await self._call(self._s3.copy_object, Bucket=self.bucket, Key=key,
                             CopySource={"Bucket": self.bucket, "Key": key},
                             MetadataDirective="REPLACE", Metadata={"touched": str(int(time.time()))})
            return True
        except ClientError:
            return False

    async def get_blob(self, kind: str, digest: str, dst: Path) -> None:
        _check_kind(kind)
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = download_temp(dst)
        try:
            await self._call(self._s3.download_file, self.bucket, self._key(kind, digest), str(tmp))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, dst)

    async def delete_blob(self, kind: str, digest: str) -> None:
        _check_kind(kind)
        await self._call(self._s3.delete_object, Bucket=self.bucket, Key=self._key(kind, digest))

    async def _list(self, prefix: str) -> list[str]:
        return [o["Key"] for o in await self._list_objects(prefix)]

    async def _list_objects(self, prefix: str) -> list[dict]:
        from botocore.exceptions import ClientError

        objs: list[dict] = []
        token = None
        while True:
            kw = {"Bucket": self.bucket, "Prefix": prefix}
            if token:
                kw["ContinuationToken"] = token
            try:
                resp = await self._call(self._s3.list_objects_v2, **kw)
            except ClientError as e:  # no node created the bucket yet: nothing in it
                if e.response.get("Error", {}).get("Code") == "NoSuchBucket":
                    return []
                raise
            objs += resp.get("Contents", [])
            if not resp.get("IsTruncated"):
                return objs
            token = resp.get("NextContinuationToken")

    async def list_blobs(self, kind: str) -> list[str]:
        return [b.digest for b in await self.list_blob_info(kind)]

    async def list_blob_info(self, kind: str) -> list[BlobInfo]:
        _check_kind(kind)
        base = f"{self.prefix}{kind}/"
        return sorted((BlobInfo(kind, o["Key"][len(base):], int(o.get("Size", 0)), o["LastModified"].timestamp())
                       for o in await self._list_objects(base)), key=lambda b: b.digest)

    async def blob_info(self, kind: str, digest: str) -> BlobInfo | None:
        from botocore.exceptions import ClientError

        _check_kind(kind)
        try:
            h = await self._call(self._s3.head_object, Bucket=self.bucket, Key=self._key(kind, digest))
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
        return BlobInfo(kind, digest, int(h.get("ContentLength", 0)), h["LastModified"].timestamp())

    async def put_manifest(self, snapshot_id: str, manifest: dict) -> None:
        body = json.dumps(manifest, indent=1, sort_keys=True).encode()
        await self._call(self._s3.put_object, Bucket=self.bucket, Key=self._key("manifests", f"{snapshot_id}.json"),
                         Body=body, ContentType="application/json")

    async def get_manifest(self, snapshot_id: str) -> dict | None:
        from botocore.exceptions import ClientError

        try:
            resp = await self._call(self._s3.get_object, Bucket=self.bucket,
                                    Key=self._key("manifests", f"{snapshot_id}.json"))
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
        data = await asyncio.to_thread(resp["Body"].read)
        return json.loads(data)

    async def list_manifests(self) -> list[dict]:
        out = []
        for key in await self._list(f"{self.prefix}manifests/"):
            sid = key.rsplit("/", 1)[-1].removesuffix(".json")
            m = await self.get_manifest(sid)
            if m is not None:
                out.append(m)
        return out

    async def delete_manifest(self, snapshot_id: str) -> None:
        await self._call(self._s3.delete_object, Bucket=self.bucket,
                         Key=self._key("manifests", f"{snapshot_id}.json"))


def store_from_settings(settings) -> SnapshotStore:
    """`snapshot_store` = "local" (default: <data_dir>/snapshots or snapshot_dir) or "s3"."""
    kind = getattr(settings, "snapshot_store", "local")
    if kind == "s3":
        if not settings.s3_bucket:
            raise ValueError("snapshot_store=s3 needs AGENTENV_S3_BUCKET")
        return S3SnapshotStore(bucket=settings.s3_bucket, prefix=settings.s3_prefix, endpoint_url=settings.s3_endpoint,
                               access_key=settings.s3_access_key, secret_key=settings.s3_secret_key,
                               region=settings.s3_region, touch_after_s=settings.store_gc_grace_s / 4)
    if kind == "local":
        return LocalSnapshotStore(Path(settings.snapshot_dir) if settings.snapshot_dir else settings.paths.snapshots)
    raise ValueError(f"unknown snapshot_store {kind!r} (local, s3)")
