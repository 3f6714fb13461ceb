#!/usr/bin/env python3
"""Snapshot store GC benchmark: `storegc.collect` on a store of N snapshots (directory and S3).

Usage (from the repo):
    .venv/bin/python benchmarks/store_gc_bench.py [--snapshots 500] [--layers 4]

Fills a fresh store (a directory, and a bucket on `rclone serve s3` from tests/s3server.py) with
`--snapshots` manifests, each with `--layers` small layer blobs (a chain: every snapshot shares all
but its top layer with its parent, as checkpoints do) and a memory blob + requires record; then
deletes every other manifest, waits past a 1 s grace period and times a dry run and a real
collection. The blobs are tiny: what is measured is listing, marking, the per-blob check and the
deletes (object count), not bandwidth. Prints one line per store.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from agentenv.storage.snapshots import LocalSnapshotStore, S3SnapshotStore  # noqa: E402
from agentenv.storage.storegc import Roots, collect  # noqa: E402


async def fill(store, tmp: Path, snapshots: int, layers: int) -> list[str]:
    def blob(name: str) -> tuple[Path, str]:
        p = tmp / "b"
        data = f"{name}-{os.urandom(8).hex()}".encode()
        p.write_bytes(data)
        return p, hashlib.sha256(data).hexdigest()

    chain: list[str] = []
    ids = []
    for i in range(snapshots):
        top_path, top = blob(f"layer{i}")
        await store.put_blob("layers", top, top_path)
        chain = ([top] + chain)[:layers]
        mem_path, mem = blob(f"mem{i}")
        req = tmp / "req"
        req.write_text(json.dumps({"drives": []}))
        await store.put_blob("requires", mem, req)
        await store.put_blob("memory", mem, mem_path)
        sid = f"s{i:05d}"
        await store.put_manifest(sid, {"snapshotID": sid, "layers": list(chain), "memory": mem})
        ids.append(sid)
    return ids


async def bench(store, label: str, snapshots: int, layers: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        t0 = time.monotonic()
        ids = await fill(store, Path(d), snapshots, layers)
        fill_s = time.monotonic() - t0
    for sid in ids[::2]:
        await store.delete_manifest(sid)

    async def roots() -> Roots:
        r = Roots()
        for m in await store.list_manifests():
            r.add("manifests", m["layers"], m.get("memory"))
        return r

    await asyncio.sleep(1.5)
    dry = await collect(store, roots, grace_s=1, dry_run=True)
    real = await collect(store, roots, grace_s=1)
    print(f"{label}: {snapshots} snapshots ({real.scanned} blobs, filled in {fill_s:.1f}s), half deleted: "
          f"dry run {dry.seconds:.2f}s, collection {real.seconds:.2f}s removing {len(real.removed)} blobs "
          f"({real.referenced} referenced)")


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--snapshots", type=int, default=500)
    ap.add_argument("--layers", type=int, default=4)
    a = ap.parse_args()
    from s3server import start_s3

    with tempfile.TemporaryDirectory(dir="/var/tmp") as work:
        await bench(LocalSnapshotStore(Path(work) / "dir"), "directory store", a.snapshots, a.layers)
        srv = start_s3(Path(work) / "s3")
        try:
            (srv.root / "bench").mkdir()
            s3 = S3SnapshotStore(bucket="bench", endpoint_url=srv.endpoint, access_key=srv.access_key,
                                 secret_key=srv.secret_key)
            await bench(s3, "S3 (rclone serve s3)", a.snapshots, a.layers)
        finally:
            srv.stop()


if __name__ == "__main__":
    asyncio.run(main())
