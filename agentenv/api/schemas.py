"""Request models and response serializers, written from agentenv/api/openapi.yaml.

Requests are strict on types (`"5"` is not a timeout, `1` is not a bool) and ignore unknown fields,
as E2B does, so newer SDKs sending extra fields keep working.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from agentenv.config import Settings
from agentenv.constants import CLIENT_ID, ENVD_VERSION
from agentenv.errors import AgentEnvError
from agentenv.models import (ApiKeyRecord, BuildStatus, SandboxRecord, SnapshotRecord, TeamRecord,
                             TemplateBuildRecord, TemplateRecord, rfc3339)


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=False)


class AutoResumeConfig(_Body):
    enabled: bool


class EgressProxy(_Body):
    address: str
    username: str | None = None
    password: str | None = None


class NetworkConfig(_Body):
    """Validated for types, then handed to the orchestrator as a camelCase dict of the known fields sent."""

    allow_public_traffic: bool | None = Field(default=None, alias="allowPublicTraffic")
    allow_out: list[str] | None = Field(default=None, alias="allowOut")
    deny_out: list[str] | None = Field(default=None, alias="denyOut")
    dns_servers: list[str] | None = Field(default=None, alias="dnsServers")
    egress_proxy: EgressProxy | None = Field(default=None, alias="egressProxy")
    mask_request_host: str | None = Field(default=None, alias="maskRequestHost")
    https_ports: list[int] | None = Field(default=None, alias="httpsPorts")
    rules: dict[str, list[dict[str, Any]]] | None = None

    def wire(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_unset=True)


class NewTeamAPIKey(_Body):
    name: str = Field(min_length=1, max_length=200)


class NewSandboxV2(_Body):
    template_id: str = Field(alias="templateID", min_length=1)
    timeout: int | None = None  # default applied by the handler (settings)
    auto_pause: bool = Field(default=False, alias="autoPause")
    auto_pause_memory: bool = Field(default=True, alias="autoPauseMemory")
    auto_resume: AutoResumeConfig | None = Field(default=None, alias="autoResume")
    allow_internet_access: bool | None = None
    network: NetworkConfig | None = None
    metadata: dict[str, str] | None = None
    env_vars: dict[str, str] | None = Field(default=None, alias="envVars")
    # Accepted as E2B does: `mcp` is only recorded (the SDK starts the gateway itself); a create with
    # volume mounts or workload-identity tokens is refused (agentenv/api/compat.py).
    mcp: dict[str, Any] | None = None
    volume_mounts: list[dict[str, Any]] | None = Field(default=None, alias="volumeMounts")
    iam: dict[str, Any] | None = None


class NewSandbox(NewSandboxV2):
    """Legacy v1 create body: adds `secure`; its documented default timeout is 15 s."""

    secure: bool = False


V1_DEFAULT_TIMEOUT = 15


class ConnectSandbox(_Body):
    timeout: int
    memory: bool | None = None


class ConnectSandboxV2(_Body):
    timeout: int | None = None
    memory: bool | None = None


class ResumedSandbox(_Body):
    timeout: int = V1_DEFAULT_TIMEOUT
    auto_pause: bool | None = Field(default=None, alias="autoPause")
    memory: bool | None = None


class SandboxTimeoutRequest(_Body):
    timeout: int


class NetworkUpdate(_Body):
    """PUT /sandboxes/{id}/network: the egress fields replace the current ones (omitted = cleared)."""

    allow_out: list[str] | None = Field(default=None, alias="allowOut")
    deny_out: list[str] | None = Field(default=None, alias="denyOut")
    dns_servers: list[str] | None = Field(default=None, alias="dnsServers")
    egress_proxy: EgressProxy | None = Field(default=None, alias="egressProxy")
    rules: dict[str, list[dict[str, Any]]] | None = None
    allow_internet_access: bool | None = None

    def wire(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_unset=True)


REFRESH_DEFAULT_S = 15
REFRESH_MAX_S = 3600


class SandboxRefreshRequest(_Body):
    duration: int = Field(default=REFRESH_DEFAULT_S, ge=0, le=REFRESH_MAX_S)


class SandboxPauseRequest(_Body):
    memory: bool = True  # false: filesystem-only pause (resume cold-boots)
    require_healthy_guest: bool | None = Field(default=None, alias="requireHealthyGuest")  # accepted, ignored


class SandboxForkRequest(_Body):
    timeout: int | None = None  # None: the orchestrator's default; range checked by the handler
    count: int | None = None  # None: one fork; range (1..settings.fork_max_count) checked by the handler


SNAPSHOT_NAME_MAX = 255


class SandboxSnapshotRequest(_Body):
    name: str | None = Field(default=None, min_length=1, max_length=SNAPSHOT_NAME_MAX)
    memory: bool = True  # false: filesystem-only snapshot


class CheckpointRequest(_Body):
    name: str | None = Field(default=None, min_length=1, max_length=SNAPSHOT_NAME_MAX)
    metadata: dict[str, str] | None = None


class RollbackRequest(_Body):
    checkpointID: str = Field(min_length=1, max_length=256)


class TemplateBuildRequestV3(_Body):
    name: str | None = Field(default=None, min_length=1, max_length=256)
    alias: str | None = Field(default=None, min_length=1, max_length=256)
    tags: list[str] | None = None
    cpu_count: int | None = Field(default=None, alias="cpuCount")
    memory_mb: int | None = Field(default=None, alias="memoryMB")
    min_free_disk_mb: int | None = Field(default=None, alias="minFreeDiskMb")


class TemplateStep(_Body):
    type: str = Field(min_length=1)
    args: list[str] | None = None
    files_hash: str | None = Field(default=None, alias="filesHash")
    force: bool | None = None
    force_upload: bool | None = Field(default=None, alias="forceUpload")


class RegistryConfig(_Body):
    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=False)
    type: str | None = None
    username: str | None = None
    password: str | None = None


class TemplateBuildStartV2(_Body):
    from_image: str | None = Field(default=None, alias="fromImage")
    from_template: str | None = Field(default=None, alias="fromTemplate")
    from_image_registry: RegistryConfig | None = Field(default=None, alias="fromImageRegistry")
    force: bool | None = None
    steps: list[TemplateStep] | None = None
    start_cmd: str | None = Field(default=None, alias="startCmd")
    ready_cmd: str | None = Field(default=None, alias="readyCmd")

    def spec(self) -> dict[str, Any]:
        """The build request as the builder consumes it (E2B's field names)."""
        out: dict[str, Any] = {"force": bool(self.force), "steps": [
            {"type": st.type.upper(), "args": list(st.args or []), "filesHash": st.files_hash, "force": bool(st.force)}
            for st in (self.steps or [])]}
        for key, val in (("fromImage", self.from_image), ("fromTemplate", self.from_template),
                         ("startCmd", self.start_cmd), ("readyCmd", self.ready_cmd)):
            if val:
                out[key] = val
        if self.from_image_registry is not None:
            out["fromImageRegistry"] = self.from_image_registry.model_dump(exclude_none=True)
        return out


class AssignTemplateTagsRequest(_Body):
    target: str = Field(min_length=1)
    tags: list[str] = Field(min_length=1)


class TemplateUpdateRequest(_Body):
    """PATCH /templates/{id} and /v2/templates/{id} (the E2B CLI's `template publish`/`unpublish`)."""

    public: bool | None = None


class DeleteTemplateTagsRequest(_Body):
    name: str = Field(min_length=1)
    tags: list[str] = Field(min_length=1)


# --- responses ------------------------------------------------------------------------------------


def sandbox_json(rec: SandboxRecord, settings: Settings) -> dict[str, Any]:
    """`Sandbox`: what create/connect/resume return."""
    out: dict[str, Any] = {
        "templateID": rec.template_id,
        "sandboxID": rec.sandbox_id,
        "clientID": CLIENT_ID,
        "envdVersion": ENVD_VERSION,
        "trafficAccessToken": rec.traffic_access_token,
        "domain": settings.sandbox_domain(),
    }
    if rec.alias:
        out["alias"] = rec.alias
    if rec.envd_access_token:
        out["envdAccessToken"] = rec.envd_access_token
    return out


def _listed_common(rec: SandboxRecord) -> dict[str, Any]:
    out: dict[str, Any] = {
        "templateID": rec.template_id,
        "sandboxID": rec.sandbox_id,
        "clientID": CLIENT_ID,
        "startedAt": rfc3339(rec.started_at),
        "endAt": rfc3339(rec.end_at),
        "envdVersion": ENVD_VERSION,
        "cpuCount": rec.cpu_count,
        "memoryMB": rec.memory_mb,
        "diskSizeMB": rec.disk_mb,
        "state": rec.state.public,
        "metadata": dict(rec.metadata),
        "runtime": rec.runtime,
    }
    if rec.alias:
        out["alias"] = rec.alias
    return out


def listed_sandbox_json(rec: SandboxRecord) -> dict[str, Any]:
    """`ListedSandbox`: one entry of GET /sandboxes and GET /v2/sandboxes."""
    return _listed_common(rec)


def sandbox_detail_json(rec: SandboxRecord, settings: Settings) -> dict[str, Any]:
    """`SandboxDetail`: GET /sandboxes/{id} (1.x SDKs also connect through it, hence the token)."""
    out = _listed_common(rec)
    out["domain"] = settings.sandbox_domain()
    out["allowInternetAccess"] = rec.allow_internet_access
    out["lifecycle"] = {"autoResume": rec.auto_resume, "onTimeout": "pause" if rec.auto_pause else "kill"}
    if rec.envd_access_token:
        out["envdAccessToken"] = rec.envd_access_token
    if rec.network is not None:
        out["network"] = rec.network
    if rec.state.value == "paused" and rec.pause_mode in ("full", "filesystem"):
        out["pauseMode"] = rec.pause_mode  # what the pause saved (omitted while pausing, as in E2B)
    return out


def template_json(rec: TemplateRecord) -> dict[str, Any]:
    """`Template`: E2B requires build bookkeeping fields we don't track; report one ready build."""
    created = rfc3339(rec.created_at)
    return {
        "templateID": rec.template_id,
        "buildID": rec.template_id,
        "cpuCount": rec.cpu_count,
        "memoryMB": rec.memory_mb,
        "diskSizeMB": rec.disk_mb,
        "public": rec.public,
        "aliases": list(rec.aliases),
        "names": list(rec.aliases),
        "createdAt": created,
        "updatedAt": created,
        "createdBy": None,
        "lastSpawnedAt": None,
        "spawnCount": 0,
        "buildCount": 1,
        "envdVersion": ENVD_VERSION,
        "buildStatus": "ready",
        "runtime": rec.runtime,  # agentenv: the runtime its sandboxes run under (null: the node default)
    }


def template_with_builds_json(rec: TemplateRecord, builds: list[TemplateBuildRecord]) -> dict[str, Any]:
    """`Template` (+ `builds` for GET /templates/{id}) of a template with or without API builds."""
    out = template_json(rec)
    if builds:
        latest = builds[-1]
        ready = [b for b in builds if b.status == BuildStatus.READY]
        out.update(buildID=(ready[-1] if ready else latest).build_id, buildCount=len(builds),
                   buildStatus=latest.status.value, updatedAt=rfc3339(latest.updated_at),
                   cpuCount=latest.cpu_count, memoryMB=latest.memory_mb)
    out["builds"] = [template_build_json(b) for b in builds]
    return out


def template_build_json(b: TemplateBuildRecord) -> dict[str, Any]:
    out = {"buildID": b.build_id, "status": b.status.value, "createdAt": rfc3339(b.created_at),
           "updatedAt": rfc3339(b.updated_at), "cpuCount": b.cpu_count, "memoryMB": b.memory_mb,
           "diskSizeMB": b.disk_mb, "envdVersion": ENVD_VERSION}
    if b.finished_at:
        out["finishedAt"] = rfc3339(b.finished_at)
    return out


def build_status_json(b: TemplateBuildRecord, offset: int, limit: int, level: str | None) -> dict[str, Any]:
    order = ["debug", "info", "warn", "error"]
    entries = b.logs
    if level:
        entries = [e for e in entries if order.index(e.get("level", "info")) >= order.index(level)]
    page = entries[offset:offset + limit]
    out: dict[str, Any] = {"templateID": b.template_id, "buildID": b.build_id, "status": b.status.value,
                           "logs": [f"[{e['timestamp']}] {e['message']}" for e in page], "logEntries": page}
    if b.reason:
        out["reason"] = {**b.reason, "logEntries": [e for e in b.logs if e.get("level") == "error"][-20:]}
    return out


def snapshot_info_json(rec: SnapshotRecord) -> dict[str, Any]:
    """`SnapshotInfo`: the SDK reads `snapshotID` and `names`; the rest is informative."""
    return {
        "snapshotID": rec.snapshot_id,
        "names": list(rec.names),
        "sourceSandboxID": rec.source_sandbox_id,
        "templateID": rec.template_id,
        "memory": rec.memory_digest is not None,
        "cpuCount": rec.cpu_count,
        "memoryMB": rec.memory_mb,
        "diskSizeMB": rec.disk_mb,
        "sizeBytes": rec.size_bytes,
        "createdAt": rfc3339(rec.created_at),
    }


def checkpoint_json(rec: SnapshotRecord) -> dict[str, Any]:
    """A checkpoint (time travel): a snapshot with a parent; its id works wherever a snapshot id does."""
    return {
        "checkpointID": rec.snapshot_id,
        "parentID": rec.parent_id,
        "sandboxID": rec.source_sandbox_id,
        "name": rec.names[0] if rec.names else None,
        "metadata": dict(rec.metadata) if rec.kind == "checkpoint" else {},
        "createdAt": rfc3339(rec.created_at),
        "sizeBytes": rec.size_bytes,
        "kind": rec.kind or "snapshot",
    }


def fork_result_json(item: SandboxRecord | AgentEnvError, settings: Settings) -> dict[str, Any]:
    """`SandboxForkResult`: the created sandbox (as create returns it) or why that one fork failed."""
    if isinstance(item, AgentEnvError):
        return {"error": item.to_json()}
    return {"sandbox": sandbox_json(item, settings)}


def team_json(team: TeamRecord, max_sandboxes: int) -> dict[str, Any]:
    return {"teamID": team.team_id, "name": team.name, "isDefault": True, "maxSandboxes": max_sandboxes}


def api_key_json(rec: ApiKeyRecord, key: str | None = None) -> dict[str, Any]:
    """`TeamAPIKey` (plus `key` right after creation: the only time the plaintext exists)."""
    out: dict[str, Any] = {"id": rec.key_id, "name": rec.name, "createdAt": rfc3339(rec.created_at),
                           "revoked": rec.revoked}
    if key is not None:
        out["key"] = key
    return out
