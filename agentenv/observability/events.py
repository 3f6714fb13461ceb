"""The lifecycle event stream: an append-only JSONL file, an in-memory tail, and an optional webhook.

Every lifecycle change of a sandbox (created, paused, resumed, forked, snapshotted, killed,
expired, failed) becomes one JSON object on one line of `<data_dir>/events/events.jsonl`, with a
sequence number that keeps increasing across restarts. Consumers pick what suits them:

- `tail -F <data_dir>/events/events.jsonl` (plain text, one event per line; rotated at
  `ROTATE_BYTES` to `events.jsonl.1`),
- `GET /events?since=<seq>` (long-poll with `wait=`, or Server-Sent Events with
  `Accept: text/event-stream`), scoped to the caller's team,
- a webhook (`events_webhook_url`): each event POSTed as JSON, retried with backoff, dropped
  (and counted) only when the queue overflows.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from agentenv.models import rfc3339, utcnow

log = logging.getLogger("agentenv.observability.events")

EVENT_TYPES = ("created", "forked", "paused", "resumed", "snapshotted", "killed", "expired", "failed")
ROTATE_BYTES = 64 * 1024 * 1024
MEMORY_EVENTS = 20_000


def _last_seq(path: Path) -> int:
    """The sequence number of the last complete line (reads only the file's tail)."""
    for p in (path, path.with_name(path.name + ".1")):
        try:
            with open(p, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - 65536))
                lines = f.read().splitlines()
        except OSError:
            continue
        for line in reversed(lines):
            try:
                return int(json.loads(line)["seq"])
            except (ValueError, KeyError, TypeError):
                continue
    return 0


def select_events(source, *, limit: int, team_id: str | None, sandbox_id: str | None) -> list[dict]:
    """The events of `source` (in order) a reader may see: its team's (or team-less ones), those of
    `sandbox_id` (as the sandbox or as a parent) when given; at most `limit`."""
    out = []
    for e in source:
        if team_id is not None and e.get("teamID") not in (team_id, None):
            continue
        if sandbox_id is not None and sandbox_id not in (e.get("sandboxID"), e.get("parentID")):
            continue
        out.append(e)
        if len(out) >= limit:
            break
    return out


async def wait_past(changed: asyncio.Condition, seq: Callable[[], int], since: int, timeout: float) -> bool:
    """Wait until `seq()` > since (True) or `timeout` passes (False); `changed` is notified on news."""
    if seq() > since:
        return True
    deadline = time.monotonic() + timeout
    async with changed:
        while seq() <= since:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(changed.wait(), left)
            except asyncio.TimeoutError:
                return seq() > since
    return True


class EventLog:
    def __init__(self, directory: Path, *, webhook_url: str | None = None,
                 on_event: Callable[[dict], None] | None = None) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "events.jsonl"
        self.seq = _last_seq(self.path)
        self.recent: deque[dict] = deque(maxlen=MEMORY_EVENTS)
        self._changed = asyncio.Condition()
        self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - held for the server's life
        self.on_event = on_event
        self.webhook_url = webhook_url
        self.webhook_dropped = 0
        self.webhook_failed = 0
        self._queue: asyncio.Queue[dict] | None = None
        self._webhook_task: asyncio.Task | None = None

    def start(self) -> None:
        if self.webhook_url and self._webhook_task is None:
            self._queue = asyncio.Queue(maxsize=10_000)
            self._webhook_task = asyncio.create_task(self._deliver(), name="events-webhook")

    async def close(self) -> None:
        if self._webhook_task is not None:
            self._webhook_task.cancel()
            try:
                await self._webhook_task
            except asyncio.CancelledError:
                pass
        self._fh.close()

    def emit(self, type_: str, sandbox_id: str | None, *, team_id: str | None = None, **fields: Any) -> dict:
        """Append one event (synchronously: a single small write with O_APPEND) and wake consumers."""
        self.seq += 1
        ev: dict[str, Any] = {"seq": self.seq, "timestamp": rfc3339(utcnow()), "type": type_}
        if sandbox_id is not None:
            ev["sandboxID"] = sandbox_id
        if team_id is not None:
            ev["teamID"] = team_id
        ev.update({k: v for k, v in fields.items() if v is not None})
        line = json.dumps(ev, separators=(",", ":"), default=str)
        try:
            if self._fh.tell() > ROTATE_BYTES:
                self._fh.close()
                os.replace(self.path, self.path.with_name(self.path.name + ".1"))
                self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
            self._fh.write(line + "\n")
            self._fh.flush()
        except OSError:
            log.exception("could not append to %s", self.path)
        self.recent.append(ev)
        if self.on_event is not None:
            self.on_event(ev)
        if self._queue is not None:
            try:
                self._queue.put_nowait(ev)
            except asyncio.QueueFull:
                self.webhook_dropped += 1
        asyncio.get_running_loop().create_task(self._notify())
        return ev

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _from_file(self, since: int) -> list[dict]:
        out: list[dict] = []
        for p in (self.path.with_name(self.path.name + ".1"), self.path):
            try:
                with open(p, encoding="utf-8") as f:
                    for line in f:
                        try:
                            ev = json.loads(line)
                        except ValueError:
                            continue
                        if ev.get("seq", 0) > since:
                            out.append(ev)
            except OSError:
                continue
        return out

    def read(self, since: int, *, limit: int = 1000, team_id: str | None = None,
             sandbox_id: str | None = None) -> list[dict]:
        """Events with seq > since (oldest first), from memory, or the file for older history."""
        if since >= self.seq:
            return []
        if not self.recent or since + 1 < self.recent[0]["seq"]:  # older than memory: the file has it
            source = self._from_file(since)
        else:
            source = [e for e in self.recent if e["seq"] > since]
        return select_events(source, limit=limit, team_id=team_id, sandbox_id=sandbox_id)

    async def wait(self, since: int, timeout: float) -> bool:
        """Wait until an event with seq > since exists (True) or `timeout` passes (False)."""
        return await wait_past(self._changed, lambda: self.seq, since, timeout)

    async def _deliver(self) -> None:
        assert self._queue is not None
        timeout = aiohttp.ClientTimeout(total=10)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                ev = await self._queue.get()
                delay = 0.5
                for _attempt in range(6):
                    try:
                        async with session.post(self.webhook_url, json=ev) as resp:  # type: ignore[arg-type]
                            if resp.status < 500:
                                break
                    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                        pass
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 10)
                else:
                    self.webhook_failed += 1
                    log.warning("webhook %s refused event %s after retries", self.webhook_url, ev["seq"])
