"""Time travel: checkpoints of a running sandbox, rollback in place, the checkpoint tree.

A checkpoint is a snapshot with a parent (`SnapshotRecord.kind == "checkpoint"`, `parent_id`,
`ancestors`), taken by the same capture as fork and snapshot (`capture.Capture`), so it does not
stop the sandbox where the runtime can capture a running one. Its parent is the checkpoint the
sandbox's state last came from (`SandboxRecord.checkpoint_id`: the last one taken, rolled back to,
or the snapshot it was created from). Layers and memory images are content-addressed and shared
between checkpoints; deleting one deletes only the blobs no other snapshot references, so its
descendants stay restorable, and the tree skips it (`ancestors` names every ancestor).

Rollback replaces a running sandbox's memory, processes and files with a checkpoint's and keeps
everything that makes it *this* sandbox: id, envd and traffic tokens, network slot and egress rules,
timeout, metadata. Any memory snapshot of the team whose runtime and size match the sandbox's may
be the target (a checkpoint of its own lineage is the usual one).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from agentenv.errors import BadRequest, Conflict, NotFound, Unavailable
from agentenv.models import SandboxRecord, SnapshotRecord
from agentenv.orchestrator import operations as ops
from agentenv.orchestrator.capture import Capture, Captured
from agentenv.orchestrator.catalog import SnapshotCatalog
from agentenv.orchestrator.host import SandboxHost
from agentenv.orchestrator.lifecycle import Lifecycle, check

log = logging.getLogger("agentenv.orchestrator")


def checkpoint_not_found(checkpoint_id: str) -> NotFound:
    return NotFound(f"checkpoint '{checkpoint_id}' not found", error_code="checkpoint_not_found")


class TimeTravel:
    def __init__(self, host: SandboxHost, lifecycle: Lifecycle, captures: Capture, snapshots: SnapshotCatalog,
                 gc_artifacts: Callable[[], Awaitable[Any]]) -> None:
        self.host = host
        self.lifecycle = lifecycle
        self.captures = captures
        self.snapshots = snapshots
        self._gc = gc_artifacts

    # ------------------------------------------------------------------ checkpoint

    async def checkpoint(self, req: ops.CreateCheckpoint) -> SnapshotRecord:
        """Capture the sandbox (it keeps running where the runtime can) and commit it as a checkpoint
        whose parent is the sandbox's last one; the sandbox's head moves to it."""
        sid = req.sandbox_id
        check(self.lifecycle.live(sid, req.team_id).state, "checkpoint", sid)  # 409 at once (paused, busy)

        async def commit(got: Captured) -> SnapshotRecord:
            live = self.lifecycle.live(sid, req.team_id)
            parent = live.checkpoint_id
            ancestors = [parent, *await self._ancestors_of(parent)] if parent else []
            snap = await self.snapshots.commit(got.view, got.memory, name=req.name, memory=True,
                                               checkpoint=(parent, ancestors, dict(req.metadata or {})))
            live.checkpoint_id = snap.snapshot_id
            await self.lifecycle.persist(live)
            return snap

        t0 = time.monotonic()
        got = await self.captures.locked(sid, req.team_id, "checkpoint", then=commit)
        self.captures.release(got)
        snap: SnapshotRecord = got.result
        # the source runs on: a rollback or branch rebuilds the image from its pages
        await self.host.artifacts.drop_extracted(got.memory, lambda: got.memory in self.host.pinned())
        log.info("checkpoint %s of %s (parent %s) in %.3fs, source frozen %s", snap.snapshot_id, sid,
                 snap.parent_id, time.monotonic() - t0,
                 f"{got.frozen_s:.3f}s" if got.frozen_s is not None else "and restarted")
        await self._gc()
        return snap

    async def _ancestors_of(self, checkpoint_id: str) -> list[str]:
        m = await self.host.artifacts.store.get_manifest(checkpoint_id)
        return list((m or {}).get("ancestors") or [])

    # ------------------------------------------------------------------ rollback

    async def rollback(self, req: ops.RollbackSandbox) -> SandboxRecord:
        sid = req.sandbox_id
        rec = self.lifecycle.live(sid, req.team_id)
        check(rec.state, "rollback", sid)  # 409 at once during a capture, not after it
        if self.captures.busy(sid):
            raise Conflict(f"Sandbox {sid} is being captured; roll it back when the capture is done",
                           error_code="sandbox_invalid_state")
        snap = await self.snapshots.find(req.checkpoint_id, req.team_id)
        if snap is None:
            raise checkpoint_not_found(req.checkpoint_id)
        self._check_compatible(rec, snap)
        mem = await self.host.pin_memory(snap.memory_digest)
        try:
            for digest in snap.layers:
                await self.host.artifacts.ensure_layer(digest)
            async with self.lifecycle.lock(sid):
                rec = self.lifecycle.live(sid, req.team_id)
                before, final = self.lifecycle.begin(rec, "rollback")
                t0 = time.monotonic()
                await self._replace(rec, before, snap, mem)
                await self.lifecycle.settle(rec, final)
        finally:
            self.host.unpin(snap.memory_digest)
        # restored: rebuilt from its pages when next needed
        await self.host.artifacts.drop_extracted(snap.memory_digest, lambda: snap.memory_digest in self.host.pinned())
        log.info("rolled %s back to %s in %.3fs", sid, snap.snapshot_id, time.monotonic() - t0)
        await self._gc()
        return replace(rec)

    def _check_compatible(self, rec: SandboxRecord, snap: SnapshotRecord) -> None:
        what = "checkpoint" if snap.kind == "checkpoint" else "snapshot"
        if not snap.memory_digest:
            raise BadRequest(f"{what} {snap.snapshot_id} holds no memory image (filesystem only): a rollback "
                             "needs one", error_code="checkpoint_incompatible")
        runtime = snap.runtime or self.host.runtime.name
        if runtime != rec.runtime or snap.cpu_count != rec.cpu_count or snap.memory_mb != rec.memory_mb:
            raise BadRequest(f"{what} {snap.snapshot_id} was taken of a sandbox of another shape ({runtime}, "
                             f"{snap.cpu_count} vCPU, {snap.memory_mb} MiB); sandbox {rec.sandbox_id} is "
                             f"{rec.runtime}, {rec.cpu_count} vCPU, {rec.memory_mb} MiB",
                             error_code="checkpoint_incompatible")

    async def _replace(self, rec: SandboxRecord, before, snap: SnapshotRecord, mem) -> None:
        """Stop the sandbox, discard its upper, restore the checkpoint in the same slot under the same
        tokens. A stop that fails while it still runs changes nothing (503); a restore that fails
        leaves it paused at the checkpoint (resumable: nothing of the checkpoint is lost)."""
        host = self.host
        sid = rec.sandbox_id
        slot = host.slots[sid]
        rt = host.runtime_for(sid, rec.runtime)
        await host.quiesce(sid)
        try:
            await host.stop(sid, rec.runtime)
        except Exception as e:  # noqa: BLE001
            if await rt.is_alive(sid):
                self.lifecycle.rollback(rec, before)
                raise Unavailable(f"Sandbox {sid} could not be stopped for its rollback ({e}); it runs on "
                                  "unchanged", error_code="rollback_failed", headers={"Retry-After": "5"}) from e
        rec.layers, rec.image, rec.checkpoint_id = list(snap.layers), snap.image, snap.snapshot_id
        try:
            await host.rootfs.release(sid)  # the discarded state: its upper and everything in its dir
            # a server killed from here on finds the sandbox paused at the checkpoint (`Capture.recover`)
            self.captures.journal(rec, memory=snap.memory_digest, rootImage=rec.image, checkpoint=snap.snapshot_id)
            await host.network.deactivate(slot)
            await host.bring_up(rec, restore_from=mem, restore_token=snap.restore_token, slot=slot)
        except Exception as e:  # noqa: BLE001
            raise await self.captures.park(rec, None, snap.memory_digest, e) from e
        finally:
            self.captures.forget_journal(sid)

    # ------------------------------------------------------------------ the tree

    async def list_for(self, req: ops.ListCheckpoints) -> list[SnapshotRecord]:
        """The checkpoints taken of a sandbox, oldest first (also after it was killed)."""
        out = [s for s in await self.snapshots.list(team_id=req.team_id, sandbox_id=req.sandbox_id)
               if s.kind == "checkpoint"]
        if not out:
            self.lifecycle.live(req.sandbox_id, req.team_id)  # 404 for a sandbox that is not ours
        return out

    async def tree(self, req: ops.CheckpointTree) -> tuple[str, list[SnapshotRecord]]:
        """The whole tree `checkpoint_id` belongs to: (root id, its checkpoints, parents first). A
        deleted checkpoint is skipped: its children hang from their nearest remaining ancestor
        (`parent_id` is rewritten to it in the answer)."""
        snaps = {s.snapshot_id: s for s in await self.snapshots.list(team_id=req.team_id)}
        start = snaps.get(req.checkpoint_id)
        if start is None:
            named = [s for s in snaps.values() if req.checkpoint_id in s.names]
            start = named[-1] if named else None
        if start is None:
            raise checkpoint_not_found(req.checkpoint_id)
        parent = {sid: next((a for a in ([s.parent_id] if s.parent_id else []) + s.ancestors if a in snaps), None)
                  for sid, s in snaps.items()}
        root = start.snapshot_id
        while parent.get(root):
            root = parent[root]
        children: dict[str, list[str]] = {}
        for sid, p in parent.items():
            if p is not None:
                children.setdefault(p, []).append(sid)
        out, todo = [], [root]
        while todo:
            sid = todo.pop(0)
            out.append(replace(snaps[sid], parent_id=parent[sid]))
            todo += sorted(children.get(sid, []), key=lambda c: (snaps[c].created_at, c))
        return root, out

