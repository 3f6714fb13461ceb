"""Records the control plane keeps about sandboxes, templates and API keys."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime, timezone


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def rfc3339(dt: datetime) -> str:
    return dt.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")


class SandboxState(str, enum.Enum):
    """Lifecycle states. Transitions are defined in agentenv.orchestrator.lifecycle only."""

    CREATING = "creating"
    RUNNING = "running"
    PAUSING = "pausing"
    PAUSED = "paused"
    RESUMING = "resuming"
    SNAPSHOTTING = "snapshotting"
    FORKING = "forking"
    KILLING = "killing"
    KILLED = "killed"
    FAILED = "failed"
    # Cluster only: its node stopped heartbeating while it ran; kept (and reported) until killed.
    LOST = "lost"

    @property
    def public(self) -> str:
        """The state the E2B API shows: only 'running' or 'paused'."""
        if self in (SandboxState.PAUSED, SandboxState.PAUSING):
            return "paused"
        return "running"


# Cluster node loss (its heartbeats stopped): every sandbox of the node becomes LOST except a paused
# one whose state was published to the snapshot store (`SandboxRecord.memory_digest`, or a
# filesystem-only pause): that one is PAUSED and any other node can resume it, also when the lost
# node was resuming it (RESUMING: the pause image goes only after RUNNING is stored). Here, not in
# orchestrator.lifecycle, because the state stores apply it (state never imports orchestrator).
SURVIVES_NODE_LOSS: frozenset[SandboxState] = frozenset({SandboxState.PAUSED, SandboxState.RESUMING})


# States whose sandboxes do not count against their team's concurrent-sandbox quota (every other
# state does: a start's record stands for it). Here because the state stores count them too.
QUOTA_EXEMPT: frozenset[SandboxState] = frozenset({
    SandboxState.PAUSED, SandboxState.KILLED, SandboxState.KILLING, SandboxState.FAILED, SandboxState.LOST})


def after_node_loss(state: SandboxState, published: bool) -> SandboxState:
    return SandboxState.PAUSED if state in SURVIVES_NODE_LOSS and published else SandboxState.LOST


@dataclass
class SandboxRecord:
    sandbox_id: str
    template_id: str
    team_id: str
    state: SandboxState
    started_at: datetime
    end_at: datetime
    cpu_count: int
    memory_mb: int
    disk_mb: int
    envd_access_token: str
    traffic_access_token: str | None = None
    alias: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    auto_pause: bool = False
    auto_resume: bool = False
    allow_internet_access: bool = True
    network: dict | None = None
    slot: int | None = None  # network slot index while running
    runtime: str = "gvisor"
    node_id: str = "local"
    parent_id: str | None = None  # fork parent
    snapshot_id: str | None = None  # snapshot it was created from
    created_at: datetime = field(default_factory=utcnow)
    # Filesystem chain: base image name + read-only layers (sha256 digests, top first) + the
    # sandbox's own writable upper (in its sandbox dir).
    image: str = "base"
    layers: list[str] = field(default_factory=list)
    pause_mode: str | None = None  # while paused: "full" (checkpoint in the sandbox dir) | "filesystem"
    # Cluster nodes only, while paused: the memory image published to the snapshot store (with the
    # layers), so that any node can resume it.
    memory_digest: str | None = None
    # The checkpoint this sandbox's state last came from (taken, rolled back to, or created from):
    # the parent of its next checkpoint.
    checkpoint_id: str | None = None


@dataclass
class SnapshotRecord:
    """A committed snapshot: filesystem layers (+ memory image unless filesystem-only)."""

    snapshot_id: str
    team_id: str
    names: list[str]
    source_sandbox_id: str | None
    template_id: str
    image: str
    layers: list[str]
    memory_digest: str | None
    cpu_count: int
    memory_mb: int
    disk_mb: int
    env_vars: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    size_bytes: int = 0
    # The envd access token the memory image's envd still holds (needed to re-init a restore).
    restore_token: str | None = None
    created_at: datetime = field(default_factory=utcnow)
    # Egress rules of the source: {"allow_internet_access": bool, "network": dict | None}; a sandbox
    # created from the snapshot gets them unless its create request sets its own.
    network: dict | None = None
    # The runtime that made the memory image (only it can restore it); None: a node's default.
    runtime: str | None = None
    # Checkpoints (time travel): "checkpoint" for a checkpoint, None for a plain snapshot; its parent
    # checkpoint and every ancestor, nearest first (a deleted one is skipped in the tree). Kept in
    # the manifest only (the store's manifest is the truth).
    kind: str | None = None
    parent_id: str | None = None
    ancestors: list[str] = field(default_factory=list)

    def to_manifest(self) -> dict:
        return {
            "snapshotID": self.snapshot_id, "teamID": self.team_id, "names": self.names,
            "sourceSandboxID": self.source_sandbox_id, "templateID": self.template_id, "image": self.image,
            "layers": self.layers, "memory": self.memory_digest, "cpuCount": self.cpu_count,
            "memoryMB": self.memory_mb, "diskSizeMB": self.disk_mb, "envVars": self.env_vars,
            "metadata": self.metadata, "sizeBytes": self.size_bytes, "restoreToken": self.restore_token,
            "createdAt": rfc3339(self.created_at), "network": self.network, "runtime": self.runtime,
            "format": 1, "kind": self.kind, "parentID": self.parent_id, "ancestors": self.ancestors,
        }

    @classmethod
    def from_manifest(cls, m: dict) -> "SnapshotRecord":
        return cls(
            snapshot_id=m["snapshotID"], team_id=m.get("teamID", "default"), names=list(m.get("names", [])),
            source_sandbox_id=m.get("sourceSandboxID"), template_id=m.get("templateID", "base"),
            image=m.get("image", "base"), layers=list(m.get("layers", [])), memory_digest=m.get("memory"),
            cpu_count=int(m.get("cpuCount", 2)), memory_mb=int(m.get("memoryMB", 1024)),
            disk_mb=int(m.get("diskSizeMB", 4096)), env_vars=dict(m.get("envVars", {})),
            metadata=dict(m.get("metadata", {})), size_bytes=int(m.get("sizeBytes", 0)),
            restore_token=m.get("restoreToken"), network=m.get("network"), runtime=m.get("runtime"),
            kind=m.get("kind"), parent_id=m.get("parentID"), ancestors=list(m.get("ancestors") or []),
            created_at=datetime.fromisoformat(m["createdAt"].replace("Z", "+00:00")) if m.get("createdAt")
            else utcnow())


@dataclass
class TemplateRecord:
    template_id: str
    aliases: list[str]
    cpu_count: int
    memory_mb: int
    disk_mb: int
    image: str  # name of the image in the image store, e.g. "base"
    public: bool = True
    created_at: datetime = field(default_factory=utcnow)
    # None: built in (every team sees it); else the team that built it through the template API.
    team_id: str | None = None
    # The runtime its sandboxes (and its builds) run under; None: the node's default.
    runtime: str | None = None


class BuildStatus(str, enum.Enum):
    WAITING = "waiting"
    BUILDING = "building"
    READY = "ready"
    ERROR = "error"


@dataclass
class TemplateBuildRecord:
    """One build of a template: the request, its logs, and what it produced.

    A ready build is a committed snapshot: read-only layers on top of `image` plus a memory image
    of a booted sandbox whose start command is already running, so a create is a restore.
    """

    build_id: str
    template_id: str
    team_id: str
    status: BuildStatus
    cpu_count: int
    memory_mb: int
    disk_mb: int
    created_at: datetime = field(default_factory=utcnow)
    updated_at: datetime = field(default_factory=utcnow)
    finished_at: datetime | None = None
    spec: dict = field(default_factory=dict)  # the build request body (steps, fromImage, startCmd, ...)
    image: str = "base"
    layers: list[str] = field(default_factory=list)
    memory_digest: str | None = None
    restore_token: str | None = None
    env_vars: dict[str, str] = field(default_factory=dict)
    logs: list[dict] = field(default_factory=list)  # {timestamp, level, message, step?}
    reason: dict | None = None  # {message, step?} when status is error
    runtime: str | None = None  # the runtime the build ran under (its memory image needs it)

    def data(self) -> dict:
        return {
            "cpuCount": self.cpu_count, "memoryMB": self.memory_mb, "diskMB": self.disk_mb,
            "updatedAt": rfc3339(self.updated_at),
            "finishedAt": rfc3339(self.finished_at) if self.finished_at else None,
            "spec": self.spec, "image": self.image, "layers": self.layers, "memory": self.memory_digest,
            "restoreToken": self.restore_token, "envVars": self.env_vars, "logs": self.logs,
            "reason": self.reason, "runtime": self.runtime,
        }

    @classmethod
    def from_data(cls, build_id: str, template_id: str, team_id: str, status: str, created_at: datetime,
                  d: dict) -> "TemplateBuildRecord":
        def ts(v: str | None) -> datetime | None:
            return datetime.fromisoformat(v.replace("Z", "+00:00")) if v else None

        return cls(build_id=build_id, template_id=template_id, team_id=team_id, status=BuildStatus(status),
                   cpu_count=int(d.get("cpuCount", 2)), memory_mb=int(d.get("memoryMB", 1024)),
                   disk_mb=int(d.get("diskMB", 4096)), created_at=created_at,
                   updated_at=ts(d.get("updatedAt")) or created_at, finished_at=ts(d.get("finishedAt")),
                   spec=dict(d.get("spec") or {}), image=d.get("image", "base"), layers=list(d.get("layers", [])),
                   memory_digest=d.get("memory"), restore_token=d.get("restoreToken"),
                   env_vars=dict(d.get("envVars") or {}), logs=list(d.get("logs") or []), reason=d.get("reason"),
                   runtime=d.get("runtime"))


@dataclass
class TemplateTag:
    template_id: str
    tag: str
    build_id: str
    created_at: datetime = field(default_factory=utcnow)


@dataclass
class ApiKeyRecord:
    key_id: str
    key_hash: str  # sha256 hex of the full key; the key itself is never stored
    team_id: str
    name: str
    created_at: datetime = field(default_factory=utcnow)
    revoked: bool = False


@dataclass
class TeamRecord:
    """A tenant: API keys belong to a team, and a team sees only its own sandboxes and snapshots."""

    team_id: str
    name: str
    # Concurrent (non-paused) sandboxes this team may hold; None = the server's default.
    max_sandboxes: int | None = None
    created_at: datetime = field(default_factory=utcnow)


@dataclass
class NodeRecord:
    """A cluster node as its heartbeats describe it (the registry the scheduler places by)."""

    node_id: str
    url: str
    state: str = "active"  # active | draining | dead
    cpu_count: int = 1
    memory_mb: int = 0  # physical memory of the node
    max_sandboxes: int = 0
    sandboxes: int = 0  # active (not paused) sandboxes, including ones being created
    alloc_cpu: int = 0  # sum of the active sandboxes' vCPUs
    alloc_memory_mb: int = 0  # sum of the active sandboxes' memory limits
    load: float = 0.0  # 1-minute load average / CPUs (actually used CPU)
    used_memory_mb: int = 0  # memory in use on the node (MemTotal - MemAvailable)
    cached_layers: list[str] = field(default_factory=list)  # layer digests present on the node
    runtimes: list[str] = field(default_factory=list)  # runtimes it serves, its default first ([]: unknown)
    heartbeat_at: datetime = field(default_factory=utcnow)
    started_at: datetime = field(default_factory=utcnow)
