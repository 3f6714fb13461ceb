"""Server configuration: defaults < config file (TOML) < AGENTENV_* environment variables.

Everything the server keeps lives under `data_dir`; see `Paths` for the layout.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, TomlConfigSettingsSource

# How often a cluster node checks its lease (`Settings.fence_timing`).
FENCE_CHECK_S = 0.5


def _config_file() -> Path | None:
    p = os.environ.get("AGENTENV_CONFIG")
    if p:
        return Path(p)
    default = Path("/etc/agentenv/agentenv.toml")
    return default if default.exists() else None


class Settings(BaseSettings):
    """All knobs of a single-node server. Env var = AGENTENV_<FIELD NAME UPPERCASE>."""

    model_config = SettingsConfigDict(env_prefix="AGENTENV_", extra="ignore")

    data_dir: Path = Path("/var/lib/agentenv")
    host: str = "127.0.0.1"
    port: int = 3000
    # Public base URL printed for E2B_API_URL / E2B_SANDBOX_URL (default http://<host>:<port>).
    public_url: str | None = None
    # Domain returned to SDKs for get_host(): "<port>-<sandboxID>.<domain>".
    domain: str | None = None
    # Sandbox traffic (docs/proxy.md): "haproxy" serves it from a supervised HAProxy (the public
    # listeners are HAProxy's; the Python server sits behind it on a unix socket), "python" from the
    # server's own proxy, "auto" = haproxy when the binary is installed.
    data_plane: str = Field(default="auto", pattern=r"^(auto|haproxy|python)$")
    # HAProxy as a component of its own (`agentenv data-plane`, e.g. a sidecar container): the server
    # writes its configuration and maps and drives it through the runtime API, but does not run it.
    haproxy_external: bool = False
    haproxy_path: str = "haproxy"
    # HAProxy's threads; None: half the CPUs, 1 to 4 (the sandboxes need the rest: on 2 cores two
    # threads served 14-34 % fewer requests/s at 32 connections than one, docs/benchmarks.md).
    haproxy_threads: int | None = Field(default=None, ge=1, le=64)
    # HTTPS listener ("addr:port", e.g. "0.0.0.0:443"; needs `domain`, and for `serve` the haproxy data
    # plane; a cluster gateway serves it itself: docs/cluster.md, "HTTPS for clients").
    # Certificate: tls_cert + tls_key (a wildcard for *.<domain> and <domain>), else a local CA that
    # agentenv creates under <data_dir>/tls (its ca.pem printed at start, for clients to trust).
    https_bind: str | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None

    # auto | gvisor | firecracker | qemu (agentenv/runtimes/select.py; docs/runtimes.md). `auto` takes
    # the strongest isolation this host proves it can run; an explicit VM runtime never degrades.
    runtime: str = Field(default="auto", pattern=r"^(auto|gvisor|firecracker|qemu)$")
    # More runtimes this node serves besides `runtime` (the default), comma-separated, e.g. "qemu":
    # a sandbox runs under one of them when its template or its create request (metadata
    # `agentenv.runtime`) asks. Each must run on this host, or the server does not start.
    extra_runtimes: str = Field(default="", pattern=r"^((gvisor|firecracker|qemu)(,(gvisor|firecracker|qemu))*)?$")
    # Firecracker binary (default: scripts/install-firecracker.sh's /usr/local/lib/agentenv/firecracker, then $PATH).
    firecracker_path: str | None = None
    runsc_path: str = "runsc"
    # gVisor platform: "auto" probes this host once (kvm where hardware virtualization works, else
    # systrap, else ptrace; cached per runsc binary and kernel), or an explicit platform, which must
    # work. Env: AGENTENV_RUNSC_PLATFORM or AGENTENV_GVISOR_PLATFORM.
    runsc_platform: str = Field(default="auto", pattern=r"^(auto|systrap|ptrace|kvm)$",
                                validation_alias=AliasChoices("AGENTENV_GVISOR_PLATFORM", "AGENTENV_RUNSC_PLATFORM",
                                                              "runsc_platform"))
    # gVisor checkpoint image compression: "none" (measured faster to write and to restore; see
    # docs/benchmarks.md) or "flate-best-speed" (smaller images to upload).
    runsc_compression: str = Field(default="none", pattern=r"^(none|flate-best-speed)$")
    # How a gVisor checkpoint is asked for: "socket" (the call runsc makes, sent to the sandbox's
    # control socket by agentenv: no runsc start while the sandbox is frozen) or "runsc" (the
    # `runsc checkpoint` command; also what "socket" falls back to when the socket cannot be asked).
    runsc_checkpoint_via: str = Field(default="socket", pattern=r"^(socket|runsc)$")
    # QEMU runtime: binary, machine type (microvm, or q35 where microvm misbehaves) and accelerator
    # ("auto" = KVM on hardware virtualization, TCG otherwise; never PVM, which cannot run the guest).
    qemu_path: str = "qemu-system-x86_64"
    qemu_machine: str = Field(default="microvm", pattern=r"^(microvm|q35|pc)$")
    qemu_accel: str = Field(default="auto", pattern=r"^(auto|kvm|tcg)$")
    debian_mirror: str = "http://deb.debian.org/debian"
    debian_suite: str = "bookworm"

    default_cpu_count: int = 2
    default_memory_mb: int = 1024
    default_disk_mb: int = 4096
    default_timeout_s: int = 300
    max_timeout_s: int = 24 * 3600
    max_sandboxes: int = 200
    # Concurrent (not paused) sandboxes one team may hold, unless its team record overrides it
    # (`agentenv teams set-quota`). Exceeding it answers 429 (E2B SDKs: RateLimitException).
    max_sandboxes_per_team: int = Field(default=100, ge=0)
    max_upload_bytes: int = 1024 * 1024 * 1024
    # Per-sandbox disk quota on the writable layer (the template's disk size): "loop" gives each
    # sandbox's upper its own sparse ext4 image, loop-mounted; "off" lets uppers share the data dir's
    # filesystem. See storage/quota.py and docs/security.md.
    disk_quota: str = Field(default="off", pattern=r"^(loop|off)$")
    # Host memory limit above a sandbox's memory size. Inside the size, envd kills the largest
    # process when the sandbox runs out (like a kernel OOM killer); the host limit, which kills the
    # whole sandbox, is the backstop. 0 = no headroom and no in-sandbox OOM killer.
    memory_headroom_mb: int = Field(default=256, ge=0)
    # CPU weight of all sandboxes together against the host's own processes (cgroup v2 cpu.weight
    # of the `agentenv` parent cgroup; v1 gets the matching cpu.shares). It only matters when the CPU is
    # saturated: then the node's control plane (its event loop, heartbeat, PostgreSQL) runs first and
    # sandboxes share the rest. 100 = the kernel's default (one sandbox-sized peer); 0 = leave it alone.
    sandbox_cpu_weight: int = Field(default=5, ge=0, le=10000)
    # Timer slack of a gVisor sandbox's host threads in µs (prctl PR_SET_TIMERSLACK): fewer idle
    # wake-ups of the Sentry, for coarser timers inside the sandbox and slower request round trips;
    # 0 = left at the kernel's default (50 µs). For hosts of mostly idle sandboxes.
    sandbox_timer_slack_us: int = Field(default=0, ge=0, le=1_000_000)
    # Open files per process inside a sandbox (RLIMIT_NOFILE, soft = hard).
    sandbox_nofile: int = Field(default=65536, ge=64, le=1048576)
    # Bandwidth cap per sandbox and direction in Mbit/s (tc tbf in the slot's netns); 0 = none.
    sandbox_bandwidth_mbit: int = Field(default=0, ge=0)
    fork_max_count: int = Field(default=16, ge=1, le=100)  # children per fork call (E2B allows up to 100)
    # Fork, snapshot and checkpoint leave the source running where the runtime can (gVisor: frozen only
    # for its memory image and a copy of its upper); false: the source is stopped and restored in
    # place after its capture, as on runtimes without the ability (benchmarks compare the two).
    capture_running: bool = True
    # Create sandboxes by restoring a pre-booted, checkpointed sandbox of the template (about 2x
    # faster than booting); built in the background at start, cold boot until it is ready.
    warm_start: bool = True
    # The pool of ready sandboxes (orchestrator/pool.py, docs/architecture.md): per template, this
    # many sandboxes restored from its warm (or built) image ahead of demand and refilled in the
    # background, so a create is envd's /init on one of them. 0 disables it. Needs warm_start for
    # templates without builds. A create with egress rules of its own bypasses the pool.
    pool_size: int = Field(default=2, ge=0, le=64)
    # Which templates get a pool: "*" = the default template `base` from the start and every other
    # template once a sandbox was created from it; or a comma-separated list of names/IDs (pooled
    # from the start, nothing else).
    pool_templates: str = "*"
    # A pooled sandbox waits frozen in the host's cgroup freezer (no CPU: an idle gVisor sandbox
    # otherwise costs 25-47 ms of CPU a second under runsc 20240729), thawed when a create takes it.
    pool_freeze: bool = True
    # The most memory the pool may hold, counted as the sum of its sandboxes' memory sizes (the
    # templates' memoryMB; an idle restored sandbox uses far less): a pool stops filling there.
    pool_memory_mb: int = Field(default=8192, ge=0)
    # Memory pressure drains the pool (and stops refills until it is gone): MemAvailable under this
    # many MiB, or the kernel's memory PSI "some avg10" above pool_max_memory_psi percent.
    pool_min_available_mb: int = Field(default=2048, ge=0)
    pool_max_memory_psi: float = Field(default=10.0, ge=0, le=100)
    # Ready-made templates the server builds at start (in the background) when missing or stale,
    # comma-separated: "code-interpreter" (aliases code-interpreter-v1, the SDK's default).
    builtin_templates: str = ""
    # Wheel directory for the code-interpreter template's Jupyter packages; empty: the server runs
    # `pip download` (host pip configuration/indexes) into <data_dir>/wheelhouse/code-interpreter.
    code_interpreter_wheels: Path | None = None

    # Host-side addressing of sandbox slots: one /30 per slot inside this /16.
    slot_subnet: str = "10.213.0.0/16"
    # Network slots built ahead of demand while the node is quiet (network/spares.py): a create,
    # resume or fork child adopts one instead of building its own (~14 ms less on its path). 0: none.
    network_spare_slots: int = Field(default=16, ge=0, le=256)
    # Tag in the host-global names (netns, root-ns links, nft table) of this instance, so several
    # instances can share one host (test clusters, parallel test runs). Each needs its own slot_subnet.
    # Not starting with "h": its links (ae<tag>h<n>) would match the untagged instance's "aeh*" rules.
    instance: str = Field(default="", pattern=r"^([a-gi-z0-9][a-z0-9]{0,3})?$")
    allow_internet_access: bool = True
    # Destinations a sandbox never reaches (private ranges, CGNAT, link-local/metadata, ...; see
    # agentenv.network.policy) except these CIDRs, opened to every sandbox of the node. JSON list in
    # the env var, e.g. AGENTENV_EGRESS_ALLOW_CIDRS='["10.1.2.3/32"]'. Loopback, the slot subnet and
    # the host's own addresses stay closed whatever this says.
    egress_allow_cidrs: list[str] = Field(default_factory=list)

    @field_validator("egress_allow_cidrs")
    @classmethod
    def _ipv4_cidrs(cls, v: list[str]) -> list[str]:
        import ipaddress

        for entry in v:
            try:
                net = ipaddress.ip_network(entry, strict=False)
            except ValueError:
                raise ValueError(f"egress_allow_cidrs: {entry!r} is not an IPv4 address or CIDR") from None
            if net.version != 4:
                raise ValueError(f"egress_allow_cidrs: {entry!r} is not IPv4 (sandboxes have no IPv6)")
        return v

    # Snapshot store: "local" (a directory; default <data_dir>/snapshots) or "s3" (any S3-compatible store).
    snapshot_store: str = "local"
    # Size budget of this host's artifact cache (layers, memory images, pulled VM drives; MB): over
    # it, artifacts the snapshot store also holds and no local sandbox needs are evicted, least
    # recently used first (pulled again on their next use). Unset: unbounded. Meant for cluster nodes.
    artifact_cache_max_mb: int | None = Field(default=None, ge=1)
    snapshot_dir: Path | None = None
    s3_bucket: str | None = None
    s3_prefix: str = "agentenv/"
    s3_endpoint: str | None = None
    s3_access_key: str | None = None
    s3_secret_key: str | None = None
    s3_region: str = "us-east-1"
    # Garbage collection of the snapshot store (storage/storegc.py): every store_gc_interval_s (0:
    # never) blobs nothing references and last written more than store_gc_grace_s ago are removed.
    # Runs in `agentenv serve` and, in a cluster, in the scheduler only. The grace period must exceed
    # the longest publish (upload of a pause or snapshot); `agentenv gc --store` runs it by hand.
    store_gc_interval_s: float = Field(default=3600.0, ge=0)
    store_gc_grace_s: float = Field(default=3600.0, ge=0)

    # Observability (docs/observability.md). Server logs: "json" (one object per line, request ids)
    # or "text". /metrics is open unless metrics_bearer_token is set (then: that bearer token or an API key).
    log_format: str = Field(default="json", pattern=r"^(json|text)$")
    metrics_bearer_token: str | None = None
    metrics_sample_interval_s: float = Field(default=2.0, gt=0)  # sandbox CPU/memory/disk sampling period
    metrics_history: int = Field(default=900, ge=2)  # samples kept per sandbox (30 min at 2 s)
    events_webhook_url: str | None = None  # every lifecycle event is POSTed here as JSON
    console: bool = True  # the read-only web console at /console

    # --- cluster roles (`agentenv node|gateway|scheduler`; `serve` ignores all but database_url) ---
    # postgresql://user:pass@host:port/db -> the shared PostgreSQL state store; unset -> SQLite in data_dir.
    database_url: str | None = None
    # Shared secret of the internal calls between gateway, scheduler and nodes (X-Agentenv-Cluster-Token).
    cluster_token: str | None = None
    # Mutual TLS between the roles (docs/cluster.md "Internal traffic"; `agentenv cluster ca|cert`):
    # the cluster CA and this role's certificate + key (PEM). Set all three and the internal traffic
    # goes over HTTPS with client certificates; cluster_token is then not needed.
    cluster_ca_file: Path | None = None
    cluster_cert_file: Path | None = None
    cluster_key_file: Path | None = None
    # How often every role looks for a renewed certificate or key file (and reloads it, no restart).
    cluster_cert_reload_s: float = Field(default=30.0, gt=0)
    node_id: str = Field(default_factory=socket.gethostname)
    # URL the other roles use to reach this node's internal API and sandbox traffic.
    node_url: str | None = None
    scheduler_url: str | None = None
    heartbeat_interval_s: float = Field(default=2.0, gt=0)
    node_dead_after_s: float = Field(default=10.0, gt=0)
    # Node lease (docs/cluster.md, "Fencing"): a node whose heartbeats reached neither the state store
    # nor the scheduler for this long stops serving its sandboxes. Unset: 0.6 x node_dead_after_s.
    # Must leave room before the scheduler's deadline (checked by `fence_timing`).
    node_fence_after_s: float | None = Field(default=None, gt=0)
    # On SIGTERM a node agent drains: it stops taking sandboxes and pauses its running ones into the
    # snapshot store (any node resumes them) before it exits, instead of killing them.
    drain_on_stop: bool = True
    drain_timeout_s: float = Field(default=240.0, gt=0)
    # How long a stopping server or cluster role lets requests in flight finish once its listener
    # closed, before it cuts them. Streams (`/events`, command output, logs, proxied WebSockets) count
    # as requests in flight, so this bounds every stop (aiohttp's own default, 60 s, was spent twice:
    # a gateway tailing a node's events outlived a 30 s stop deadline).
    shutdown_grace_s: float = Field(default=10.0, ge=0)
    # Scheduler: sandbox starts in flight per node (starting is the CPU-heavy part of a sandbox's life;
    # more at once only makes every one of them slower).
    max_starting_per_node: int = Field(default=4, ge=1)
    # Gateway: how long a create waits for room in the cluster before the typed 503 (cluster_full).
    admission_wait_s: float = Field(default=20.0, ge=0)

    def fence_after_s(self) -> float:
        return self.node_fence_after_s if self.node_fence_after_s is not None else 0.6 * self.node_dead_after_s

    def fence_timing(self) -> tuple[float, float]:
        """(latest moment a cut-off node has stopped serving, the scheduler's dead-node deadline), both
        counted from the node's last heartbeat that got through; raises ValueError unless the first
        comes at least a second before the second. The node notices a lapsed lease within
        `FENCE_CHECK_S`, then makes one last heartbeat attempt (`heartbeat_interval_s` at most)."""
        stop = self.fence_after_s() + FENCE_CHECK_S + self.heartbeat_interval_s
        if stop + 1.0 > self.node_dead_after_s:
            raise ValueError(
                f"node_fence_after_s ({self.fence_after_s():g}) + {FENCE_CHECK_S:g} + heartbeat_interval_s "
                f"({self.heartbeat_interval_s:g}) + 1 must not exceed node_dead_after_s ({self.node_dead_after_s:g}): "
                "a cut-off node must stop serving its sandboxes before the scheduler declares them lost")
        return stop, self.node_dead_after_s

    # API key created on first start if none exists (printed by `serve`).
    bootstrap_api_key: str | None = Field(default=None)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        cfg = _config_file()
        if cfg is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=cfg))
        return tuple(sources)

    @property
    def paths(self) -> "Paths":
        return Paths(self.data_dir)

    def api_url(self) -> str:
        if self.public_url:
            return self.public_url.rstrip("/")
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"

    def sandbox_domain(self) -> str | None:
        """The `domain` given to SDKs, so `get_host(port)` names a host the proxy serves.

        The configured `domain`, else `localhost:<port>` when the server is reached on loopback
        (`<port>-<id>.localhost:<port>`: curl, browsers and systemd-resolved map `*.localhost` to
        loopback). Otherwise None: a reachable name needs wildcard DNS (docs/proxy.md).
        """
        if self.domain:
            return self.domain
        url = urlsplit(self.api_url())
        if url.hostname in ("127.0.0.1", "localhost", "::1"):
            return f"localhost:{url.port or 80}"
        return None


@dataclass(frozen=True)
class Paths:
    """Layout of the data dir. Everything the server writes lives below `root`."""

    root: Path

    @property
    def images(self) -> Path:  # built base images, the tools layer
        return self.root / "images"

    @property
    def sandboxes(self) -> Path:  # per-sandbox: upper layer, overlay mount, OCI bundle, logs
        return self.root / "sandboxes"

    @property
    def runsc_root(self) -> Path:  # runsc --root (container state)
        return self.root / "run" / "runsc"

    @property
    def state_db(self) -> Path:
        return self.root / "state.db"

    @property
    def snapshots(self) -> Path:
        return self.root / "snapshots"

    def sandbox_dir(self, sandbox_id: str) -> Path:
        return self.sandboxes / sandbox_id

    @property
    def fork_images(self) -> Path:
        """Memory images forks in flight restore their children from (`<source id>-<hex>`), outside
        the sources' dirs: a source killed or paused while its children restore does not touch them.
        Nothing here outlives the server process that made it."""
        return self.root / "fork-images"


def load_settings(**overrides: Any) -> Settings:
    return Settings(**overrides)
