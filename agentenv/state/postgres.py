"""Networked state store on PostgreSQL (asyncpg): the shared state of a cluster.

Why PostgreSQL (and not Redis): the cluster's state is relational and must stay consistent under
concurrent writers — a sandbox belongs to exactly one node (`claim_sandbox` is a compare-and-set
UPDATE), a node's death turns its sandboxes LOST in the same transaction that marks it dead, and
only one scheduler runs that sweep at a time (an advisory lock). PostgreSQL gives transactions,
row-level conditions and durable writes by default; it is packaged everywhere and every
Kubernetes platform offers it managed. See docs/cluster.md.

Rows have the same format as the SQLite store's (JSON text for dicts/lists, fixed-width UTC ISO
text for times), so both share the record <-> row conversions.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

import asyncpg

from agentenv.models import (SURVIVES_NODE_LOSS, ApiKeyRecord, NodeRecord, SandboxRecord, SandboxState,
                             SnapshotRecord, TeamRecord,
                             TemplateBuildRecord, TemplateRecord, TemplateTag, utcnow)
from agentenv.state.sqlite import (_KEY_COLS, _SANDBOX_COLS, _SNAPSHOT_COLS, _TEAM_COLS, _TEMPLATE_COLS,
                                   SQLiteStateStore, _dt, _ts)

# Append-only, like the SQLite store's. Integers are BIGINT-compatible; booleans stay 0/1 integers
# so rows convert with the SQLite store's functions.
MIGRATIONS: list[str] = [
    """
    CREATE TABLE sandboxes (
        sandbox_id TEXT PRIMARY KEY, template_id TEXT NOT NULL, team_id TEXT NOT NULL, state TEXT NOT NULL,
        started_at TEXT NOT NULL, end_at TEXT NOT NULL, cpu_count INTEGER NOT NULL, memory_mb INTEGER NOT NULL,
        disk_mb INTEGER NOT NULL, envd_access_token TEXT NOT NULL, traffic_access_token TEXT, alias TEXT,
        metadata TEXT NOT NULL DEFAULT '{}', env_vars TEXT NOT NULL DEFAULT '{}',
        auto_pause INTEGER NOT NULL DEFAULT 0, auto_resume INTEGER NOT NULL DEFAULT 0,
        allow_internet_access INTEGER NOT NULL DEFAULT 1, network TEXT, slot INTEGER, runtime TEXT NOT NULL,
        node_id TEXT NOT NULL, parent_id TEXT, snapshot_id TEXT, created_at TEXT NOT NULL,
        image TEXT NOT NULL DEFAULT 'base', layers TEXT NOT NULL DEFAULT '[]', pause_mode TEXT,
        memory_digest TEXT
    );
    CREATE INDEX sandboxes_team_state ON sandboxes (team_id, state);
    CREATE INDEX sandboxes_node ON sandboxes (node_id);
    CREATE TABLE templates (
        template_id TEXT PRIMARY KEY, aliases TEXT NOT NULL DEFAULT '[]', cpu_count INTEGER NOT NULL,
        memory_mb INTEGER NOT NULL, disk_mb INTEGER NOT NULL, image TEXT NOT NULL,
        public INTEGER NOT NULL DEFAULT 1, created_at TEXT NOT NULL, team_id TEXT
    );
    CREATE TABLE template_builds (
        build_id TEXT PRIMARY KEY, template_id TEXT NOT NULL, team_id TEXT NOT NULL, status TEXT NOT NULL,
        created_at TEXT NOT NULL, data TEXT NOT NULL DEFAULT '{}'
    );
    CREATE INDEX template_builds_template ON template_builds (template_id, created_at);
    CREATE TABLE template_tags (
        template_id TEXT NOT NULL, tag TEXT NOT NULL, build_id TEXT NOT NULL, created_at TEXT NOT NULL,
        PRIMARY KEY (template_id, tag)
    );
    CREATE TABLE build_cache (
        key TEXT PRIMARY KEY, template_id TEXT NOT NULL, data TEXT NOT NULL, created_at TEXT NOT NULL
    );
    CREATE INDEX build_cache_template ON build_cache (template_id);
    CREATE TABLE api_keys (
        key_id TEXT PRIMARY KEY, key_hash TEXT NOT NULL UNIQUE, team_id TEXT NOT NULL, name TEXT NOT NULL,
        created_at TEXT NOT NULL, revoked INTEGER NOT NULL DEFAULT 0
    );
    CREATE TABLE snapshots (
        snapshot_id TEXT PRIMARY KEY, team_id TEXT NOT NULL, names TEXT NOT NULL DEFAULT '[]',
        source_sandbox_id TEXT, template_id TEXT NOT NULL, image TEXT NOT NULL, layers TEXT NOT NULL DEFAULT '[]',
        memory_digest TEXT, cpu_count INTEGER NOT NULL, memory_mb INTEGER NOT NULL, disk_mb INTEGER NOT NULL,
        env_vars TEXT NOT NULL DEFAULT '{}', metadata TEXT NOT NULL DEFAULT '{}',
        size_bytes BIGINT NOT NULL DEFAULT 0, restore_token TEXT, created_at TEXT NOT NULL, network TEXT
    );
    CREATE INDEX snapshots_team ON snapshots (team_id, created_at);
    CREATE TABLE teams (
        team_id TEXT PRIMARY KEY, name TEXT NOT NULL, max_sandboxes INTEGER, created_at TEXT NOT NULL
    );
    CREATE INDEX api_keys_team ON api_keys (team_id);
    CREATE TABLE nodes (
        node_id TEXT PRIMARY KEY, url TEXT NOT NULL, state TEXT NOT NULL, info TEXT NOT NULL,
        heartbeat_at TIMESTAMPTZ NOT NULL, started_at TIMESTAMPTZ NOT NULL
    );
    """,
    # 1 -> 2: a template names its runtime, a snapshot the one that made it (nodes serve several).
    """
    ALTER TABLE templates ADD COLUMN IF NOT EXISTS runtime TEXT;
    ALTER TABLE snapshots ADD COLUMN IF NOT EXISTS runtime TEXT;
    """,
    # 2 -> 3: the checkpoint a sandbox's state last came from (time travel).
    """
    ALTER TABLE sandboxes ADD COLUMN IF NOT EXISTS checkpoint_id TEXT;
    """,
]

# Serialises schema migrations of concurrently starting processes, and the dead-node sweep.
_MIGRATE_LOCK = 0x61676E7400000001
_SWEEP_LOCK = 0x61676E7400000002


def _upsert_sql(table: str, cols: tuple[str, ...], key: str, *, guard: str | None = None) -> str:
    updates = ", ".join(f"{c} = EXCLUDED.{c}" for c in cols if c != key)
    sql = (f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({', '.join(f'${i}' for i in range(1, len(cols) + 1))}) "
           f"ON CONFLICT ({key}) DO UPDATE SET {updates}")
    return sql + (f" WHERE {guard}" if guard else "")


_NODE_INFO = ("cpu_count", "memory_mb", "max_sandboxes", "sandboxes", "alloc_cpu", "alloc_memory_mb", "load",
              "used_memory_mb", "cached_layers", "runtimes")


class PostgresStateStore:
    """`ClusterStateStore` on PostgreSQL. `open()` creates a connection pool and migrates."""

    def __init__(self, dsn: str, *, min_size: int = 1, max_size: int = 10) -> None:
        self.dsn = dsn
        self._pool: asyncpg.Pool | None = None
        self._sizes = (min_size, max_size)

    async def open(self) -> None:
        if self._pool is not None:
            return
        pool = await asyncpg.create_pool(self.dsn, min_size=self._sizes[0], max_size=self._sizes[1])
        try:
            async with pool.acquire() as con, con.transaction():
                await con.execute("SELECT pg_advisory_xact_lock($1)", _MIGRATE_LOCK)
                await con.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
                version = await con.fetchval("SELECT version FROM schema_version")
                if version is None:
                    await con.execute("INSERT INTO schema_version (version) VALUES (0)")
                    version = 0
                if version > len(MIGRATIONS):
                    raise RuntimeError(f"state database schema version {version} is newer than this agentenv "
                                       f"supports ({len(MIGRATIONS)}); upgrade agentenv")
                for target, script in enumerate(MIGRATIONS[version:], start=version + 1):
                    await con.execute(script)
                    await con.execute("UPDATE schema_version SET version = $1", target)
        except BaseException:
            await pool.close()
            raise
        self._pool = pool

    async def close(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.close()

    async def schema_version(self) -> int:
        return int(await self._p.fetchval("SELECT version FROM schema_version"))

    @property
    def _p(self) -> asyncpg.Pool:
        if self._pool is None:
            raise RuntimeError("PostgresStateStore is not open; call open() first")
        return self._pool

    # sandboxes ----------------------------------------------------------------------------------

    async def put_sandbox(self, rec: SandboxRecord) -> None:
        v = SQLiteStateStore.sandbox_values(rec)
        await self._p.execute(_upsert_sql("sandboxes", _SANDBOX_COLS, "sandbox_id"), *[v[c] for c in _SANDBOX_COLS])

    async def put_sandbox_of(self, rec: SandboxRecord, node_id: str) -> None:
        rec.node_id = node_id
        v = SQLiteStateStore.sandbox_values(rec)
        await self._p.execute(_upsert_sql("sandboxes", _SANDBOX_COLS, "sandbox_id",
                                          guard="sandboxes.node_id = EXCLUDED.node_id"),
                              *[v[c] for c in _SANDBOX_COLS])

    async def get_sandbox(self, sandbox_id: str) -> SandboxRecord | None:
        row = await self._p.fetchrow("SELECT * FROM sandboxes WHERE sandbox_id = $1", sandbox_id)
        return SQLiteStateStore._sandbox(row) if row else None

    async def delete_sandbox(self, sandbox_id: str) -> None:
        await self._p.execute("DELETE FROM sandboxes WHERE sandbox_id = $1", sandbox_id)

    async def delete_sandbox_of(self, sandbox_id: str, node_id: str) -> None:
        await self._p.execute("DELETE FROM sandboxes WHERE sandbox_id = $1 AND node_id = $2", sandbox_id, node_id)

    async def list_sandboxes(self, *, team_id: str | None = None, states: list[SandboxState] | None = None,
                             node_id: str | None = None) -> list[SandboxRecord]:
        where: list[str] = []
        params: list[Any] = []
        for col, val in (("team_id", team_id), ("node_id", node_id)):
            if val is not None:
                params.append(val)
                where.append(f"{col} = ${len(params)}")
        if states is not None:
            if not states:
                return []
            params.append([SandboxState(s).value for s in states])
            where.append(f"state = ANY(${len(params)}::text[])")
        sql = "SELECT * FROM sandboxes" + (" WHERE " + " AND ".join(where) if where else "")
        rows = await self._p.fetch(sql + " ORDER BY started_at, sandbox_id", *params)
        return [SQLiteStateStore._sandbox(r) for r in rows]

    async def claim_sandbox(self, sandbox_id: str, from_node: str, to_node: str) -> bool:
        done = await self._p.execute(
            "UPDATE sandboxes SET node_id = $3, slot = NULL WHERE sandbox_id = $1 AND node_id = $2 AND state = $4",
            sandbox_id, from_node, to_node, SandboxState.PAUSED.value)
        return done.endswith(" 1")

    # templates ----------------------------------------------------------------------------------

    async def put_template(self, rec: TemplateRecord) -> None:
        v = SQLiteStateStore.template_values(rec)
        await self._p.execute(_upsert_sql("templates", _TEMPLATE_COLS, "template_id"),
                              *[v[c] for c in _TEMPLATE_COLS])

    async def get_template(self, id_or_alias: str) -> TemplateRecord | None:
        row = await self._p.fetchrow(
            "SELECT * FROM templates WHERE template_id = $1 OR aliases::jsonb ? $1 "
            "ORDER BY template_id = $1 DESC, template_id LIMIT 1", id_or_alias)
        return SQLiteStateStore._template(row) if row else None

    async def list_templates(self) -> list[TemplateRecord]:
        rows = await self._p.fetch("SELECT * FROM templates ORDER BY created_at, template_id")
        return [SQLiteStateStore._template(r) for r in rows]

    async def delete_template(self, template_id: str) -> None:
        async with self._p.acquire() as con, con.transaction():
            for table in ("templates", "template_builds", "template_tags", "build_cache"):
                await con.execute(f"DELETE FROM {table} WHERE template_id = $1", template_id)

    async def put_build(self, rec: TemplateBuildRecord) -> None:
        cols = ("build_id", "template_id", "team_id", "status", "created_at", "data")
        await self._p.execute(_upsert_sql("template_builds", cols, "build_id"), rec.build_id, rec.template_id,
                              rec.team_id, rec.status.value, _ts(rec.created_at), json.dumps(rec.data()))

    @staticmethod
    def _build(row: asyncpg.Record) -> TemplateBuildRecord:
        return TemplateBuildRecord.from_data(row["build_id"], row["template_id"], row["team_id"], row["status"],
                                             _dt(row["created_at"]), json.loads(row["data"]))

    async def get_build(self, build_id: str) -> TemplateBuildRecord | None:
        row = await self._p.fetchrow("SELECT * FROM template_builds WHERE build_id = $1", build_id)
        return self._build(row) if row else None

    async def list_builds(self, template_id: str | None = None) -> list[TemplateBuildRecord]:
        if template_id is None:
            rows = await self._p.fetch("SELECT * FROM template_builds ORDER BY created_at, build_id")
        else:
            rows = await self._p.fetch("SELECT * FROM template_builds WHERE template_id = $1 "
                                       "ORDER BY created_at, build_id", template_id)
        return [self._build(r) for r in rows]

    async def delete_build(self, build_id: str) -> None:
        await self._p.execute("DELETE FROM template_builds WHERE build_id = $1", build_id)

    async def put_tag(self, rec: TemplateTag) -> None:
        await self._p.execute(
            "INSERT INTO template_tags (template_id, tag, build_id, created_at) VALUES ($1, $2, $3, $4) "
            "ON CONFLICT (template_id, tag) DO UPDATE SET build_id = EXCLUDED.build_id, created_at = EXCLUDED.created_at",
            rec.template_id, rec.tag, rec.build_id, _ts(rec.created_at))

    async def delete_tag(self, template_id: str, tag: str) -> bool:
        done = await self._p.execute("DELETE FROM template_tags WHERE template_id = $1 AND tag = $2", template_id, tag)
        return not done.endswith(" 0")

    async def list_tags(self, template_id: str | None = None) -> list[TemplateTag]:
        if template_id is None:
            rows = await self._p.fetch("SELECT * FROM template_tags ORDER BY created_at, tag")
        else:
            rows = await self._p.fetch("SELECT * FROM template_tags WHERE template_id = $1 ORDER BY created_at, tag",
                                       template_id)
        return [TemplateTag(r["template_id"], r["tag"], r["build_id"], _dt(r["created_at"])) for r in rows]

    async def put_cache_entry(self, key: str, template_id: str, data: dict) -> None:
        await self._p.execute(_upsert_sql("build_cache", ("key", "template_id", "data", "created_at"), "key"),
                              key, template_id, json.dumps(data), _ts(utcnow()))

    async def get_cache_entry(self, key: str) -> dict | None:
        raw = await self._p.fetchval("SELECT data FROM build_cache WHERE key = $1", key)
        return json.loads(raw) if raw is not None else None

    async def list_cache_entries(self) -> list[dict]:
        return [json.loads(r["data"]) for r in await self._p.fetch("SELECT data FROM build_cache")]

    # API keys -----------------------------------------------------------------------------------

    async def put_api_key(self, rec: ApiKeyRecord) -> None:
        v = SQLiteStateStore.key_values(rec)
        await self._p.execute(_upsert_sql("api_keys", _KEY_COLS, "key_id"), *[v[c] for c in _KEY_COLS])

    async def find_api_key(self, key_hash: str) -> ApiKeyRecord | None:
        row = await self._p.fetchrow("SELECT * FROM api_keys WHERE key_hash = $1", key_hash)
        return SQLiteStateStore._key(row) if row else None

    async def list_api_keys(self, *, team_id: str | None = None) -> list[ApiKeyRecord]:
        if team_id is None:
            rows = await self._p.fetch("SELECT * FROM api_keys ORDER BY created_at, key_id")
        else:
            rows = await self._p.fetch("SELECT * FROM api_keys WHERE team_id = $1 ORDER BY created_at, key_id", team_id)
        return [SQLiteStateStore._key(r) for r in rows]

    # teams --------------------------------------------------------------------------------------

    async def put_team(self, rec: TeamRecord) -> None:
        v = {"team_id": rec.team_id, "name": rec.name, "max_sandboxes": rec.max_sandboxes,
             "created_at": _ts(rec.created_at)}
        await self._p.execute(_upsert_sql("teams", _TEAM_COLS, "team_id"), *[v[c] for c in _TEAM_COLS])

    async def get_team(self, team_id: str) -> TeamRecord | None:
        row = await self._p.fetchrow("SELECT * FROM teams WHERE team_id = $1", team_id)
        return SQLiteStateStore._team(row) if row else None

    async def list_teams(self) -> list[TeamRecord]:
        return [SQLiteStateStore._team(r) for r in await self._p.fetch("SELECT * FROM teams ORDER BY created_at, team_id")]

    async def revoke_api_key(self, key_id: str) -> bool:
        return (await self._p.execute("UPDATE api_keys SET revoked = 1 WHERE key_id = $1", key_id)).endswith(" 1")

    # snapshots ----------------------------------------------------------------------------------

    async def put_snapshot(self, rec: SnapshotRecord) -> None:
        v = SQLiteStateStore.snapshot_values(rec)
        await self._p.execute(_upsert_sql("snapshots", _SNAPSHOT_COLS, "snapshot_id"),
                              *[v[c] for c in _SNAPSHOT_COLS])

    async def get_snapshot(self, id_or_name: str) -> SnapshotRecord | None:
        row = await self._p.fetchrow(
            "SELECT * FROM snapshots WHERE snapshot_id = $1 OR names::jsonb ? $1 "
            "ORDER BY snapshot_id = $1 DESC, created_at DESC LIMIT 1", id_or_name)
        return SQLiteStateStore._snapshot(row) if row else None

    async def list_snapshots(self, *, team_id: str | None = None) -> list[SnapshotRecord]:
        if team_id is None:
            rows = await self._p.fetch("SELECT * FROM snapshots ORDER BY created_at, snapshot_id")
        else:
            rows = await self._p.fetch("SELECT * FROM snapshots WHERE team_id = $1 ORDER BY created_at, snapshot_id",
                                       team_id)
        return [SQLiteStateStore._snapshot(r) for r in rows]

    async def delete_snapshot(self, snapshot_id: str) -> None:
        await self._p.execute("DELETE FROM snapshots WHERE snapshot_id = $1", snapshot_id)

    # nodes --------------------------------------------------------------------------------------

    @staticmethod
    def _node(row: asyncpg.Record) -> NodeRecord:
        info = json.loads(row["info"])
        return NodeRecord(node_id=row["node_id"], url=row["url"], state=row["state"],
                          heartbeat_at=row["heartbeat_at"], started_at=row["started_at"],
                          **{k: info[k] for k in _NODE_INFO if k in info})

    async def put_node(self, rec: NodeRecord) -> str:
        """A heartbeat. A node that was declared dead comes back active; draining is kept unless the
        node itself says otherwise (rec.state)."""
        info = json.dumps({k: getattr(rec, k) for k in _NODE_INFO})
        return await self._p.fetchval(
            "INSERT INTO nodes (node_id, url, state, info, heartbeat_at, started_at) VALUES ($1, $2, $3, $4, now(), $5) "
            "ON CONFLICT (node_id) DO UPDATE SET url = EXCLUDED.url, info = EXCLUDED.info, heartbeat_at = now(), "
            "started_at = EXCLUDED.started_at, state = EXCLUDED.state RETURNING state",
            rec.node_id, rec.url, rec.state, info, rec.started_at)

    async def get_node(self, node_id: str) -> NodeRecord | None:
        row = await self._p.fetchrow("SELECT * FROM nodes WHERE node_id = $1", node_id)
        return self._node(row) if row else None

    async def list_nodes(self) -> list[NodeRecord]:
        return [self._node(r) for r in await self._p.fetch("SELECT * FROM nodes ORDER BY node_id")]

    async def set_node_state(self, node_id: str, state: str) -> bool:
        return (await self._p.execute("UPDATE nodes SET state = $2 WHERE node_id = $1", node_id, state)).endswith(" 1")

    async def expire_nodes(self, dead_after_s: float, *, spare: list[str] = ()) -> dict[str, list[str]]:
        """One transaction: nodes past their deadline (but those in `spare`) become dead and their
        unsafe sandboxes LOST."""
        survive = [s.value for s in SURVIVES_NODE_LOSS]
        out: dict[str, list[str]] = {}
        async with self._p.acquire() as con, con.transaction():
            if not await con.fetchval("SELECT pg_try_advisory_xact_lock($1)", _SWEEP_LOCK):
                return out  # another scheduler is sweeping right now
            dead = await con.fetch(
                "UPDATE nodes SET state = 'dead' WHERE state <> 'dead' AND heartbeat_at < now() - $1::interval "
                "AND NOT (node_id = ANY($2::text[])) RETURNING node_id", timedelta(seconds=dead_after_s), list(spare))
            for row in dead:
                lost = await con.fetch(
                    "UPDATE sandboxes SET state = $2, slot = NULL WHERE node_id = $1 AND state <> $2 AND NOT "
                    "(state = ANY($3::text[]) AND (memory_digest IS NOT NULL OR pause_mode = 'filesystem')) "
                    "RETURNING sandbox_id", row["node_id"], SandboxState.LOST.value, survive)
                out[row["node_id"]] = [r["sandbox_id"] for r in lost]
        return out


def is_postgres_url(url: str | None) -> bool:
    return bool(url) and url.split(":", 1)[0] in ("postgres", "postgresql")


__all__ = ["PostgresStateStore", "is_postgres_url", "_dt", "_ts", "utcnow", "datetime"]
