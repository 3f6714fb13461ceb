"""Reconciling with the kernel after a server restart (or `kill -9`).

Running sandboxes survive only if their container is alive and their network slot exists; paused
ones live on disk and stay resumable; a capture the old process was killed in is recovered from
its journal (`capture.Capture.recover`), and so is a published pause (a cluster node's) that it was
killed in before the pause was stored: paused from its image, then published; anything half-made is
removed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from agentenv.models import SandboxState
from agentenv.orchestrator.host import GcIncomplete, policy_of

if TYPE_CHECKING:
    from agentenv.orchestrator.service import Orchestrator

log = logging.getLogger("agentenv.orchestrator")


async def reconcile(orch: "Orchestrator") -> None:
    """Re-adopt sandboxes still alive after a server restart; tear down everything else."""
    host, lifecycle = orch.host, orch.lifecycle
    keep: set[str] = set()
    try:  # no start of this node is in flight yet: its team reservations of a previous run go
        await orch.admission.clear()
    except Exception as e:  # noqa: BLE001 - they stop counting when this node is declared dead, or expire
        log.warning("could not clear this node's old team reservations: %s", e)
    await host.network.discover()
    orch.captures.drop_kept_images()  # the forks that made them ended with the old process
    listed: set[str] | None = None
    recovered: list[str] = []  # paused from a journal: to publish, on a node that publishes its pauses

    async def running_ids() -> set[str]:
        """The containers/VMs the runtimes still know (asked once, when a paused sandbox needs it)."""
        nonlocal listed
        if listed is None:
            listed = set()
            for rt in host.runtimes.values():
                listed.update(await rt.list_ids())
        return listed

    async def stand_down(sandbox_id: str, runtime: str | None) -> None:
        """A paused sandbox whose pause's stand-down the old process did not finish (a crash right
        after the pause answered): its frozen container stops and its slot goes, also a slot the
        crash left half-released (its netns without its link), which would refuse its resume."""
        if sandbox_id in await running_ids():
            await host.stop_quietly(sandbox_id, runtime)
        await host.release_slot(sandbox_id)

    for rec in await orch.store.list_sandboxes():
        if rec.state == SandboxState.RESUMING:
            # a resume the old process did not finish: its pause image is intact (it goes only
            # after RUNNING is stored); a container it restored half-way is stood down below
            lifecycle.mark(rec, SandboxState.PAUSED)
            await lifecycle.persist(rec)
        if rec.state in (SandboxState.FORKING, SandboxState.SNAPSHOTTING):
            # a capture the old process did not finish (it records the source's new layers
            # half-way): the source still runs (frozen at worst), or its capture journal holds it
            lifecycle.mark(rec, SandboxState.RUNNING)
        if rec.state == SandboxState.RUNNING and await orch.captures.recover(rec):
            # its journal: the source was stopped after its image was written; a container
            # restored from that image may have come up half-way: the image is the truth
            keep.add(rec.sandbox_id)
            recovered.append(rec.sandbox_id)
            continue
        slot = host.network.slot_for(rec.sandbox_id)
        if rec.state in (SandboxState.LOST, SandboxState.RUNNING) and orch.recover_fenced is not None \
                and orch.recover_fenced(rec):
            # a cluster node paused it onto its disk while fenced (cluster/fence.py): it rejoins with
            # it; its container may still be there, frozen (a crash right after the pause answered)
            lifecycle.adopt(rec, SandboxState.PAUSED)
            keep.add(rec.sandbox_id)
            await stand_down(rec.sandbox_id, rec.runtime)
            log.info("sandbox %s, paused here while this node was fenced, is kept for its rejoin", rec.sandbox_id)
            continue
        rt = host.runtimes.get(rec.runtime)
        if rt is None and rec.state == SandboxState.RUNNING:
            log.warning("sandbox %s runs under %s, which this node no longer serves", rec.sandbox_id, rec.runtime)
        alive = rec.state == SandboxState.RUNNING and slot is not None and rt is not None \
            and await rt.is_alive(rec.sandbox_id)
        if alive and rt.traits.may_stay_frozen and await rt.state(rec.sandbox_id) == "paused":
            # frozen by a capture the old process did not finish: the sandbox runs on
            log.warning("sandbox %s was frozen by an interrupted capture; thawing it", rec.sandbox_id)
            await rt.resume(rec.sandbox_id)
        if alive:
            lifecycle.adopt(rec)
            host.runtime_of[rec.sandbox_id] = rec.runtime
            try:
                # the egress proxy's listener died with the old process; the nft rules did not
                slot = await host.network.apply_policy(slot, policy_of(rec))
            except Exception:  # noqa: BLE001 - the slot keeps the rules it had
                log.exception("could not re-apply the egress policy of %s", rec.sandbox_id)
            host.slots[rec.sandbox_id] = slot
            keep.add(rec.sandbox_id)
            log.info("re-adopted running sandbox %s", rec.sandbox_id)
        elif rec.state == SandboxState.PAUSED:
            orch.captures.forget_journal(rec.sandbox_id)  # stale: written before the pause was stored
            lifecycle.adopt(rec)
            keep.add(rec.sandbox_id)
            await stand_down(rec.sandbox_id, rec.runtime)
            log.info("paused sandbox %s is resumable", rec.sandbox_id)
        else:
            why = ("no network slot" if slot is None else "its runtime is not served here" if rt is None
                   else f"runtime state {await rt.state(rec.sandbox_id)!r}")
            log.warning("dropping sandbox %s (state %s) that did not survive the restart (%s)", rec.sandbox_id,
                        rec.state.value, why if rec.state == SandboxState.RUNNING else "not running")
            await host.teardown(rec.sandbox_id)
            await orch.store.delete_sandbox(rec.sandbox_id)
    try:
        await orch.gc(keep)
    except GcIncomplete as e:  # the server starts anyway: a stray must not keep every sandbox offline
        log.error("after the restart, %s (the next gc tries again)", e.message)
    for rec in lifecycle.records():
        if rec.state == SandboxState.PAUSED:
            await host.rootfs.unmount(rec.sandbox_id)
    if orch.pauses.publish:
        for sid in recovered:
            await _publish_recovered(orch, sid)


async def _publish_recovered(orch: "Orchestrator", sandbox_id: str) -> None:
    """A sandbox recovered paused on a node that publishes its pauses: sealed and uploaded, so that any
    node can resume it. If the snapshot store is out of reach it stays paused on this node only."""
    try:
        rec = await asyncio.wait_for(orch.pauses.publish_local(sandbox_id), 120)
        if rec is not None:
            await orch.lifecycle.persist(rec)
            log.info("sandbox %s, recovered paused, is published to the snapshot store", sandbox_id)
    except Exception as e:  # noqa: BLE001
        log.error("sandbox %s, recovered paused, could not be published (%s): it is resumable on this node only",
                  sandbox_id, str(e) or type(e).__name__)
