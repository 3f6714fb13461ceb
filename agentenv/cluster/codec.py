"""JSON encoding of the orchestrator's values for the internal node RPC.

Records travel as tagged dicts (dataclass fields; times as ISO text), errors as their status,
message, error code and headers, so a typed error raised on a node is raised again, unchanged, in
the gateway (a 503 keeps its Retry-After).
"""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any

from agentenv.errors import AgentEnvError
from agentenv.models import NodeRecord, SandboxRecord, SandboxState, SnapshotRecord, TemplateRecord

_TYPES: dict[str, type] = {"sandbox": SandboxRecord, "snapshot": SnapshotRecord, "template": TemplateRecord,
                           "node": NodeRecord}
_TAGS = {v: k for k, v in _TYPES.items()}


def encode(obj: Any) -> Any:
    if isinstance(obj, AgentEnvError):
        return {"__t": "error", "status": obj.status, "message": obj.message, "error_code": obj.error_code,
                "headers": obj.headers}
    tag = _TAGS.get(type(obj))
    if tag is not None:
        out: dict[str, Any] = {"__t": tag}
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            out[f.name] = v.isoformat() if isinstance(v, datetime) else (v.value if isinstance(v, SandboxState) else v)
        return out
    if isinstance(obj, (list, tuple)):
        return [encode(x) for x in obj]
    return obj


def decode(obj: Any) -> Any:
    if isinstance(obj, list):
        return [decode(x) for x in obj]
    if not isinstance(obj, dict) or "__t" not in obj:
        return obj
    tag = obj["__t"]
    if tag == "error":
        return error_from(obj)
    cls = _TYPES[tag]
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in obj:
            continue
        v = obj[f.name]
        if f.name.endswith("_at") and isinstance(v, str):
            v = datetime.fromisoformat(v)
        elif f.name == "state" and cls is SandboxRecord:
            v = SandboxState(v)
        kw[f.name] = v
    return cls(**kw)


def error_from(body: dict, status: int | None = None, headers: dict | None = None) -> AgentEnvError:
    return AgentEnvError(str(body.get("message", "error")), error_code=body.get("error_code"),
                         status=int(body.get("status") or body.get("code") or status or 500),
                         headers=dict(body.get("headers") or headers or {}))
