"""Embedded state store on SQLite (aiosqlite), the single-node default.

One connection per store: aiosqlite runs it on a dedicated thread and serialises calls, and an
asyncio lock around every write keeps a coroutine's statement + commit from interleaving with
another's. WAL mode lets readers of other processes (e.g. the CLI) see a consistent snapshot while
the server writes. Dicts/lists live in JSON text columns; datetimes in fixed-width UTC ISO text so
that string order equals time order.
"""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import aiosqlite

from agentenv.models import (ApiKeyRecord, SandboxRecord, SandboxState, SnapshotRecord, TeamRecord,
                             TemplateBuildRecord, TemplateRecord, TemplateTag)

# Append-only: migration N brings the schema from version N to N+1. Never edit a released entry.
# Statements are applied one by one and skipped when their effect is already there (a column, table or
# index of that name exists), so a database that got a change under another number (a development
# build whose migrations were ordered differently) still converges instead of failing to open.
MIGRATIONS: list[str] = [
    """
    CREATE TABLE sandboxes (
        sandbox_id TEXT PRIMARY KEY,
        template_id TEXT NOT NULL,
        team_id TEXT NOT NULL,
        state TEXT NOT NULL,
        started_at TEXT NOT NULL,
        end_at TEXT NOT NULL,
        cpu_count INTEGER NOT NULL,
        memory_mb INTEGER NOT NULL,
        disk_mb INTEGER NOT NULL,
        envd_access_token TEXT NOT NULL,
        traffic_access_token TEXT,
        alias TEXT,
        metadata TEXT NOT NULL DEFAULT '{}',
        env_vars TEXT NOT NULL DEFAULT '{}',
        auto_pause INTEGER NOT NULL DEFAULT 0,
        auto_resume INTEGER NOT NULL DEFAULT 0,
        allow_internet_access INTEGER NOT NULL DEFAULT 1,
        network TEXT,
        slot INTEGER,
        runtime TEXT NOT NULL,
        node_id TEXT NOT NULL,
        parent_id TEXT,
        snapshot_id TEXT,
        created_at TEXT NOT NULL
    );
    CREATE INDEX sandboxes_team_state ON sandboxes (team_id, state);
    CREATE TABLE templates (
        template_id TEXT PRIMARY KEY,
        aliases TEXT NOT NULL DEFAULT '[]',
        cpu_count INTEGER NOT NULL,
        memory_mb INTEGER NOT NULL,
        disk_mb INTEGER NOT NULL,
        image TEXT NOT NULL,
        public INTEGER NOT NULL DEFAULT 1,
        created_at TEXT NOT NULL
    );
    CREATE TABLE api_keys (
        key_id TEXT PRIMARY KEY,
        key_hash TEXT NOT NULL UNIQUE,
        team_id TEXT NOT NULL,
        name TEXT NOT NULL,
        created_at TEXT NOT NULL,
        revoked INTEGER NOT NULL DEFAULT 0
    );
    """,
    # 1 -> 2: layered filesystems, paused memory images, and the snapshot catalog.
    """
    ALTER TABLE sandboxes ADD COLUMN image TEXT NOT NULL DEFAULT 'base';
    ALTER TABLE sandboxes ADD COLUMN layers TEXT NOT NULL DEFAULT '[]';
    ALTER TABLE sandboxes ADD COLUMN pause_mode TEXT;
    CREATE TABLE snapshots (
        snapshot_id TEXT PRIMARY KEY,
        team_id TEXT NOT NULL,
        names TEXT NOT NULL DEFAULT '[]',
        source_sandbox_id TEXT,
        template_id TEXT NOT NULL,
        image TEXT NOT NULL,
        layers TEXT NOT NULL DEFAULT '[]',
        memory_digest TEXT,
        cpu_count INTEGER NOT NULL,
        memory_mb INTEGER NOT NULL,
        disk_mb INTEGER NOT NULL,
        env_vars TEXT NOT NULL DEFAULT '{}',
        metadata TEXT NOT NULL DEFAULT '{}',
        size_bytes INTEGER NOT NULL DEFAULT 0,
        restore_token TEXT,
        created_at TEXT NOT NULL
    );
    CREATE INDEX snapshots_team ON snapshots (team_id, created_at);
    """,
    # 2 -> 3: teams (tenants) with an optional concurrent-sandbox quota; every existing key's team exists.
    """
    CREATE TABLE teams (
        team_id TEXT PRIMARY KEY,
        name TEXT NOT NULL,
        max_sandboxes INTEGER,
        created_at TEXT NOT NULL
    );
    INSERT OR IGNORE INTO teams (team_id, name, created_at)
        SELECT DISTINCT team_id, team_id, MIN(created_at) FROM api_keys GROUP BY team_id;
    CREATE INDEX api_keys_team ON api_keys (team_id);
    """,
    # 3 -> 4: templates built through the template API (builds, tags, build-step cache).
    """
    ALTER TABLE templates ADD COLUMN team_id TEXT;
    CREATE TABLE template_builds (
        build_id TEXT PRIMARY KEY,
        template_id TEXT NOT NULL,
        team_id TEXT NOT NULL,
        status TEXT NOT NULL,
        created_at TEXT NOT NULL,
        data TEXT NOT NULL DEFAULT '{}'
    );
    CREATE INDEX template_builds_template ON template_builds (template_id, created_at);
    CREATE TABLE template_tags (
        template_id TEXT NOT NULL,
        tag TEXT NOT NULL,
        build_id TEXT NOT NULL,
        created_at TEXT NOT NULL,
        PRIMARY KEY (template_id, tag)
    );
    CREATE TABLE build_cache (
        key TEXT PRIMARY KEY,
        template_id TEXT NOT NULL,
        data TEXT NOT NULL,
        created_at TEXT NOT NULL
    );
    CREATE INDEX build_cache_template ON build_cache (template_id);
    """,
    # 4 -> 5: a snapshot keeps its source's egress rules (allow_internet_access + network options).
    """
    ALTER TABLE snapshots ADD COLUMN network TEXT;
    """,
    # 5 -> 6: a paused sandbox's memory image published to the snapshot store (cluster nodes).
    """
    ALTER TABLE sandboxes ADD COLUMN memory_digest TEXT;
    """,
    # 6 -> 7: nodes serve several runtimes: a template names its runtime, a snapshot the one that made it.
    """
    ALTER TABLE templates ADD COLUMN runtime TEXT;
    ALTER TABLE snapshots ADD COLUMN runtime TEXT;
    """,
    # 7 -> 8: the checkpoint a sandbox's state last came from (time travel: its next checkpoint's parent).
    """
    ALTER TABLE sandboxes ADD COLUMN checkpoint_id TEXT;
    """,
]

