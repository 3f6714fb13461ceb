"""The traffic resolver: where the proxy sends a sandbox's traffic, waking it first if needed.

A paused sandbox with auto-resume is woken by the first request for it: every request that finds
it paused awaits the same resume task (single flight, shielded: a client that gives up does not
cancel the resume for the others). Traffic during a short capture or resume waits for it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from agentenv.models import SandboxRecord, SandboxState
from agentenv.network.slots import NetSlot

_TRANSIENT = (SandboxState.CREATING, SandboxState.FORKING, SandboxState.SNAPSHOTTING, SandboxState.RESUMING)


@dataclass
class Route:
    """What the traffic proxy needs to reach a sandbox (duck-types proxy.traffic.SandboxRoute)."""

    sandbox_id: str
    host_ip: str | None
    state: str
    envd_access_token: str | None
    traffic_access_token: str | None


def wakeable(rec: SandboxRecord) -> bool:
    """Paused with its memory (a filesystem-only pause cannot be woken transparently: it reboots)."""
    return rec.state == SandboxState.PAUSED and rec.auto_resume and rec.pause_mode != "filesystem"


class TrafficResolver:
    """`proxy.traffic.SandboxResolver` over the orchestrator's records and the host's slots."""

    def __init__(self, get: Callable[[str], SandboxRecord | None], records: Callable[[], Iterable[SandboxRecord]],
                 slots: dict[str, NetSlot], resume_on_traffic: Callable[[str], Awaitable[bool]]) -> None:
        self._get = get
        self._records = records
        self._slots = slots
        self._resume_on_traffic = resume_on_traffic
        self._waking: dict[str, asyncio.Task] = {}  # single-flight resumes triggered by traffic

    async def resolve(self, sandbox_id: str) -> Route | None:
        """Where traffic for a sandbox goes; wakes it first when it is paused with auto-resume on.

        Raises AgentEnvError when a wake was attempted and failed (the proxy answers 503).
        """
        rec = self._get(sandbox_id)
        if rec is None:
            return None
        # Traffic arriving during a short capture/resume waits for it rather than failing; during
        # the pause of an auto-resume sandbox it waits for the pause, then wakes it.
        deadline = time.monotonic() + 60
        while (rec.state in _TRANSIENT or (rec.state == SandboxState.PAUSING and rec.auto_resume)) \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            rec = self._get(sandbox_id)
            if rec is None:
                return None
        if wakeable(rec):
            await self.wake(sandbox_id)
            rec = self._get(sandbox_id)
            if rec is None:
                return None
        slot = self._slots.get(sandbox_id)
        running = rec.state == SandboxState.RUNNING
        return Route(sandbox_id, slot.host_ip if (slot and running) else None,
                     "running" if running else rec.state.value, rec.envd_access_token, rec.traffic_access_token)

    async def wake(self, sandbox_id: str) -> None:
        """Resume a paused auto-resume sandbox because traffic arrived for it (single flight)."""
        task = self._waking.get(sandbox_id)
        if task is None:
            task = asyncio.create_task(self._resume_on_traffic(sandbox_id), name=f"wake-{sandbox_id}")
            self._waking[sandbox_id] = task
            task.add_done_callback(lambda t: self._waking.pop(sandbox_id, None) if self._waking.get(
                sandbox_id) is t else None)
        await asyncio.shield(task)

    def running_routes(self) -> Iterable[Route]:
        for rec in self._records():
            slot = self._slots.get(rec.sandbox_id)
            if rec.state == SandboxState.RUNNING and slot is not None:
                yield Route(rec.sandbox_id, slot.host_ip, "running", rec.envd_access_token, rec.traffic_access_token)
