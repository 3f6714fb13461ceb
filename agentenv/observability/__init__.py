"""Observability of a node: Prometheus metrics, sandbox resource samples, lifecycle events, logs.

`Observability` bundles the parts and hooks them onto a composed server (`attach`); the API
handlers in `observability.api` and the console read from it. Reusable pieces for other roles:
`metrics.mount_metrics(app, registry)` serves any registry at `/metrics`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from typing import Any

from agentenv.observability.collectors import NodeCollector
from agentenv.observability.events import EventLog
from agentenv.observability.instrument import (http_metrics_middleware, instrument_orchestrator, instrument_proxy,
                                               instrument_snapshot_store)
from agentenv.observability.logs import LogEntry, SandboxLogHandler, SandboxLogs
from agentenv.observability.metrics import Metrics, mount_metrics
from agentenv.observability.sampler import ResourceSampler

__all__ = ["Observability", "Metrics", "mount_metrics", "http_metrics_middleware"]

_MESSAGES = {
    "created": "Sandbox created",
    "forked": "Sandbox forked",
    "paused": "Sandbox paused",
    "resumed": "Sandbox resumed",
    "snapshotted": "Snapshot taken",
    "killed": "Sandbox killed",
    "expired": "Sandbox reached its timeout",
    "failed": "Sandbox operation failed",
}


def _describe(ev: dict) -> str:
    base = _MESSAGES.get(ev["type"], ev["type"])
    t = ev["type"]
    if t == "created":
        if ev.get("origin") == "fork":
            return f"{base} as a fork of {ev.get('parentID')}"
        if ev.get("origin") == "snapshot":
            return f"{base} from snapshot {ev.get('snapshotID')}"
        return f"{base} from template {ev.get('templateID')}"
    if t == "forked":
        return f"{base} into {len(ev.get('children', []))} children: {', '.join(ev.get('children', []))}"
    if t == "paused":
        return f"{base} ({ev.get('mode') or 'full'}, reason: {ev.get('reason')})"
    if t == "snapshotted":
        return f"{base}: {ev.get('snapshotID')} ({ev.get('sizeBytes', 0)} bytes)"
    if t == "killed":
        return f"{base} (reason: {ev.get('reason')})"
    if t == "expired":
        return f"{base}; action: {ev.get('action')}"
    if t == "failed":
        return f"{base}: {ev.get('operation')} ({ev.get('reason')}): {ev.get('message', '')}"
    return base


class Observability:
    def __init__(self, settings: Any, orchestrator: Any) -> None:
        self.settings = settings
        self.orch = orchestrator
        self.metrics = Metrics()
        self.logs = SandboxLogs()
        self.events = EventLog(settings.paths.root / "events", webhook_url=settings.events_webhook_url,
                               on_event=self._on_event)
        self.sampler = ResourceSampler(orchestrator, interval=settings.metrics_sample_interval_s,
                                       history=settings.metrics_history, on_pass=self.metrics.sample_duration.set)
        self.metrics.registry.register(NodeCollector(orchestrator, settings, self.sampler))
        self._log_handler = SandboxLogHandler(self.logs)
        # Awaited before each /metrics scrape (numbers that live elsewhere: the HAProxy data plane).
        self.scrape_hooks: list[Callable[[], Awaitable[None]]] = []

    async def before_scrape(self) -> None:
        for hook in list(self.scrape_hooks):
            try:
                await hook()
            except Exception:  # noqa: BLE001 - a scrape still answers
                logging.getLogger(__name__).exception("metrics scrape hook failed")

    def attach(self, proxy: Any = None, snapshot_store: Any = None) -> "Observability":
        """Hook onto the orchestrator (and proxy, snapshot store when given). Call once, before start."""
        instrument_orchestrator(self.orch, self)
        if proxy is not None:
            instrument_proxy(proxy, self)
        if snapshot_store is not None:
            instrument_snapshot_store(snapshot_store, self)
        logging.getLogger("agentenv").addHandler(self._log_handler)
        return self

    def _on_event(self, ev: dict) -> None:
        self.metrics.events.labels(ev["type"]).inc()
        sid = ev.get("sandboxID")
        if sid:
            level = "error" if ev["type"] == "failed" else "info"
            fields = {k: str(v) for k, v in ev.items() if k not in ("timestamp", "sandboxID", "teamID")
                      and not isinstance(v, (list, dict))}
            fields["source"] = "lifecycle"
            self.logs.add(sid, LogEntry(datetime.now(timezone.utc), level, _describe(ev), fields), ev.get("teamID"))

    async def start(self) -> None:
        self.events.start()
        self.sampler.start()

    async def stop(self) -> None:
        await self.sampler.stop()
        logging.getLogger("agentenv").removeHandler(self._log_handler)
        await self.events.close()
