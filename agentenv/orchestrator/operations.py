"""Typed operation requests: one type per orchestrator operation, validated once at the boundary.

In the spirit of Firecracker's `rpc_interface` (one typed action per operation): the HTTP API,
the cluster's internal RPC and internal callers (TTL reaper, drain, wake on traffic) all build one
of these and hand it to `Orchestrator.handle`, which validates it (`validated`: range checks and
defaults; a 400 before anything happens), times and traces it, emits its lifecycle events and
runs its handler. `RPC` is the table the cluster's node agent dispatches through: the method
names on the wire (unchanged: `POST /internal/rpc/<name>` with keyword arguments) → the type.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from agentenv.config import Settings
from agentenv.errors import BadRequest


def check_timeout(settings: Settings, timeout: int) -> None:
    if timeout < 0:
        raise BadRequest("timeout must be >= 0 seconds")
    if timeout > settings.max_timeout_s:
        hours = settings.max_timeout_s // 3600
        raise BadRequest(f"Timeout cannot be greater than {hours} hours")


@dataclass(frozen=True)
class Request:
    op: ClassVar[str] = ""

    def validated(self, settings: Settings) -> "Request":
        """This request with its defaults filled in; BadRequest if a value is out of range."""
        return self


@dataclass(frozen=True)
class CreateSandbox(Request):
    op: ClassVar[str] = "create"
    team_id: str
    template: str
    timeout: int
    metadata: dict[str, str]
    env_vars: dict[str, str]
    secure: bool = True
    auto_pause: bool = False
    auto_resume: bool = False
    allow_internet_access: bool | None = None
    network: dict | None = None

    def validated(self, settings: Settings) -> "CreateSandbox":
        check_timeout(settings, self.timeout)
        return self


@dataclass(frozen=True)
class KillSandbox(Request):
    op: ClassVar[str] = "kill"
    sandbox_id: str
    team_id: str | None = field(default=None, kw_only=True)


@dataclass(frozen=True)
class PauseSandbox(Request):
    op: ClassVar[str] = "pause"
    sandbox_id: str
    team_id: str | None = field(default=None, kw_only=True)
    memory: bool = field(default=True, kw_only=True)


@dataclass(frozen=True)
class ConnectSandbox(Request):
    """Resume a paused sandbox, or extend a running one's timeout."""

    op: ClassVar[str] = "connect"
    sandbox_id: str
    timeout: int
    team_id: str = field(kw_only=True)

    def validated(self, settings: Settings) -> "ConnectSandbox":
        check_timeout(settings, self.timeout)
        return self


@dataclass(frozen=True)
class WakeSandbox(Request):
    """Resume a paused auto-resume sandbox because traffic arrived for it (internal only)."""

    op: ClassVar[str] = "wake"
    sandbox_id: str


@dataclass(frozen=True)
class ForkSandbox(Request):
    op: ClassVar[str] = "fork"
    sandbox_id: str
    team_id: str = field(kw_only=True)
    count: int | None = field(default=None, kw_only=True)
    timeout: int | None = field(default=None, kw_only=True)

    def validated(self, settings: Settings) -> "ForkSandbox":
        count = 1 if self.count is None else self.count
        if not 1 <= count <= settings.fork_max_count:
            raise BadRequest(f"count must be between 1 and {settings.fork_max_count}")
        timeout = settings.default_timeout_s if self.timeout is None else self.timeout
        check_timeout(settings, timeout)
        return replace(self, count=count, timeout=timeout)


@dataclass(frozen=True)
class CreateSnapshot(Request):
    op: ClassVar[str] = "snapshot"
    sandbox_id: str
    team_id: str = field(kw_only=True)
    name: str | None = field(default=None, kw_only=True)
    memory: bool = field(default=True, kw_only=True)

    def validated(self, settings: Settings) -> "CreateSnapshot":
        if self.name is not None and not (0 < len(self.name) <= 128 and self.name.isprintable()):
            raise BadRequest("snapshot name must be 1-128 printable characters")
        return self


@dataclass(frozen=True)
class CreateCheckpoint(Request):
    """Time travel: capture a running sandbox (it keeps running) as a checkpoint with a parent."""

    op: ClassVar[str] = "checkpoint"
    sandbox_id: str
    team_id: str = field(kw_only=True)
    name: str | None = field(default=None, kw_only=True)
    metadata: dict[str, str] | None = field(default=None, kw_only=True)

    def validated(self, settings: Settings) -> "CreateCheckpoint":
        if self.name is not None and not (0 < len(self.name) <= 128 and self.name.isprintable()):
            raise BadRequest("checkpoint name must be 1-128 printable characters")
        meta = self.metadata or {}
        if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
            raise BadRequest("checkpoint metadata must be an object of string values")
        if len(meta) > 64 or sum(len(k) + len(v) for k, v in meta.items()) > 16384:
            raise BadRequest("checkpoint metadata is limited to 64 keys and 16 KiB")
        return replace(self, metadata=dict(meta))


