"""Records <-> rows of the state store's tables (`schema.py`); the same on every database."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from agentenv.models import (ApiKeyRecord, NodeRecord, SandboxRecord, SandboxState, SnapshotRecord, TeamRecord,
                             TemplateBuildRecord, TemplateRecord, TemplateTag)

Row = Mapping[str, Any]


def ts(dt: datetime) -> str:
    """Fixed-width UTC ISO text: string order is time order."""
    if dt.tzinfo is None:
        raise ValueError(f"naive datetime {dt!r}: the state store only accepts timezone-aware times")
    return dt.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f+00:00")


def dt(s: str) -> datetime:
    return datetime.fromisoformat(s)


def _opt_json(v: Any) -> str | None:
    return None if v is None else json.dumps(v)


def _opt_load(s: str | None) -> Any:
    return None if s is None else json.loads(s)


def sandbox_values(rec: SandboxRecord) -> dict[str, Any]:
    return {
        "sandbox_id": rec.sandbox_id, "template_id": rec.template_id, "team_id": rec.team_id,
        "state": SandboxState(rec.state).value, "started_at": ts(rec.started_at), "end_at": ts(rec.end_at),
        "cpu_count": rec.cpu_count, "memory_mb": rec.memory_mb, "disk_mb": rec.disk_mb,
        "envd_access_token": rec.envd_access_token, "traffic_access_token": rec.traffic_access_token,
        "alias": rec.alias, "metadata": json.dumps(rec.metadata), "env_vars": json.dumps(rec.env_vars),
        "auto_pause": int(rec.auto_pause), "auto_resume": int(rec.auto_resume),
        "allow_internet_access": int(rec.allow_internet_access), "network": _opt_json(rec.network),
        "slot": rec.slot, "runtime": rec.runtime, "node_id": rec.node_id, "parent_id": rec.parent_id,
        "snapshot_id": rec.snapshot_id, "created_at": ts(rec.created_at), "image": rec.image,
        "layers": json.dumps(list(rec.layers)), "pause_mode": rec.pause_mode, "memory_digest": rec.memory_digest,
        "checkpoint_id": rec.checkpoint_id,
    }


def sandbox(row: Row) -> SandboxRecord:
    return SandboxRecord(
        sandbox_id=row["sandbox_id"], template_id=row["template_id"], team_id=row["team_id"],
        state=SandboxState(row["state"]), started_at=dt(row["started_at"]), end_at=dt(row["end_at"]),
        cpu_count=row["cpu_count"], memory_mb=row["memory_mb"], disk_mb=row["disk_mb"],
        envd_access_token=row["envd_access_token"], traffic_access_token=row["traffic_access_token"],
        alias=row["alias"], metadata=json.loads(row["metadata"]), env_vars=json.loads(row["env_vars"]),
        auto_pause=bool(row["auto_pause"]), auto_resume=bool(row["auto_resume"]),
        allow_internet_access=bool(row["allow_internet_access"]), network=_opt_load(row["network"]),
        slot=row["slot"], runtime=row["runtime"], node_id=row["node_id"], parent_id=row["parent_id"],
        snapshot_id=row["snapshot_id"], created_at=dt(row["created_at"]), image=row["image"],
        layers=json.loads(row["layers"]), pause_mode=row["pause_mode"], memory_digest=row["memory_digest"],
        checkpoint_id=row["checkpoint_id"],
    )


def template_values(rec: TemplateRecord) -> dict[str, Any]:
    return {
        "template_id": rec.template_id, "aliases": json.dumps(list(rec.aliases)), "cpu_count": rec.cpu_count,
        "memory_mb": rec.memory_mb, "disk_mb": rec.disk_mb, "image": rec.image, "public": int(rec.public),
        "created_at": ts(rec.created_at), "team_id": rec.team_id, "runtime": rec.runtime,
    }


def template(row: Row) -> TemplateRecord:
    return TemplateRecord(
        template_id=row["template_id"], aliases=json.loads(row["aliases"]), cpu_count=row["cpu_count"],
        memory_mb=row["memory_mb"], disk_mb=row["disk_mb"], image=row["image"], public=bool(row["public"]),
        created_at=dt(row["created_at"]), team_id=row["team_id"], runtime=row["runtime"],
    )


def build_values(rec: TemplateBuildRecord) -> dict[str, Any]:
    return {"build_id": rec.build_id, "template_id": rec.template_id, "team_id": rec.team_id,
            "status": rec.status.value, "created_at": ts(rec.created_at), "data": json.dumps(rec.data())}


def build(row: Row) -> TemplateBuildRecord:
    return TemplateBuildRecord.from_data(row["build_id"], row["template_id"], row["team_id"], row["status"],
                                         dt(row["created_at"]), json.loads(row["data"]))


def tag_values(rec: TemplateTag) -> dict[str, Any]:
    return {"template_id": rec.template_id, "tag": rec.tag, "build_id": rec.build_id,
            "created_at": ts(rec.created_at)}


def tag(row: Row) -> TemplateTag:
    return TemplateTag(row["template_id"], row["tag"], row["build_id"], dt(row["created_at"]))


def key_values(rec: ApiKeyRecord) -> dict[str, Any]:
    return {"key_id": rec.key_id, "key_hash": rec.key_hash, "team_id": rec.team_id, "name": rec.name,
            "created_at": ts(rec.created_at), "revoked": int(rec.revoked)}


def key(row: Row) -> ApiKeyRecord:
    return ApiKeyRecord(key_id=row["key_id"], key_hash=row["key_hash"], team_id=row["team_id"], name=row["name"],
                        created_at=dt(row["created_at"]), revoked=bool(row["revoked"]))


def team_values(rec: TeamRecord) -> dict[str, Any]:
    return {"team_id": rec.team_id, "name": rec.name, "max_sandboxes": rec.max_sandboxes,
            "created_at": ts(rec.created_at)}


def team(row: Row) -> TeamRecord:
    return TeamRecord(team_id=row["team_id"], name=row["name"], max_sandboxes=row["max_sandboxes"],
                      created_at=dt(row["created_at"]))


def snapshot_values(rec: SnapshotRecord) -> dict[str, Any]:
    return {
        "snapshot_id": rec.snapshot_id, "team_id": rec.team_id, "names": json.dumps(list(rec.names)),
        "source_sandbox_id": rec.source_sandbox_id, "template_id": rec.template_id, "image": rec.image,
        "layers": json.dumps(list(rec.layers)), "memory_digest": rec.memory_digest, "cpu_count": rec.cpu_count,
        "memory_mb": rec.memory_mb, "disk_mb": rec.disk_mb, "env_vars": json.dumps(rec.env_vars),
        "metadata": json.dumps(rec.metadata), "size_bytes": rec.size_bytes, "restore_token": rec.restore_token,
        "created_at": ts(rec.created_at), "network": _opt_json(rec.network), "runtime": rec.runtime,
    }


def snapshot(row: Row) -> SnapshotRecord:
    return SnapshotRecord(
        snapshot_id=row["snapshot_id"], team_id=row["team_id"], names=json.loads(row["names"]),
        source_sandbox_id=row["source_sandbox_id"], template_id=row["template_id"], image=row["image"],
        layers=json.loads(row["layers"]), memory_digest=row["memory_digest"], cpu_count=row["cpu_count"],
        memory_mb=row["memory_mb"], disk_mb=row["disk_mb"], env_vars=json.loads(row["env_vars"]),
        metadata=json.loads(row["metadata"]), size_bytes=row["size_bytes"], restore_token=row["restore_token"],
        created_at=dt(row["created_at"]), network=_opt_load(row["network"]), runtime=row["runtime"],
    )


NODE_INFO = ("cpu_count", "memory_mb", "max_sandboxes", "sandboxes", "alloc_cpu", "alloc_memory_mb", "load",
             "used_memory_mb", "cached_layers", "runtimes")


def node_info(rec: NodeRecord) -> str:
    return json.dumps({k: getattr(rec, k) for k in NODE_INFO})


def node(row: Row) -> NodeRecord:
    info = json.loads(row["info"])
    return NodeRecord(node_id=row["node_id"], url=row["url"], state=row["state"], heartbeat_at=row["heartbeat_at"],
                      started_at=row["started_at"], **{k: info[k] for k in NODE_INFO if k in info})
