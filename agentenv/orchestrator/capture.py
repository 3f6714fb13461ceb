"""Capturing a running sandbox for a fork, a snapshot or a checkpoint, without ever losing it.

Where the runtime can (`RuntimeTraits.captures_running`: gVisor), the source never stops: it is
frozen for its memory image (`checkpoint --leave-running`) and a copy of its writable upper, thawed,
and the two are sealed into a memory artifact and a layer while it runs on its own upper. Otherwise:
checkpoint the source once, seal its upper into a new content-addressed layer and its memory into
an artifact, then restore the source in place on a fresh upper (same id, same slot). A checkpoint
the runtime refuses leaves the source running (503). Once the image exists the source is never
lost: if it cannot be brought back it is parked as a paused sandbox with that image (`park`); a
journal in the sandbox dir (`capture.json`) lets a restarted server find the image of a capture it
was killed in (`recover`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from agentenv.errors import AgentEnvError, RuntimeFailure, Unavailable
from agentenv.models import SandboxRecord, SandboxState
from agentenv.orchestrator.host import SandboxHost, Sealed
from agentenv.orchestrator.lifecycle import Lifecycle
from agentenv.orchestrator.livecapture import LiveCapture
from agentenv.storage.artifactfiles import REQUIRES_FILE

log = logging.getLogger("agentenv.orchestrator")


@dataclass
class Captured:
    """A capture: `view` is the source's record as captured (its layers are the capture's chain),
    `sealed.memory` its memory image (or `image`, not sealed); kept until `Capture.release`."""

    view: SandboxRecord
    sealed: Sealed
    frozen_s: float | None = None  # how long the source was frozen (captures that leave it running)
    result: Any = None             # what `then` returned
    pins: list[str] = field(default_factory=list)  # more layers kept from GC until `release`
    image: Path | None = None      # the memory image as taken, when it was not sealed (`seal_memory=False`)

    @property
    def memory(self) -> str:
        assert self.sealed.memory is not None
        return self.sealed.memory


class Capture:
    def __init__(self, host: SandboxHost, lifecycle: Lifecycle,
                 lose: Callable[[SandboxRecord, Exception], Awaitable[Exception]]) -> None:
        self._busy: set[str] = set()
        self.host = host
        self.live = LiveCapture(host)
        self.lifecycle = lifecycle
        self.artifacts = host.artifacts
        self._lose = lose

    def _journal_path(self, sandbox_id: str) -> Path:
        return self.host.sandbox_dir(sandbox_id) / "capture.json"

    def forget_journal(self, sandbox_id: str) -> None:
        self._journal_path(sandbox_id).unlink(missing_ok=True)

    def journal(self, rec: SandboxRecord, **state: object) -> None:
        """Where a capture (or a rollback) stands, so a server killed half-way finds the sandbox's state
        (`recover`): `memory=` a sealed image with `rec.layers`, `image=` an unsealed image dir."""
        path = self._journal_path(rec.sandbox_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"layers": rec.layers, **state}))
        os.replace(tmp, path)

    def drop_kept_images(self) -> None:
        """Images forks kept for their children (`Captured.image`) that a killed server left behind:
        at a start no fork is in flight."""
        shutil.rmtree(self.host.paths.fork_images, ignore_errors=True)

    def busy(self, sandbox_id: str) -> bool:
        """A capture of the sandbox is under way (from its checkpoint until its image is sealed)."""
        return sandbox_id in self._busy

    async def locked(self, sandbox_id: str, team_id: str | None, op: str,
                     then: Callable[[Captured], Awaitable[Any]] | None = None, *,
                     seal_memory: bool = True) -> Captured:
        """Under the sandbox's lock: check `op` is legal, capture, and land in its final state.

        A refusal before anything happened (open TCP connections) leaves the sandbox as it was.
        Where the runtime can, the source never stops: it is frozen for the memory image and a copy
        of its upper, then RUNNING again while the copy and the image are sealed. `then` runs under
        the lock once the capture is sealed (a checkpoint commits itself there, so its parent is
        the sandbox's last one). The caller releases the result (`release`).

        `seal_memory=False` (a fork: its children restore from the image once, nothing keeps it): a
        capture that left the source running keeps its image as taken (`Captured.image`), without
        hashing it into the page store; `release` removes it.
        """
        async with self.lifecycle.lock(sandbox_id):
            rec = self.lifecycle.live(sandbox_id, team_id)
            before, final = self.lifecycle.begin(rec, op)
            self._busy.add(sandbox_id)
            try:
                if self.host.captures_running(rec):
                    got = await self._capture_running(rec, before, final, seal_memory)
                else:
                    got = await self._capture_stopping(rec, before, final)
                if then is not None:
                    try:
                        got.result = await then(got)
                    except BaseException:
                        self.release(got)
                        raise
                return got
            finally:
                self._busy.discard(sandbox_id)

    def release(self, got: "Captured") -> None:
        """The capture's artifacts are referenced by records or snapshots now (or were not wanted)."""
        self.host.unpin_sealed(got.sealed)
        self.host.unpin_layers(got.pins)
        if got.image is not None:
            shutil.rmtree(got.image, ignore_errors=True)

    async def _capture_stopping(self, rec: SandboxRecord, before: SandboxState, final: SandboxState) -> "Captured":
        try:
            mem = await self._capture(rec)
        except Unavailable:  # refused before anything happened
            self.lifecycle.rollback(rec, before)
            raise
        await self.lifecycle.settle(rec, final)
        return Captured(replace(rec, layers=list(rec.layers)), Sealed(None, mem))

    async def _capture_running(self, rec: SandboxRecord, before: SandboxState,
                               final: SandboxState, seal_memory: bool = True) -> "Captured":
        """The source keeps running: frozen for its image + upper copy, RUNNING while they are sealed."""
        host = self.host
        sid = rec.sandbox_id
        image, upper_copy = host.sandbox_dir(sid) / "capture", host.sandbox_dir(sid) / "capture-upper"
        for d in (image, upper_copy):
            shutil.rmtree(d, ignore_errors=True)
        t0 = time.monotonic()
        try:
            frozen = await self.live.checkpoint_running(rec, image, upper_copy)
        except Unavailable:
            self.lifecycle.rollback(rec, before)
            raise
        except Exception as e:  # noqa: BLE001 - frozen and not thawed, or dead
            return await self._restart_after_failed_thaw(rec, image, upper_copy, final, e)
        t_back = time.monotonic() - t0
        await self.lifecycle.settle(rec, final)  # usable again: traffic no longer waits
        kept: Path | None = None
        if not seal_memory and not (image / REQUIRES_FILE).exists():  # a VM's image names its drives: sealed
            # out of the source's dir: its next capture reuses `image`, a kill removes the dir
            kept = host.paths.fork_images / f"{sid}-{secrets.token_hex(6)}"
            kept.parent.mkdir(parents=True, exist_ok=True)
            os.replace(image, kept)
        try:
            sealed = await self.live.seal_copy(sid, image if kept is None else None, upper_copy)
        except Exception as e:  # noqa: BLE001 - e.g. the disk is full: the source runs on, untouched
            host.unpin_layers(frozen.base)
            if kept is not None:
                shutil.rmtree(kept, ignore_errors=True)
            log.error("sealing the capture of %s failed: %s", sid, e)
            raise Unavailable(f"Sandbox {sid} could not be captured: sealing its image failed ({e}); "
                              "the sandbox keeps running unchanged", error_code="capture_failed",
                              headers={"Retry-After": "5"}) from e
        finally:
            for d in (image, upper_copy):
                shutil.rmtree(d, ignore_errors=True)
        layers = ([sealed.layer] if sealed.layer else []) + frozen.base
        self.live.remember(rec, frozen, layers)
        log.info("captured %s without stopping it: frozen %.3fs, running again after %.3fs, sealed after %.3fs "
                 "(layer %s, %s)", sid, frozen.frozen_s, t_back, time.monotonic() - t0,
                 sealed.layer[:12] if sealed.layer else "-",
                 "whole upper" if frozen.base == list(rec.layers) else f"delta over {len(frozen.base)} layers")
        return Captured(replace(rec, layers=layers), sealed, frozen_s=frozen.frozen_s, pins=frozen.base, image=kept)

    async def _restart_after_failed_thaw(self, rec: SandboxRecord, image: Path, upper_copy: Path,
                                         final: SandboxState, why: Exception) -> "Captured":
        """The image was taken but the source could not be thawed: it is still frozen as it was at the
        image, so stop it and finish the way a stopping capture does (its upper sealed into a layer,
        restored in place from the image); parked paused if that fails. Dead: lost."""
        host = self.host
        sid = rec.sandbox_id
        shutil.rmtree(upper_copy, ignore_errors=True)
        alive = await host.runtime_for(sid, rec.runtime).is_alive(sid)
        if not (alive and image.is_dir()):
            raise await self._lose(rec, why) from why
        log.error("sandbox %s could not be thawed after its capture (%s); restarting it from the image", sid, why)
        slot = host.slots[sid]
        await asyncio.shield(host.stop_quietly(sid, rec.runtime))
        mem: str | None = None
        try:
            async def record_layer(layer: str | None) -> None:
                if layer:
                    rec.layers = [layer] + rec.layers
                    await self.lifecycle.persist(rec)

            sealed = await host.seal(sid, image, keep_disk=True, on_layer=record_layer)
            mem = sealed.memory
            host.pin(mem)
            await host.network.deactivate(slot)
            await host.bring_up(rec, restore_from=self.artifacts.memory_dir(mem), restore_token=rec.envd_access_token,
                                slot=slot)
        except Exception as e:  # noqa: BLE001
            if mem is not None:
                host.unpin(mem)
            raise await self.park(rec, image, mem, e) from e
        await self.lifecycle.settle(rec, final)
        return Captured(replace(rec, layers=list(rec.layers)), Sealed(None, mem))

    async def _capture(self, rec: SandboxRecord) -> str:
        """Checkpoint a running sandbox, seal its upper into a layer, restore it in place.

        Returns the memory artifact's digest (pinned). The caller holds the sandbox's lock and has
        set its transient state.
        """
        host = self.host
        sid = rec.sandbox_id
        tmp_image = host.sandbox_dir(sid) / "capture"
        shutil.rmtree(tmp_image, ignore_errors=True)
        slot = host.slots[sid]
        t0 = time.monotonic()
        try:
            await host.checkpoint(rec, tmp_image)
        except Unavailable:  # nothing happened: the caller resets the state
            raise
        except Exception as e:  # noqa: BLE001 - the source died under the checkpoint
            raise await self._lose(rec, e) from e
        t_ckpt = time.monotonic() - t0
        mem: str | None = None

        async def record_layer(layer: str | None) -> None:
            if layer:
                rec.layers = [layer] + rec.layers
                self.journal(rec, image=str(tmp_image))
                await self.lifecycle.persist(rec)

        try:
            self.journal(rec, image=str(tmp_image))
            # the upper is sealed from the disk image (keep_disk): the source comes back on a fresh one
            sealed = await host.seal(sid, tmp_image, keep_disk=True, on_layer=record_layer)
            mem = sealed.memory
            host.pin(mem)
            self.journal(rec, memory=mem)
            t_seal = time.monotonic() - t0 - t_ckpt
            # Same id, same slot (guest addressing is identical anyway), fresh upper on the new chain.
            await host.network.deactivate(slot)
            await host.bring_up(rec, restore_from=self.artifacts.memory_dir(mem),
                                restore_token=rec.envd_access_token, slot=slot)
            log.info("captured %s: checkpoint %.3fs, seal %.3fs, source back after %.3fs (layer %s)", sid,
                     t_ckpt, t_seal, time.monotonic() - t0, sealed.layer[:12] if sealed.layer else "-")
        except Exception as e:  # noqa: BLE001
            if mem is not None:
                host.unpin(mem)
            raise await self.park(rec, tmp_image, mem, e) from e
        finally:
            self._journal_path(sid).unlink(missing_ok=True)
        await self.lifecycle.persist(rec)
        return mem

    async def park(self, rec: SandboxRecord, image: Path, mem: str | None, why: Exception) -> AgentEnvError:
        """The source was checkpointed but could not be brought back: keep it as a paused sandbox with
        that image (its memory, processes and files), resumable like any pause. Never LOST."""
        host = self.host
        sid = rec.sandbox_id
        log.error("sandbox %s could not be restored after its capture (%s); parking it paused", sid, why)
        host.keep_logs(sid, "capture")
        await asyncio.shield(host.stop_quietly(sid, rec.runtime))
        await host.release_slot(sid)
        try:
            await host.rootfs.unmount(sid)
        except Exception:  # noqa: BLE001
            log.exception("unmount of %s failed", sid)
        try:
            await self.image_as_pause(sid, image, mem)
        except OSError as e:
            raise await self._lose(rec, e) from e
        rec.pause_mode = "full"
        await self.lifecycle.settle(rec, SandboxState.PAUSED)
        return RuntimeFailure(f"Sandbox {sid} was captured but could not be restarted ({why}); it is paused "
                              "with its full state: resume it", error_code="sandbox_parked")

    async def image_as_pause(self, sandbox_id: str, image: Path | None, mem: str | None) -> None:
        """Make a capture's image the sandbox's pause checkpoint: the sealed memory artifact `mem`
        (it stays in the cache: hard-linked) or else the unsealed image dir (moved)."""
        ckpt = self.host.checkpoint_dir(sandbox_id)
        if mem is None and image == ckpt:  # a published pause cut short: its image is there already
            return
        shutil.rmtree(ckpt, ignore_errors=True)
        if mem is not None:  # rebuilt from its pages if its extracted copy was dropped
            await asyncio.to_thread(shutil.copytree, await self.artifacts.ensure_memory(mem), ckpt,
                                    copy_function=os.link)
        else:
            assert image is not None
            os.replace(image, ckpt)

    async def recover(self, rec: SandboxRecord) -> bool:
        """A server killed mid-capture (or mid-publish of a pause) left the source stopped with a
        complete image (its journal): keep it as a paused sandbox with that image. True if it was
        recovered. (A capture that leaves the source running has no journal: only its scratch copies
        are removed here.)"""
        host = self.host
        sid = rec.sandbox_id
        for scratch in ("capture-upper", "capture.reset"):
            shutil.rmtree(host.sandbox_dir(sid) / scratch, ignore_errors=True)
        for half in host.sandbox_dir(sid).glob("*.tmp"):  # a write-then-rename cut short (journal, capture base)
            if half.is_file():
                half.unlink(missing_ok=True)
        try:
            journal = json.loads(self._journal_path(sid).read_text())
        except (OSError, ValueError):
            shutil.rmtree(host.sandbox_dir(sid) / "capture", ignore_errors=True)  # a half-written image
            return False
        image = Path(journal["image"]) if journal.get("image") else None
        if not journal.get("memory") and not (image and image.is_dir()):
            return False
        try:
            await self.image_as_pause(sid, image, journal.get("memory"))
        except OSError as e:
            log.error("could not recover the interrupted capture of %s: %s", sid, e)
            return False
        rec.layers = list(journal.get("layers") or rec.layers)
        rec.image = journal.get("rootImage") or rec.image  # a rollback's target may sit on another image
        rec.checkpoint_id = journal.get("checkpoint") or rec.checkpoint_id
        rec.pause_mode, rec.slot = "full", None
        self.lifecycle.mark(rec, SandboxState.PAUSED)
        await host.stop_quietly(sid)  # not adopted yet: the node's default runtime (stop is idempotent)
        await host.release_slot(sid)  # also one the crash left half-released (its netns without its link)
        self._journal_path(sid).unlink(missing_ok=True)
        await self.lifecycle.persist(rec)
        self.lifecycle.adopt(rec)
        log.warning("sandbox %s: its capture was interrupted by a restart; it is paused with its full state", sid)
        return True
