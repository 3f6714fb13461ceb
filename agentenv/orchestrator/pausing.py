"""Pause and resume: a sandbox's memory (unless filesystem-only) and upper kept on disk, its CPU,
memory and network slot released; resume brings it back in a fresh slot.

The upper layer and the checkpoint stay in the sandbox dir, so a paused sandbox survives a server
restart (or kill -9) and resumes with the same processes, PIDs and files. On a cluster node
(`publish`), a pause also seals its upper + memory image into artifacts and uploads them, so any
node can resume it; that image is used once and deleted from the store after the resume.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import Awaitable, Callable
from datetime import timedelta

from agentenv.errors import RuntimeFailure, Unavailable
from agentenv.models import SandboxRecord, SandboxState, utcnow
from agentenv.orchestrator.admission import Admission
from agentenv.orchestrator.capture import Capture
from agentenv.orchestrator.host import SandboxHost
from agentenv.orchestrator.lifecycle import Lifecycle, check

log = logging.getLogger("agentenv.orchestrator")


class PauseResume:
    def __init__(self, host: SandboxHost, lifecycle: Lifecycle, admission: Admission, captures: Capture, *,
                 publish: bool, lose: Callable[[SandboxRecord, Exception], Awaitable[Exception]]) -> None:
        self.host = host
        self.captures = captures  # its journal: a published pause a crash cut short is recovered paused
        self.lifecycle = lifecycle
        self.admission = admission
        self.artifacts = host.artifacts
        self.publish = publish
        self._lose = lose

    async def pause(self, sandbox_id: str, team_id: str | None, memory: bool, *, publish: bool | None = None) -> None:
        """Checkpoint memory (unless filesystem-only) and release CPU, memory and the network slot.

        `publish=False` on a cluster node keeps the pause on this node's disk only (a fenced node
        cannot reach the snapshot store in time); `publish_local` uploads it later."""
        host = self.host
        publish = self.publish if publish is None else publish
        async with self.lifecycle.lock(sandbox_id):
            rec = self.lifecycle.live(sandbox_id, team_id)
            before, final = self.lifecycle.begin(rec, "pause")
            ckpt = host.checkpoint_dir(sandbox_id)
            shutil.rmtree(ckpt, ignore_errors=True)
            try:
                if memory:  # kept on this node: the container goes after the pause has answered
                    await host.checkpoint(rec, ckpt, leave_frozen=not publish)
                else:
                    await host.quiesce(sandbox_id)
                    await host.stop(sandbox_id, rec.runtime)
            except Unavailable:
                self.lifecycle.rollback(rec, before)
                raise
            except Exception as e:  # noqa: BLE001
                raise await self._lose(rec, e) from e
            if publish:
                if memory:  # stopped with its image: a crash until the pause is stored recovers it paused
                    self.captures.journal(rec, image=str(ckpt))
                await host.release_slot(sandbox_id)
                try:
                    await self._publish_paused(rec, memory)
                except Exception as e:  # noqa: BLE001
                    try:
                        await self._unpause_after_failed_publish(rec, e)
                    finally:
                        self.captures.forget_journal(sandbox_id)
            elif memory:
                host.stand_down_later(sandbox_id, rec.runtime)  # stop, release the slot, unmount
            else:  # independent of each other
                await asyncio.gather(host.release_slot(sandbox_id), host.rootfs.unmount(sandbox_id))
            rec.pause_mode = "full" if memory else "filesystem"
            await self.lifecycle.settle(rec, final)
            if publish:  # (a PAUSED record's journal is stale: a restart drops it too)
                self.captures.forget_journal(sandbox_id)
        log.info("paused sandbox %s (%s)", sandbox_id, rec.pause_mode)

    async def _publish_paused(self, rec: SandboxRecord, memory: bool) -> None:
        """Seal the paused sandbox's upper (and checkpoint) into artifacts and upload them."""
        ckpt = self.host.checkpoint_dir(rec.sandbox_id)

        async def layer_sealed(layer: str | None) -> None:
            if layer:  # the upper lives on only as this layer: in the record before the slow part
                rec.layers = [layer] + rec.layers
                if memory:
                    self.captures.journal(rec, image=str(ckpt))

        sealed = await self.host.seal(rec.sandbox_id, ckpt if memory else None, on_layer=layer_sealed)
        if sealed.memory is not None:
            rec.memory_digest = sealed.memory
            self.captures.journal(rec, memory=sealed.memory)  # the image dir is that artifact now
        await self.artifacts.publish_blobs(rec.layers, rec.memory_digest)

    async def publish_local(self, sandbox_id: str, on_sealed=None) -> SandboxRecord | None:
        """Seal and upload a pause taken with `publish=False`, so any node can resume it; the record
        (not persisted: the caller decides when) or None if it is not paused here. Retryable, also
        after a restart: an upper already sealed is gone, a memory image sealed is not sealed again.
        `on_sealed(rec)` runs after each sealing step (the caller records the new digests: the upper
        and the checkpoint now live on only as those artifacts)."""
        async with self.lifecycle.lock(sandbox_id):
            rec = self.lifecycle.get(sandbox_id)
            if rec is None or rec.state != SandboxState.PAUSED:
                return None

            async def layer_sealed(layer: str | None) -> None:
                if layer:
                    rec.layers = [layer] + rec.layers
                if on_sealed is not None:
                    on_sealed(rec)

            if self.host.rootfs.upper_path(sandbox_id).exists():
                await self.host.seal(sandbox_id, None, on_layer=layer_sealed)
            if rec.pause_mode != "filesystem" and not rec.memory_digest:
                rec.memory_digest = await self.artifacts.seal_memory(self.host.checkpoint_dir(sandbox_id))
                if on_sealed is not None:
                    on_sealed(rec)
            await self.artifacts.publish_blobs(rec.layers, rec.memory_digest)
            return rec

    async def _unpause_after_failed_publish(self, rec: SandboxRecord, why: Exception) -> None:
        """Publishing a pause failed (snapshot store down): bring the sandbox back from its local
        image and answer 503; if even that fails it stays paused with its full state on this node."""
        sid = rec.sandbox_id
        log.error("publishing the pause of %s failed (%s); resuming it", sid, why)
        self.lifecycle.mark(rec, SandboxState.PAUSED)
        rec.pause_mode = "full"
        try:
            # its own remaining time (at least 10 s: an expired autoPause sandbox retries the pause)
            await self.resume_admitted(rec, max(10, int((rec.end_at - utcnow()).total_seconds())))
        except Exception as e:  # noqa: BLE001 - `resume_admitted` left it PAUSED with its image
            await self.lifecycle.persist(rec)
            raise RuntimeFailure(f"Sandbox {sid} is paused on this node only (its state could not be "
                                 f"published: {why}; resuming it failed: {e})", error_code="publish_failed") from e
        raise Unavailable(f"Sandbox {sid} was not paused: the snapshot store is unreachable ({why}); "
                          "it keeps running", error_code="snapshot_store_unavailable",
                          headers={"Retry-After": "5"}) from why

    async def drop_paused_memory(self, digest: str | None) -> None:
        """A published pause image is used once: after the resume (or kill) it goes from the store."""
        if digest:
            try:
                await self.artifacts.store.delete_blob("memory", digest)
            except Exception as e:  # noqa: BLE001 - an orphan blob is only wasted space
                log.warning("could not delete memory image %s from the store: %s", digest[:12], e)

    async def resume_locked(self, rec: SandboxRecord, timeout: int) -> None:
        """Resume a paused sandbox (the caller holds its lock), admitted like a start."""
        check(rec.state, "resume", rec.sandbox_id)
        async with self.admission.admit(rec.team_id):
            await self.resume_admitted(rec, timeout)

    async def resume_admitted(self, rec: SandboxRecord, timeout: int) -> None:
        host = self.host
        before, final = self.lifecycle.begin(rec, "resume")
        reservation = self.admission.bind()  # the resuming record counts here from now on
        await self.admission.bind_shared(reservation, rec.sandbox_id)  # in the store: from the claim on
        try:
            await self.lifecycle.claim(rec, before)  # RESUMING in the store: no other node adopts it now
        except BaseException:
            self.admission.unbind(reservation)
            raise
        ckpt = host.checkpoint_dir(rec.sandbox_id)
        full = rec.pause_mode != "filesystem" and ckpt.is_dir() and any(ckpt.iterdir())
        pinned = rec.memory_digest if rec.pause_mode != "filesystem" else None
        try:
            if pinned:  # published pause: pulled from the snapshot store if this node lacks it
                ckpt, full = await host.pin_memory(pinned), True
            await host.bring_up(rec, restore_from=ckpt if full else None,
                                restore_token=rec.envd_access_token if full else None)
        except BaseException as e:
            # The paused state on disk is intact: undo what the attempt set up and stay paused.
            log.error("resume of %s failed: %s", rec.sandbox_id, e)
            await asyncio.shield(self._resume_failed(rec, before))
            if isinstance(e, Exception):
                raise RuntimeFailure(f"resume of sandbox {rec.sandbox_id} failed: {e}") from e
            raise
        finally:
            if pinned:
                host.unpin(pinned)
        # RUNNING in the store before the pause image goes: a crash in between leaves an unused
        # image (collected), never a paused record whose image is gone
        image, rec.memory_digest = rec.memory_digest, None
        now = utcnow()
        rec.pause_mode = None
        rec.started_at = now
        rec.end_at = now + timedelta(seconds=timeout)
        await self.lifecycle.settle(rec, final)
        if pinned:
            await self.drop_paused_memory(image)
        else:
            shutil.rmtree(ckpt, ignore_errors=True)
        log.info("resumed sandbox %s", rec.sandbox_id)

    async def _resume_failed(self, rec: SandboxRecord, before: SandboxState) -> None:
        await self.host.stand_down(rec.sandbox_id, rec.runtime)
        try:
            await self.lifecycle.unclaim(rec, before)
        except Exception as e:  # noqa: BLE001 - the store says RESUMING; the next resume claims it again
            log.warning("sandbox %s is paused again, but the state store was not told: %s", rec.sandbox_id, e)