@dataclass(frozen=True)
class RollbackSandbox(Request):
    """Time travel: replace a running sandbox's memory, processes and files with a checkpoint's."""

    op: ClassVar[str] = "rollback"
    sandbox_id: str
    checkpoint_id: str
    team_id: str = field(kw_only=True)

    def validated(self, settings: Settings) -> "RollbackSandbox":
        if not isinstance(self.checkpoint_id, str) or not self.checkpoint_id:
            raise BadRequest("checkpointID is required")
        return self


@dataclass(frozen=True)
class ListCheckpoints(Request):
    op: ClassVar[str] = "list_checkpoints"
    sandbox_id: str
    team_id: str = field(kw_only=True)


@dataclass(frozen=True)
class CheckpointTree(Request):
    op: ClassVar[str] = "checkpoint_tree"
    checkpoint_id: str
    team_id: str = field(kw_only=True)


@dataclass(frozen=True)
class SetTimeout(Request):
    op: ClassVar[str] = "set_timeout"
    sandbox_id: str
    timeout: int
    team_id: str = field(kw_only=True)

    def validated(self, settings: Settings) -> "SetTimeout":
        check_timeout(settings, self.timeout)
        return self


@dataclass(frozen=True)
class Refresh(Request):
    op: ClassVar[str] = "refresh"
    sandbox_id: str
    duration: int
    team_id: str = field(kw_only=True)

    def validated(self, settings: Settings) -> "Refresh":
        if self.duration < 0 or self.duration > 3600:
            raise BadRequest("duration must be between 0 and 3600 seconds")
        return self


@dataclass(frozen=True)
class UpdateNetwork(Request):
    op: ClassVar[str] = "update_network"
    sandbox_id: str
    update: dict
    team_id: str = field(kw_only=True)


@dataclass(frozen=True)
class GetSandbox(Request):
    op: ClassVar[str] = "get_sandbox"
    sandbox_id: str
    team_id: str = field(kw_only=True)


@dataclass(frozen=True)
class ListSandboxes(Request):
    op: ClassVar[str] = "list_sandboxes"
    team_id: str = field(kw_only=True)


@dataclass(frozen=True)
class ListTemplates(Request):
    op: ClassVar[str] = "list_templates"
    team_id: str | None = None


@dataclass(frozen=True)
class ListSnapshots(Request):
    op: ClassVar[str] = "list_snapshots"
    team_id: str = field(kw_only=True)
    sandbox_id: str | None = field(default=None, kw_only=True)
    name: str | None = field(default=None, kw_only=True)


@dataclass(frozen=True)
class GetSnapshot(Request):
    op: ClassVar[str] = "get_snapshot"
    snapshot_id_or_name: str
    team_id: str = field(kw_only=True)


@dataclass(frozen=True)
class DeleteSnapshot(Request):
    op: ClassVar[str] = "delete_snapshot"
    snapshot_id_or_name: str
    team_id: str = field(kw_only=True)


@dataclass(frozen=True)
class AdoptSandbox(Request):
    """Cluster: take over a paused sandbox of another node (its state is in the snapshot store)."""

    op: ClassVar[str] = "adopt"
    sandbox_id: str
    from_node: str = field(kw_only=True)


@dataclass(frozen=True)
class ReleaseSandbox(Request):
    """Cluster: forget a paused sandbox another node took over (its local files are stale)."""

    op: ClassVar[str] = "release"
    sandbox_id: str


# The cluster's internal RPC: wire method name -> request type (agentenv/cluster/node.py).
RPC: dict[str, type[Request]] = {
    "create_sandbox": CreateSandbox,
    "list_sandboxes": ListSandboxes,
    "get_sandbox": GetSandbox,
    "kill_sandbox": KillSandbox,
    "set_timeout": SetTimeout,
    "refresh": Refresh,
    "connect_sandbox": ConnectSandbox,
    "pause_sandbox": PauseSandbox,
    "fork_sandbox": ForkSandbox,
    "create_snapshot": CreateSnapshot,
    "list_snapshots": ListSnapshots,
    "get_snapshot": GetSnapshot,
    "delete_snapshot": DeleteSnapshot,
    "list_templates": ListTemplates,
    "adopt_sandbox": AdoptSandbox,
    "release_sandbox": ReleaseSandbox,
    "update_network": UpdateNetwork,
    "create_checkpoint": CreateCheckpoint,
    "rollback_sandbox": RollbackSandbox,
    "list_checkpoints": ListCheckpoints,
    "checkpoint_tree": CheckpointTree,
}


def from_rpc(method: str, kwargs: dict[str, Any]) -> Request:
    """The request an internal RPC call stands for; BadRequest for an unknown method or arguments."""
    cls = RPC.get(method)
    if cls is None:
        raise BadRequest(f"no internal method {method!r}")
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise BadRequest(f"bad arguments for internal method {method!r}: {e}") from e