_ADD_COLUMN = re.compile(r"ALTER\s+TABLE\s+(\w+)\s+ADD\s+COLUMN\s+(\w+)", re.IGNORECASE)
_CREATE = re.compile(r"CREATE\s+(?:UNIQUE\s+)?(TABLE|INDEX)\s+(\w+)", re.IGNORECASE)


def _statements(script: str) -> list[str]:
    """The SQL statements of a migration script, in order."""
    out: list[str] = []
    buf = ""
    for line in script.splitlines(keepends=True):
        buf += line
        if sqlite3.complete_statement(buf):
            out.append(buf.strip())
            buf = ""
    if buf.strip():
        raise ValueError(f"incomplete SQL statement in a migration: {buf.strip()[:80]!r}")
    return out


async def _already_applied(db: aiosqlite.Connection, stmt: str) -> bool:
    """True when a schema change's effect exists already (its column, table or index)."""
    if m := _ADD_COLUMN.match(stmt):
        return m[2] in {r[1] for r in await db.execute_fetchall(f"PRAGMA table_info({m[1]})")}
    if m := _CREATE.match(stmt):
        return bool(await db.execute_fetchall("SELECT 1 FROM sqlite_master WHERE type = ? AND name = ?",
                                              (m[1].lower(), m[2])))
    return False


