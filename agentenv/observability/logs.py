"""Structured server logs (JSON lines with request ids) and per-sandbox log buffers.

Server logs: with `log_format = "json"` (the default) every record is one JSON object on stderr —
`time`, `level`, `logger`, `message`, and `request_id` when the record was made while handling an
HTTP request (the same id the response carries in `X-Request-Id`; a client may send its own).
`log_format = "text"` keeps the classic single-line format for people reading a terminal.

Sandbox logs (`GET /sandboxes/{id}/logs`, `/v2/sandboxes/{id}/logs`): the lifecycle events of a
sandbox plus every server log record that names it (creation, pause, capture timings, failures),
kept per sandbox in bounded buffers, and still readable for a while after the sandbox is gone.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import sys
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from datetime import datetime, timezone

from pythonjsonlogger.json import JsonFormatter

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("agentenv_request_id", default=None)

_SANDBOX_ID = re.compile(r"\bi[a-z0-9]{20}\b")
LEVELS = {"debug": 10, "info": 20, "warn": 30, "error": 40}


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        rid = REQUEST_ID.get()
        if rid is not None and not hasattr(record, "request_id"):
            record.request_id = rid
        return True


def configure_logging(level: str = "INFO", fmt: str = "json") -> None:
    """Root logging for the server process: JSON (default) or text, request ids on both."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "text":
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    else:
        handler.setFormatter(JsonFormatter(
            "{levelname}{name}{message}", style="{", timestamp="time",
            rename_fields={"levelname": "level", "name": "logger"}))
    handler.addFilter(RequestIdFilter())
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))


@dataclass
class LogEntry:
    ts: datetime
    level: str  # debug | info | warn | error
    message: str
    fields: dict[str, str] = field(default_factory=dict)

    def v2(self) -> dict:
        return {"timestamp": self.ts.astimezone(timezone.utc).isoformat().replace("+00:00", "Z"),
                "level": self.level, "message": self.message, "fields": self.fields}

    def v1(self) -> dict:
        """E2B's v1 log: `line` is one JSON object (as E2B's structured sandbox logs are), which is what
        `e2b sandbox logs` parses: level, logger (the source), message and the entry's fields."""
        line = {**self.fields, "level": self.level, "logger": self.fields.get("source", "agentenv"),
                "message": self.message}
        return {"timestamp": self.ts.astimezone(timezone.utc).isoformat().replace("+00:00", "Z"),
                "line": json.dumps(line, separators=(",", ":"))}


class SandboxLogs:
    """Bounded per-sandbox log buffers (LRU over sandboxes, ring per sandbox)."""

    def __init__(self, *, per_sandbox: int = 500, sandboxes: int = 2000) -> None:
        self.per_sandbox = per_sandbox
        self.max_sandboxes = sandboxes
        self._buf: OrderedDict[str, deque[LogEntry]] = OrderedDict()
        self._team: dict[str, str] = {}

    def add(self, sandbox_id: str, entry: LogEntry, team_id: str | None = None) -> None:
        buf = self._buf.get(sandbox_id)
        if buf is None:
            buf = self._buf[sandbox_id] = deque(maxlen=self.per_sandbox)
            while len(self._buf) > self.max_sandboxes:
                old, _ = self._buf.popitem(last=False)
                self._team.pop(old, None)
        else:
            self._buf.move_to_end(sandbox_id)
        if team_id:
            self._team[sandbox_id] = team_id
        buf.append(entry)

    def known(self, sandbox_id: str, team_id: str | None) -> bool:
        if sandbox_id not in self._buf:
            return False
        owner = self._team.get(sandbox_id)
        return team_id is None or owner is None or owner == team_id

    def entries(self, sandbox_id: str) -> list[LogEntry]:
        return list(self._buf.get(sandbox_id, ()))


class SandboxLogHandler(logging.Handler):
    """Copies server log records that name a sandbox id into that sandbox's buffer."""

    def __init__(self, logs: SandboxLogs) -> None:
        super().__init__(logging.INFO)
        self.logs = logs

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001
            return
        ids = set(_SANDBOX_ID.findall(msg))
        if not ids:
            return
        level = "error" if record.levelno >= logging.ERROR else "warn" if record.levelno >= logging.WARNING \
            else "info" if record.levelno >= logging.INFO else "debug"
        entry = LogEntry(datetime.fromtimestamp(record.created, timezone.utc), level, msg,
                         {"logger": record.name, "source": "server"})
        for sid in ids:
            self.logs.add(sid, entry)
