"""The state store's schema, once, for SQLite and PostgreSQL (SQLAlchemy Core).

This is the *current* schema: the store's queries are built from these tables, and
`tests/state/test_migrations.py` checks that the migration history (`migrations/versions`, Alembic)
produces exactly it on both databases. Change a table here only together with a new revision.

Row format (unchanged from the hand-written stores, so old databases keep their rows): dicts and
lists are JSON text, booleans 0/1 integers, record times fixed-width UTC ISO text (string order is
time order). Only the node registry uses native timestamps (`UTCDateTime`): PostgreSQL's clock
stamps heartbeats there.
"""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import (BigInteger, Column, DateTime, Index, Integer, MetaData, PrimaryKeyConstraint, Table, Text,
                        text)
from sqlalchemy.types import TypeDecorator

metadata = MetaData()

# SQLite's integer is 64-bit and its canonical type name INTEGER; PostgreSQL needs BIGINT for sizes.
BigInt = BigInteger().with_variant(Integer(), "sqlite")


class UTCDateTime(TypeDecorator):
    """Timezone-aware datetimes on both databases: TIMESTAMPTZ on PostgreSQL; on SQLite (no time
    zones) naive UTC text, given back as UTC."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: the state store only accepts timezone-aware times")
        value = value.astimezone(timezone.utc)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect) -> datetime | None:
        if value is None or value.tzinfo is not None:
            return value
        return value.replace(tzinfo=timezone.utc)


def _json(name: str, default: str) -> Column:
    return Column(name, Text, nullable=False, server_default=text(f"'{default}'"))


def _flag(name: str, default: int) -> Column:
    return Column(name, Integer, nullable=False, server_default=text(str(default)))


sandboxes = Table(
    "sandboxes", metadata,
    Column("sandbox_id", Text, primary_key=True),
    Column("template_id", Text, nullable=False),
    Column("team_id", Text, nullable=False),
    Column("state", Text, nullable=False),
    Column("started_at", Text, nullable=False),
    Column("end_at", Text, nullable=False),
    Column("cpu_count", Integer, nullable=False),
    Column("memory_mb", Integer, nullable=False),
    Column("disk_mb", Integer, nullable=False),
    Column("envd_access_token", Text, nullable=False),
    Column("traffic_access_token", Text),
    Column("alias", Text),
    _json("metadata", "{}"),
    _json("env_vars", "{}"),
    _flag("auto_pause", 0),
    _flag("auto_resume", 0),
    _flag("allow_internet_access", 1),
    Column("network", Text),
    Column("slot", Integer),
    Column("runtime", Text, nullable=False),
    Column("node_id", Text, nullable=False),
    Column("parent_id", Text),
    Column("snapshot_id", Text),
    Column("created_at", Text, nullable=False),
    Column("image", Text, nullable=False, server_default=text("'base'")),
    _json("layers", "[]"),
    Column("pause_mode", Text),
    Column("memory_digest", Text),
    Column("checkpoint_id", Text),  # the checkpoint the sandbox's state last came from (revision 0002)
    Index("sandboxes_team_state", "team_id", "state"),
    Index("sandboxes_node", "node_id"),
)

templates = Table(
    "templates", metadata,
    Column("template_id", Text, primary_key=True),
    _json("aliases", "[]"),
    Column("cpu_count", Integer, nullable=False),
    Column("memory_mb", Integer, nullable=False),
    Column("disk_mb", Integer, nullable=False),
    Column("image", Text, nullable=False),
    _flag("public", 1),
    Column("created_at", Text, nullable=False),
    Column("team_id", Text),
    Column("runtime", Text),
)

template_builds = Table(
    "template_builds", metadata,
    Column("build_id", Text, primary_key=True),
    Column("template_id", Text, nullable=False),
    Column("team_id", Text, nullable=False),
    Column("status", Text, nullable=False),
    Column("created_at", Text, nullable=False),
    _json("data", "{}"),
    Index("template_builds_template", "template_id", "created_at"),
)

template_tags = Table(
    "template_tags", metadata,
    Column("template_id", Text, nullable=False),
    Column("tag", Text, nullable=False),
    Column("build_id", Text, nullable=False),
    Column("created_at", Text, nullable=False),
    PrimaryKeyConstraint("template_id", "tag"),
)

build_cache = Table(
    "build_cache", metadata,
    Column("key", Text, primary_key=True),
    Column("template_id", Text, nullable=False),
    Column("data", Text, nullable=False),
    Column("created_at", Text, nullable=False),
    Index("build_cache_template", "template_id"),
)

api_keys = Table(
    "api_keys", metadata,
    Column("key_id", Text, primary_key=True),
    Column("key_hash", Text, nullable=False, unique=True),
    Column("team_id", Text, nullable=False),
    Column("name", Text, nullable=False),
    Column("created_at", Text, nullable=False),
    _flag("revoked", 0),
    Index("api_keys_team", "team_id"),
)

teams = Table(
    "teams", metadata,
    Column("team_id", Text, primary_key=True),
    Column("name", Text, nullable=False),
    Column("max_sandboxes", Integer),
    Column("created_at", Text, nullable=False),
)

snapshots = Table(
    "snapshots", metadata,
    Column("snapshot_id", Text, primary_key=True),
    Column("team_id", Text, nullable=False),
    _json("names", "[]"),
    Column("source_sandbox_id", Text),
    Column("template_id", Text, nullable=False),
    Column("image", Text, nullable=False),
    _json("layers", "[]"),
    Column("memory_digest", Text),
    Column("cpu_count", Integer, nullable=False),
    Column("memory_mb", Integer, nullable=False),
    Column("disk_mb", Integer, nullable=False),
    _json("env_vars", "{}"),
    _json("metadata", "{}"),
    Column("size_bytes", BigInt, nullable=False, server_default=text("0")),
    Column("restore_token", Text),
    Column("created_at", Text, nullable=False),
    Column("network", Text),
    Column("runtime", Text),
    Index("snapshots_team", "team_id", "created_at"),
)

# The cluster's node registry (used on PostgreSQL; present, unused, in a single node's SQLite).
nodes = Table(
    "nodes", metadata,
    Column("node_id", Text, primary_key=True),
    Column("url", Text, nullable=False),
    Column("state", Text, nullable=False),
    Column("info", Text, nullable=False),
    Column("heartbeat_at", UTCDateTime, nullable=False),
    Column("started_at", UTCDateTime, nullable=False),
)

# Team-quota reservations (revision 0003): a start (create, resume, fork child) admitted against its
# team's concurrent-sandbox limit and not yet counted by its record. `sandbox_id` is set once the start
# knows its sandbox: from then on the reservation does not count while that sandbox's record does, so
# nothing is counted twice. Reservations of a dead node, or older than the store's TTL, do not count.
team_reservations = Table(
    "team_reservations", metadata,
    Column("reservation_id", Text, primary_key=True),
    Column("team_id", Text, nullable=False),
    Column("node_id", Text, nullable=False),
    Column("sandbox_id", Text),
    Column("created_at", UTCDateTime, nullable=False),
    Index("team_reservations_team", "team_id"),
    Index("team_reservations_node", "node_id"),
)

# The hand-written stores' version counter, kept as a tombstone: Alembic's `alembic_version` is the
# schema's version now, and LEGACY_VERSION (above what any hand-written store knew) makes an old
# agentenv refuse the database ("newer than this agentenv supports") instead of touching it.
LEGACY_VERSION = 1000
schema_version = Table("schema_version", metadata, Column("version", Integer, nullable=False))