_SANDBOX_COLS = (
    "sandbox_id", "template_id", "team_id", "state", "started_at", "end_at", "cpu_count", "memory_mb",
    "disk_mb", "envd_access_token", "traffic_access_token", "alias", "metadata", "env_vars", "auto_pause",
    "auto_resume", "allow_internet_access", "network", "slot", "runtime", "node_id", "parent_id",
    "snapshot_id", "created_at", "image", "layers", "pause_mode", "memory_digest", "checkpoint_id",
)
_SNAPSHOT_COLS = (
    "snapshot_id", "team_id", "names", "source_sandbox_id", "template_id", "image", "layers", "memory_digest",
    "cpu_count", "memory_mb", "disk_mb", "env_vars", "metadata", "size_bytes", "restore_token", "created_at",
    "network", "runtime",
)
_TEMPLATE_COLS = ("template_id", "aliases", "cpu_count", "memory_mb", "disk_mb", "image", "public", "created_at",
                  "team_id", "runtime")
_KEY_COLS = ("key_id", "key_hash", "team_id", "name", "created_at", "revoked")
_TEAM_COLS = ("team_id", "name", "max_sandboxes", "created_at")


def _ts(dt: datetime) -> str:
    if dt.tzinfo is None:
        raise ValueError(f"naive datetime {dt!r}: the state store only accepts timezone-aware times")
    return dt.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f+00:00")


def _dt(s: str) -> datetime:
    return datetime.fromisoformat(s)


def _insert_sql(table: str, cols: tuple[str, ...]) -> str:
    return f"INSERT OR REPLACE INTO {table} ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})"


