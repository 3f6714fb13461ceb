"""The snapshot catalog: snapshots by id or name, for a team, across nodes.

The snapshot store's manifests are the truth (other nodes may add or delete snapshots); the state
store's snapshot table is this node's cache of them. Committing a capture as a snapshot publishes
its blobs, then the manifest (last: nothing half-published is ever visible).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from agentenv.errors import NotFound, Unavailable
from agentenv.models import SandboxRecord, SnapshotRecord
from agentenv.orchestrator.ids import new_snapshot_id
from agentenv.storage.artifacts import ArtifactCache

log = logging.getLogger("agentenv.orchestrator")


class SnapshotCatalog:
    def __init__(self, store, artifacts: ArtifactCache, gc_artifacts: Callable[[], Awaitable[object]]) -> None:
        self.store = store
        self.artifacts = artifacts
        self._gc_artifacts = gc_artifacts

    async def find(self, id_or_name: str, team_id: str | None) -> SnapshotRecord | None:
        """The snapshot store's manifest is the truth (other nodes may have deleted or added one);
        the local catalog is only a cache of it."""
        snap = await self.store.get_snapshot(id_or_name)
        if snap is not None and await self.artifacts.store.get_manifest(snap.snapshot_id) is None:
            log.info("snapshot %s was deleted from the store elsewhere; dropping it here", snap.snapshot_id)
            await self.store.delete_snapshot(snap.snapshot_id)
            snap = None
        if snap is None:
            snap = await self.artifacts.find_manifest(id_or_name)
            if snap is not None:
                await self.store.put_snapshot(snap)  # catalog it on this node
        if snap is not None and team_id is not None and snap.team_id != team_id:
            return None
        return snap

    async def list(self, *, team_id: str, sandbox_id: str | None = None,
                   name: str | None = None) -> list[SnapshotRecord]:
        by_id: dict[str, SnapshotRecord] = {}
        for m in await self.artifacts.store.list_manifests():
            s = SnapshotRecord.from_manifest(m)
            if s.team_id == team_id:
                by_id[s.snapshot_id] = s
        for s in await self.store.list_snapshots(team_id=team_id):
            if s.snapshot_id not in by_id:  # deleted from the store by another node
                await self.store.delete_snapshot(s.snapshot_id)
        out = [s for s in by_id.values()
               if (sandbox_id is None or s.source_sandbox_id == sandbox_id)
               and (name is None or name == s.snapshot_id or name in s.names)]
        return sorted(out, key=lambda s: (s.created_at, s.snapshot_id))

    async def get(self, snapshot_id_or_name: str, *, team_id: str) -> SnapshotRecord:
        snap = await self.find(snapshot_id_or_name, team_id)
        if snap is None:
            raise NotFound(f"snapshot '{snapshot_id_or_name}' not found")
        return snap

    async def delete(self, snapshot_id_or_name: str, *, team_id: str) -> None:
        snap = await self.get(snapshot_id_or_name, team_id=team_id)
        await self.artifacts.delete_from_store(snap)  # its blobs: the store's GC (shared layers stay)
        await self.store.delete_snapshot(snap.snapshot_id)
        await self._gc_artifacts()
        log.info("deleted snapshot %s", snap.snapshot_id)

    async def commit(self, rec: SandboxRecord, mem: str, *, name: str | None, memory: bool,
                     checkpoint: tuple[str | None, list[str], dict[str, str]] | None = None) -> SnapshotRecord:
        """A captured sandbox (its layers in `rec`, its memory image `mem`) as a published snapshot.

        `checkpoint`: (parent id, ancestors nearest first, metadata) makes it a checkpoint."""
        sandbox_id = rec.sandbox_id
        size = sum(self.artifacts.local.blob_path("layers", d).stat().st_size for d in rec.layers)
        if memory:
            size += self.artifacts.memory_size(mem)
        snap = SnapshotRecord(
            snapshot_id=new_snapshot_id(), team_id=rec.team_id, names=[name] if name else [],
            source_sandbox_id=sandbox_id, template_id=rec.template_id, image=rec.image,
            layers=list(rec.layers), memory_digest=mem if memory else None, cpu_count=rec.cpu_count,
            memory_mb=rec.memory_mb, disk_mb=rec.disk_mb, env_vars=dict(rec.env_vars),
            metadata=dict(rec.metadata), size_bytes=size, restore_token=rec.envd_access_token,
            network={"allow_internet_access": rec.allow_internet_access, "network": rec.network},
            runtime=rec.runtime)
        if checkpoint is not None:
            snap.kind, snap.parent_id, snap.ancestors, snap.metadata = "checkpoint", *checkpoint
        try:
            await self.artifacts.publish(snap)
        except Exception as e:  # noqa: BLE001 - the manifest goes last: nothing half-published is visible
            log.error("publishing snapshot of %s failed: %s", sandbox_id, e)
            raise Unavailable(f"Snapshot of sandbox {sandbox_id} was not taken: the snapshot store is "
                              f"unreachable ({e}); the sandbox keeps running",
                              error_code="snapshot_store_unavailable", headers={"Retry-After": "5"}) from e
        await self.store.put_snapshot(snap)
        return snap