class SQLiteStateStore:
    """`StateStore` on one SQLite file. Call `open()` before use and `close()` when done."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._db: aiosqlite.Connection | None = None
        self._write_lock = asyncio.Lock()

    # lifecycle ----------------------------------------------------------------------------------

    async def open(self) -> None:
        if self._db is not None:
            return
        if str(self.path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
        db = await aiosqlite.connect(self.path)
        try:
            db.row_factory = aiosqlite.Row
            await db.execute("PRAGMA journal_mode=WAL")
            await db.execute("PRAGMA synchronous=NORMAL")
            await db.execute("PRAGMA busy_timeout=5000")
            await db.execute("PRAGMA foreign_keys=ON")
            await self._migrate(db)
        except BaseException:
            await db.close()
            raise
        self._db = db

    async def close(self) -> None:
        if self._db is not None:
            db, self._db = self._db, None
            await db.close()

    async def __aenter__(self) -> "SQLiteStateStore":
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def schema_version(self) -> int:
        async with self._conn.execute("SELECT version FROM schema_version") as cur:
            row = await cur.fetchone()
        return int(row[0])

    @staticmethod
    async def _migrate(db: aiosqlite.Connection) -> None:
        await db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        await db.commit()
        # One writer at a time: two processes opening an old database (server + CLI) must not both
        # apply the same step. The version is read under the write lock.
        await db.execute("BEGIN IMMEDIATE")
        try:
            rows = await db.execute_fetchall("SELECT version FROM schema_version")
            if not rows:
                await db.execute("INSERT INTO schema_version (version) VALUES (0)")
            version = int(rows[0][0]) if rows else 0
            if version > len(MIGRATIONS):
                raise RuntimeError(
                    f"state database schema version {version} is newer than this agentenv supports "
                    f"({len(MIGRATIONS)}); upgrade agentenv"
                )
            for target, script in enumerate(MIGRATIONS[version:], start=version + 1):
                for stmt in _statements(script):
                    if not await _already_applied(db, stmt):
                        await db.execute(stmt)
                await db.execute("UPDATE schema_version SET version = ?", (target,))
            await db.commit()
        except BaseException:
            await db.rollback()
            raise

    @property
    def _conn(self) -> aiosqlite.Connection:
        if self._db is None:
            raise RuntimeError("SQLiteStateStore is not open; call open() first")
        return self._db

    async def _write(self, sql: str, params: tuple | list = ()) -> int:
        async with self._write_lock:
            cur = await self._conn.execute(sql, params)
            await self._conn.commit()
            return cur.rowcount

    async def _fetch(self, sql: str, params: tuple | list = ()) -> list[aiosqlite.Row]:
        async with self._conn.execute(sql, params) as cur:
            return list(await cur.fetchall())

    # sandboxes ----------------------------------------------------------------------------------

    async def put_sandbox(self, rec: SandboxRecord) -> None:
        values = self.sandbox_values(rec)
        await self._write(_insert_sql("sandboxes", _SANDBOX_COLS), [values[c] for c in _SANDBOX_COLS])

    @staticmethod
    def sandbox_values(rec: SandboxRecord) -> dict[str, Any]:
        """Column values of a sandbox row (shared with the PostgreSQL store: same row format)."""
        return {
            "sandbox_id": rec.sandbox_id,
            "template_id": rec.template_id,
            "team_id": rec.team_id,
            "state": SandboxState(rec.state).value,
            "started_at": _ts(rec.started_at),
            "end_at": _ts(rec.end_at),
            "cpu_count": rec.cpu_count,
            "memory_mb": rec.memory_mb,
            "disk_mb": rec.disk_mb,
            "envd_access_token": rec.envd_access_token,
            "traffic_access_token": rec.traffic_access_token,
            "alias": rec.alias,
            "metadata": json.dumps(rec.metadata),
            "env_vars": json.dumps(rec.env_vars),
            "auto_pause": int(rec.auto_pause),
            "auto_resume": int(rec.auto_resume),
            "allow_internet_access": int(rec.allow_internet_access),
            "network": None if rec.network is None else json.dumps(rec.network),
            "slot": rec.slot,
            "runtime": rec.runtime,
            "node_id": rec.node_id,
            "parent_id": rec.parent_id,
            "snapshot_id": rec.snapshot_id,
            "created_at": _ts(rec.created_at),
            "image": rec.image,
            "layers": json.dumps(list(rec.layers)),
            "pause_mode": rec.pause_mode,
            "memory_digest": rec.memory_digest,
            "checkpoint_id": rec.checkpoint_id,
        }

    @staticmethod
    def _sandbox(row: aiosqlite.Row) -> SandboxRecord:
        return SandboxRecord(
            sandbox_id=row["sandbox_id"],
            template_id=row["template_id"],
            team_id=row["team_id"],
            state=SandboxState(row["state"]),
            started_at=_dt(row["started_at"]),
            end_at=_dt(row["end_at"]),
            cpu_count=row["cpu_count"],
            memory_mb=row["memory_mb"],
            disk_mb=row["disk_mb"],
            envd_access_token=row["envd_access_token"],
            traffic_access_token=row["traffic_access_token"],
            alias=row["alias"],
            metadata=json.loads(row["metadata"]),
            env_vars=json.loads(row["env_vars"]),
            auto_pause=bool(row["auto_pause"]),
            auto_resume=bool(row["auto_resume"]),
            allow_internet_access=bool(row["allow_internet_access"]),
            network=None if row["network"] is None else json.loads(row["network"]),
            slot=row["slot"],
            runtime=row["runtime"],
            node_id=row["node_id"],
            parent_id=row["parent_id"],
            snapshot_id=row["snapshot_id"],
            created_at=_dt(row["created_at"]),
            image=row["image"],
            layers=json.loads(row["layers"]),
            pause_mode=row["pause_mode"],
            memory_digest=row["memory_digest"],
            checkpoint_id=row["checkpoint_id"],
        )

    async def get_sandbox(self, sandbox_id: str) -> SandboxRecord | None:
        rows = await self._fetch("SELECT * FROM sandboxes WHERE sandbox_id = ?", (sandbox_id,))
        return self._sandbox(rows[0]) if rows else None

    async def delete_sandbox(self, sandbox_id: str) -> None:
        await self._write("DELETE FROM sandboxes WHERE sandbox_id = ?", (sandbox_id,))

    async def list_sandboxes(self, *, team_id: str | None = None, states: list[SandboxState] | None = None,
                             node_id: str | None = None) -> list[SandboxRecord]:
        """Oldest first (by startedAt, then id); `states=[]` matches nothing."""
        where: list[str] = []
        params: list[Any] = []
        if node_id is not None:
            where.append("node_id = ?")
            params.append(node_id)
        if team_id is not None:
            where.append("team_id = ?")
            params.append(team_id)
        if states is not None:
            if not states:
                return []
            where.append(f"state IN ({', '.join('?' * len(states))})")
            params.extend(SandboxState(s).value for s in states)
        sql = "SELECT * FROM sandboxes"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY started_at, sandbox_id"
        return [self._sandbox(r) for r in await self._fetch(sql, params)]

    # templates ----------------------------------------------------------------------------------

    async def put_template(self, rec: TemplateRecord) -> None:
        values = self.template_values(rec)
        await self._write(_insert_sql("templates", _TEMPLATE_COLS), [values[c] for c in _TEMPLATE_COLS])

    @staticmethod
    def template_values(rec: TemplateRecord) -> dict[str, Any]:
        return {
            "template_id": rec.template_id,
            "aliases": json.dumps(list(rec.aliases)),
            "cpu_count": rec.cpu_count,
            "memory_mb": rec.memory_mb,
            "disk_mb": rec.disk_mb,
            "image": rec.image,
            "public": int(rec.public),
            "created_at": _ts(rec.created_at),
            "team_id": rec.team_id,
            "runtime": rec.runtime,
        }

    @staticmethod
    def _template(row: aiosqlite.Row) -> TemplateRecord:
        return TemplateRecord(
            template_id=row["template_id"],
            aliases=json.loads(row["aliases"]),
            cpu_count=row["cpu_count"],
            memory_mb=row["memory_mb"],
            disk_mb=row["disk_mb"],
            image=row["image"],
            public=bool(row["public"]),
            created_at=_dt(row["created_at"]),
            team_id=row["team_id"],
            runtime=row["runtime"],
        )

    async def get_template(self, id_or_alias: str) -> TemplateRecord | None:
        """An exact template id wins over an alias of another template."""
        rows = await self._fetch(
            "SELECT * FROM templates WHERE template_id = ? "
            "OR EXISTS (SELECT 1 FROM json_each(templates.aliases) WHERE value = ?) "
            "ORDER BY template_id = ? DESC, template_id LIMIT 1",
            (id_or_alias, id_or_alias, id_or_alias),
        )
        return self._template(rows[0]) if rows else None

    async def list_templates(self) -> list[TemplateRecord]:
        return [self._template(r) for r in await self._fetch("SELECT * FROM templates ORDER BY created_at, template_id")]

    async def delete_template(self, template_id: str) -> None:
        async with self._write_lock:
            for table in ("templates", "template_builds", "template_tags", "build_cache"):
                await self._conn.execute(f"DELETE FROM {table} WHERE template_id = ?", (template_id,))
            await self._conn.commit()

    async def put_build(self, rec: TemplateBuildRecord) -> None:
        await self._write(
            _insert_sql("template_builds", ("build_id", "template_id", "team_id", "status", "created_at", "data")),
            (rec.build_id, rec.template_id, rec.team_id, rec.status.value, _ts(rec.created_at),
             json.dumps(rec.data())))

    @staticmethod
    def _build(row: aiosqlite.Row) -> TemplateBuildRecord:
        return TemplateBuildRecord.from_data(row["build_id"], row["template_id"], row["team_id"], row["status"],
                                             _dt(row["created_at"]), json.loads(row["data"]))

    async def get_build(self, build_id: str) -> TemplateBuildRecord | None:
        rows = await self._fetch("SELECT * FROM template_builds WHERE build_id = ?", (build_id,))
        return self._build(rows[0]) if rows else None

    async def list_builds(self, template_id: str | None = None) -> list[TemplateBuildRecord]:
        sql, params = "SELECT * FROM template_builds", []
        if template_id is not None:
            sql, params = sql + " WHERE template_id = ?", [template_id]
        return [self._build(r) for r in await self._fetch(sql + " ORDER BY created_at, build_id", params)]

    async def delete_build(self, build_id: str) -> None:
        await self._write("DELETE FROM template_builds WHERE build_id = ?", (build_id,))

    async def put_tag(self, rec: TemplateTag) -> None:
        await self._write(_insert_sql("template_tags", ("template_id", "tag", "build_id", "created_at")),
                          (rec.template_id, rec.tag, rec.build_id, _ts(rec.created_at)))

    async def delete_tag(self, template_id: str, tag: str) -> bool:
        return await self._write("DELETE FROM template_tags WHERE template_id = ? AND tag = ?",
                                 (template_id, tag)) > 0

    async def list_tags(self, template_id: str | None = None) -> list[TemplateTag]:
        sql, params = "SELECT * FROM template_tags", []
        if template_id is not None:
            sql, params = sql + " WHERE template_id = ?", [template_id]
        return [TemplateTag(r["template_id"], r["tag"], r["build_id"], _dt(r["created_at"]))
                for r in await self._fetch(sql + " ORDER BY created_at, tag", params)]

    async def put_cache_entry(self, key: str, template_id: str, data: dict) -> None:
        await self._write(_insert_sql("build_cache", ("key", "template_id", "data", "created_at")),
                          (key, template_id, json.dumps(data), _ts(datetime.now(timezone.utc))))

    async def get_cache_entry(self, key: str) -> dict | None:
        rows = await self._fetch("SELECT data FROM build_cache WHERE key = ?", (key,))
        return json.loads(rows[0]["data"]) if rows else None

    async def list_cache_entries(self) -> list[dict]:
        return [json.loads(r["data"]) for r in await self._fetch("SELECT data FROM build_cache")]

    # API keys -----------------------------------------------------------------------------------

    async def put_api_key(self, rec: ApiKeyRecord) -> None:
        values = self.key_values(rec)
        await self._write(_insert_sql("api_keys", _KEY_COLS), [values[c] for c in _KEY_COLS])

    @staticmethod
    def key_values(rec: ApiKeyRecord) -> dict[str, Any]:
        return {
            "key_id": rec.key_id,
            "key_hash": rec.key_hash,
            "team_id": rec.team_id,
            "name": rec.name,
            "created_at": _ts(rec.created_at),
            "revoked": int(rec.revoked),
        }

    @staticmethod
    def _key(row: aiosqlite.Row) -> ApiKeyRecord:
        return ApiKeyRecord(
            key_id=row["key_id"],
            key_hash=row["key_hash"],
            team_id=row["team_id"],
            name=row["name"],
            created_at=_dt(row["created_at"]),
            revoked=bool(row["revoked"]),
        )

    async def find_api_key(self, key_hash: str) -> ApiKeyRecord | None:
        rows = await self._fetch("SELECT * FROM api_keys WHERE key_hash = ?", (key_hash,))
        return self._key(rows[0]) if rows else None

    async def list_api_keys(self, *, team_id: str | None = None) -> list[ApiKeyRecord]:
        sql, params = "SELECT * FROM api_keys", []
        if team_id is not None:
            sql, params = sql + " WHERE team_id = ?", [team_id]
        return [self._key(r) for r in await self._fetch(sql + " ORDER BY created_at, key_id", params)]

    async def revoke_api_key(self, key_id: str) -> bool:
        return await self._write("UPDATE api_keys SET revoked = 1 WHERE key_id = ?", (key_id,)) > 0

    # teams --------------------------------------------------------------------------------------

    async def put_team(self, rec: TeamRecord) -> None:
        values = {"team_id": rec.team_id, "name": rec.name, "max_sandboxes": rec.max_sandboxes,
                  "created_at": _ts(rec.created_at)}
        await self._write(_insert_sql("teams", _TEAM_COLS), [values[c] for c in _TEAM_COLS])

    @staticmethod
    def _team(row: aiosqlite.Row) -> TeamRecord:
        return TeamRecord(team_id=row["team_id"], name=row["name"], max_sandboxes=row["max_sandboxes"],
                          created_at=_dt(row["created_at"]))

    async def get_team(self, team_id: str) -> TeamRecord | None:
        rows = await self._fetch("SELECT * FROM teams WHERE team_id = ?", (team_id,))
        return self._team(rows[0]) if rows else None

    async def list_teams(self) -> list[TeamRecord]:
        return [self._team(r) for r in await self._fetch("SELECT * FROM teams ORDER BY created_at, team_id")]

    # snapshots ----------------------------------------------------------------------------------

    async def put_snapshot(self, rec: SnapshotRecord) -> None:
        values = self.snapshot_values(rec)
        await self._write(_insert_sql("snapshots", _SNAPSHOT_COLS), [values[c] for c in _SNAPSHOT_COLS])

    @staticmethod
    def snapshot_values(rec: SnapshotRecord) -> dict[str, Any]:
        return {
            "snapshot_id": rec.snapshot_id, "team_id": rec.team_id, "names": json.dumps(list(rec.names)),
            "source_sandbox_id": rec.source_sandbox_id, "template_id": rec.template_id, "image": rec.image,
            "layers": json.dumps(list(rec.layers)), "memory_digest": rec.memory_digest,
            "cpu_count": rec.cpu_count, "memory_mb": rec.memory_mb, "disk_mb": rec.disk_mb,
            "env_vars": json.dumps(rec.env_vars), "metadata": json.dumps(rec.metadata),
            "size_bytes": rec.size_bytes, "restore_token": rec.restore_token, "created_at": _ts(rec.created_at),
            "network": None if rec.network is None else json.dumps(rec.network), "runtime": rec.runtime,
        }

    @staticmethod
    def _snapshot(row: aiosqlite.Row) -> SnapshotRecord:
        return SnapshotRecord(
            snapshot_id=row["snapshot_id"], team_id=row["team_id"], names=json.loads(row["names"]),
            source_sandbox_id=row["source_sandbox_id"], template_id=row["template_id"], image=row["image"],
            layers=json.loads(row["layers"]), memory_digest=row["memory_digest"], cpu_count=row["cpu_count"],
            memory_mb=row["memory_mb"], disk_mb=row["disk_mb"], env_vars=json.loads(row["env_vars"]),
            metadata=json.loads(row["metadata"]), size_bytes=row["size_bytes"], restore_token=row["restore_token"],
            created_at=_dt(row["created_at"]),
            network=None if row["network"] is None else json.loads(row["network"]), runtime=row["runtime"],
        )

    async def get_snapshot(self, id_or_name: str) -> SnapshotRecord | None:
        """By id, or by name (newest snapshot carrying that name)."""
        rows = await self._fetch(
            "SELECT * FROM snapshots WHERE snapshot_id = ? "
            "OR EXISTS (SELECT 1 FROM json_each(snapshots.names) WHERE value = ?) "
            "ORDER BY snapshot_id = ? DESC, created_at DESC LIMIT 1",
            (id_or_name, id_or_name, id_or_name),
        )
        return self._snapshot(rows[0]) if rows else None

    async def list_snapshots(self, *, team_id: str | None = None) -> list[SnapshotRecord]:
        sql, params = "SELECT * FROM snapshots", []
        if team_id is not None:
            sql, params = sql + " WHERE team_id = ?", [team_id]
        return [self._snapshot(r) for r in await self._fetch(sql + " ORDER BY created_at, snapshot_id", params)]

    async def delete_snapshot(self, snapshot_id: str) -> None:
        await self._write("DELETE FROM snapshots WHERE snapshot_id = ?", (snapshot_id,))
