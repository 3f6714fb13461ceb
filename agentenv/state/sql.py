"""The state store on SQLAlchemy Core (asyncio): one implementation for SQLite and PostgreSQL.

Queries are built from `schema.py`'s tables, so both databases run the same statements; the few
dialect differences live here, each in one place: the upsert (`INSERT ... ON CONFLICT DO UPDATE`,
which both have, from each dialect's `insert`), the database clock of the node registry
(PostgreSQL's `now()`; SQLite uses this process's clock), and the sweep's advisory lock
(PostgreSQL only; SQLite's write lock already serialises). `open()` migrates (`migrate.py`).

SQLite (aiosqlite): one connection per store (writes are serialised by the database anyway), WAL so
other processes (the CLI) read while the server writes. PostgreSQL (asyncpg): a connection pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
import zlib
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any

from sqlalchemy import Interval, Table, and_, bindparam, delete, event, func, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.sql import ColumnElement, Executable

from agentenv.models import (QUOTA_EXEMPT, SURVIVES_NODE_LOSS, ApiKeyRecord, NodeRecord, SandboxRecord, SandboxState,
                             SnapshotRecord, TeamRecord, TemplateBuildRecord, TemplateRecord, TemplateTag, utcnow)
from agentenv.state import migrate, rows
from agentenv.state.schema import (api_keys, build_cache, nodes, sandboxes, snapshots, team_reservations, teams,
                                   template_builds, template_tags, templates)

_SWEEP_LOCK = 0x61676E7400000002
_TEAM_LOCK_CLASS = 0x61676E74  # pg_advisory_xact_lock(class, hash of the team id): one team's admissions
# A reservation still unsettled after this long no longer counts (a safety net: a node's reservations
# go when it restarts or is declared dead, and each start releases its own when it settles).
RESERVATION_TTL_S = 3600.0


class _OverQuota(Exception):
    def __init__(self, active: int) -> None:
        self.active = active


def _json_contains(col: ColumnElement, value: str) -> ColumnElement:
    """A portable prefilter for "the JSON list in `col` has the string `value`" (callers confirm
    in Python): its JSON encoding appears in the text."""
    needle = json.dumps(value).replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return col.like(f"%{needle}%", escape="\\")


class SQLStateStore:
    """`ClusterStateStore` on an async SQLAlchemy engine. Call `open()` before use, `close()` after."""

    def __init__(self, make_engine) -> None:
        self._make_engine = make_engine
        self._engine: AsyncEngine | None = None
        self._drivers: dict[int, Any] = {}  # the driver connections the pool holds (for `terminate`)
        # team -> [lock, holders]: this process's admissions of one team take a connection one at a time
        self._team_turns: dict[str, list] = {}

    # lifecycle ----------------------------------------------------------------------------------

    async def open(self, *, upgrade: bool = True) -> None:
        """`upgrade=False`: a second store on a database another one already migrated (a node's
        heartbeat connection), without the migration's lock on its way."""
        if self._engine is not None:
            return
        engine = self._make_engine()
        event.listen(engine.sync_engine, "connect", self._track)
        event.listen(engine.sync_engine, "close", self._untrack)
        event.listen(engine.sync_engine, "close_detached", self._untrack)
        try:
            if upgrade:
                await migrate.upgrade(engine)
        except BaseException:
            await engine.dispose()
            raise
        self._engine = engine

    async def close(self) -> None:
        if self._engine is not None:
            engine, self._engine = self._engine, None
            await engine.dispose()

    def _track(self, dbapi_connection: Any, *_: Any) -> None:
        driver = getattr(dbapi_connection, "driver_connection", None)
        if driver is not None:
            self._drivers[id(dbapi_connection)] = driver

    def _untrack(self, dbapi_connection: Any, *_: Any) -> None:
        self._drivers.pop(id(dbapi_connection), None)

    def terminate(self) -> None:
        """Cut every database connection now, without a round trip (a fenced cluster node: a write
        still queued on a connection the network cut must not land after the node rejoined). The
        store is unusable afterwards; `close()` it. Only drivers with a `terminate()` (asyncpg)."""
        for driver in list(self._drivers.values()):
            cut = getattr(driver, "terminate", None)
            if callable(cut):
                cut()
        self._drivers.clear()

    async def __aenter__(self):
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def migrate(self, *, upgrade: bool = True) -> tuple[str | None, str | None]:
        """(revision before, revision after) of the database, upgrading it unless `upgrade` is
        False; works whether or not the store is open (`agentenv db status|upgrade`)."""
        engine = self._make_engine()
        try:
            before = await migrate.revision(engine)
            return before, (await migrate.upgrade(engine) if upgrade else before)
        finally:
            await engine.dispose()

    async def schema_revision(self) -> str | None:
        """The Alembic revision the database is at (`migrate.head()` once open)."""
        return await migrate.revision(self.engine)

    @property
    def engine(self) -> AsyncEngine:
        if self._engine is None:
            raise RuntimeError(f"{type(self).__name__} is not open; call open() first")
        return self._engine

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    # helpers ------------------------------------------------------------------------------------

    async def _rows(self, stmt: Executable) -> list[Any]:
        async with self.engine.connect() as conn:
            return list((await conn.execute(stmt)).mappings().all())

    async def _write(self, stmt: Executable) -> int:
        async with self.engine.begin() as conn:
            return (await conn.execute(stmt)).rowcount

    def _upsert(self, table: Table, values: dict[str, Any], keys: Sequence[str], *,
                guard: Callable[[Any], ColumnElement] | None = None):
        """Insert or update by primary key; `guard(excluded)`: update only where it holds."""
        insert = postgresql.insert if self.dialect == "postgresql" else sqlite.insert
        stmt = insert(table).values(values)
        updates = {c: stmt.excluded[c] for c in values if c not in keys}
        return stmt.on_conflict_do_update(index_elements=list(keys), set_=updates,
                                          where=None if guard is None else guard(stmt.excluded))

    def _now(self) -> Any:
        """The registry's clock: the database's where it has one that all nodes share."""
        return func.now() if self.dialect == "postgresql" else utcnow()

    # sandboxes ----------------------------------------------------------------------------------

    async def put_sandbox(self, rec: SandboxRecord) -> bool:
        await self._write(self._upsert(sandboxes, rows.sandbox_values(rec), ["sandbox_id"]))
        return True

    async def put_sandbox_of(self, rec: SandboxRecord, node_id: str) -> bool:
        rec.node_id = node_id
        return await self._write(self._upsert(sandboxes, rows.sandbox_values(rec), ["sandbox_id"],
                                              guard=lambda excluded: sandboxes.c.node_id == excluded.node_id)) == 1

    async def get_sandbox(self, sandbox_id: str) -> SandboxRecord | None:
        found = await self._rows(select(sandboxes).where(sandboxes.c.sandbox_id == sandbox_id))
        return rows.sandbox(found[0]) if found else None

    async def delete_sandbox(self, sandbox_id: str) -> None:
        await self._write(delete(sandboxes).where(sandboxes.c.sandbox_id == sandbox_id))

    async def delete_sandbox_of(self, sandbox_id: str, node_id: str) -> None:
        await self._write(delete(sandboxes).where(sandboxes.c.sandbox_id == sandbox_id,
                                                  sandboxes.c.node_id == node_id))

    async def list_sandboxes(self, *, team_id: str | None = None, states: list[SandboxState] | None = None,
                             node_id: str | None = None) -> list[SandboxRecord]:
        """Oldest first (by startedAt, then id); `states=[]` matches nothing."""
        if states is not None and not states:
            return []
        stmt = select(sandboxes).order_by(sandboxes.c.started_at, sandboxes.c.sandbox_id)
        if team_id is not None:
            stmt = stmt.where(sandboxes.c.team_id == team_id)
        if node_id is not None:
            stmt = stmt.where(sandboxes.c.node_id == node_id)
        if states is not None:
            stmt = stmt.where(sandboxes.c.state.in_([SandboxState(s).value for s in states]))
        return [rows.sandbox(r) for r in await self._rows(stmt)]

    async def claim_sandbox(self, sandbox_id: str, from_node: str, to_node: str) -> bool:
        return await self._write(
            update(sandboxes).where(sandboxes.c.sandbox_id == sandbox_id, sandboxes.c.node_id == from_node,
                                    sandboxes.c.state == SandboxState.PAUSED.value)
            .values(node_id=to_node, slot=None)) == 1

    # templates ----------------------------------------------------------------------------------

    async def put_template(self, rec: TemplateRecord) -> None:
        await self._write(self._upsert(templates, rows.template_values(rec), ["template_id"]))

    async def get_template(self, id_or_alias: str) -> TemplateRecord | None:
        """An exact template id wins over an alias of another template."""
        found = [rows.template(r) for r in await self._rows(
            select(templates).where(or_(templates.c.template_id == id_or_alias,
                                        _json_contains(templates.c.aliases, id_or_alias))))]
        exact = [t for t in found if t.template_id == id_or_alias]
        aliased = sorted((t for t in found if id_or_alias in t.aliases), key=lambda t: t.template_id)
        return (exact or aliased or [None])[0]

    async def list_templates(self) -> list[TemplateRecord]:
        stmt = select(templates).order_by(templates.c.created_at, templates.c.template_id)
        return [rows.template(r) for r in await self._rows(stmt)]

    async def delete_template(self, template_id: str) -> None:
        """With its builds, tags and build-step cache, in one transaction."""
        async with self.engine.begin() as conn:
            for table in (templates, template_builds, template_tags, build_cache):
                await conn.execute(delete(table).where(table.c.template_id == template_id))

    async def put_build(self, rec: TemplateBuildRecord) -> None:
        await self._write(self._upsert(template_builds, rows.build_values(rec), ["build_id"]))

    async def get_build(self, build_id: str) -> TemplateBuildRecord | None:
        found = await self._rows(select(template_builds).where(template_builds.c.build_id == build_id))
        return rows.build(found[0]) if found else None

    async def list_builds(self, template_id: str | None = None) -> list[TemplateBuildRecord]:
        stmt = select(template_builds).order_by(template_builds.c.created_at, template_builds.c.build_id)
        if template_id is not None:
            stmt = stmt.where(template_builds.c.template_id == template_id)
        return [rows.build(r) for r in await self._rows(stmt)]

    async def delete_build(self, build_id: str) -> None:
        await self._write(delete(template_builds).where(template_builds.c.build_id == build_id))

    async def put_tag(self, rec: TemplateTag) -> None:
        await self._write(self._upsert(template_tags, rows.tag_values(rec), ["template_id", "tag"]))

    async def delete_tag(self, template_id: str, tag: str) -> bool:
        return await self._write(delete(template_tags).where(template_tags.c.template_id == template_id,
                                                             template_tags.c.tag == tag)) > 0

    async def list_tags(self, template_id: str | None = None) -> list[TemplateTag]:
        stmt = select(template_tags).order_by(template_tags.c.created_at, template_tags.c.tag)
        if template_id is not None:
            stmt = stmt.where(template_tags.c.template_id == template_id)
        return [rows.tag(r) for r in await self._rows(stmt)]

    async def put_cache_entry(self, key: str, template_id: str, data: dict) -> None:
        values = {"key": key, "template_id": template_id, "data": json.dumps(data), "created_at": rows.ts(utcnow())}
        await self._write(self._upsert(build_cache, values, ["key"]))

    async def get_cache_entry(self, key: str) -> dict | None:
        found = await self._rows(select(build_cache.c.data).where(build_cache.c.key == key))
        return json.loads(found[0]["data"]) if found else None

    async def list_cache_entries(self) -> list[dict]:
        return [json.loads(r["data"]) for r in await self._rows(select(build_cache.c.data))]

    # API keys -----------------------------------------------------------------------------------

    async def put_api_key(self, rec: ApiKeyRecord) -> None:
        await self._write(self._upsert(api_keys, rows.key_values(rec), ["key_id"]))

    async def find_api_key(self, key_hash: str) -> ApiKeyRecord | None:
        found = await self._rows(select(api_keys).where(api_keys.c.key_hash == key_hash))
        return rows.key(found[0]) if found else None

    async def list_api_keys(self, *, team_id: str | None = None) -> list[ApiKeyRecord]:
        stmt = select(api_keys).order_by(api_keys.c.created_at, api_keys.c.key_id)
        if team_id is not None:
            stmt = stmt.where(api_keys.c.team_id == team_id)
        return [rows.key(r) for r in await self._rows(stmt)]

    async def revoke_api_key(self, key_id: str) -> bool:
        return await self._write(update(api_keys).where(api_keys.c.key_id == key_id).values(revoked=1)) > 0

    # teams --------------------------------------------------------------------------------------

    async def put_team(self, rec: TeamRecord) -> None:
        await self._write(self._upsert(teams, rows.team_values(rec), ["team_id"]))

    async def get_team(self, team_id: str) -> TeamRecord | None:
        found = await self._rows(select(teams).where(teams.c.team_id == team_id))
        return rows.team(found[0]) if found else None

    async def list_teams(self) -> list[TeamRecord]:
        return [rows.team(r) for r in await self._rows(select(teams).order_by(teams.c.created_at, teams.c.team_id))]

    # snapshots ----------------------------------------------------------------------------------

    async def put_snapshot(self, rec: SnapshotRecord) -> None:
        await self._write(self._upsert(snapshots, rows.snapshot_values(rec), ["snapshot_id"]))

    async def get_snapshot(self, id_or_name: str) -> SnapshotRecord | None:
        """By id, or by name (the newest snapshot carrying that name)."""
        found = [rows.snapshot(r) for r in await self._rows(
            select(snapshots).where(or_(snapshots.c.snapshot_id == id_or_name,
                                        _json_contains(snapshots.c.names, id_or_name))))]
        exact = [s for s in found if s.snapshot_id == id_or_name]
        named = sorted((s for s in found if id_or_name in s.names), key=lambda s: s.created_at, reverse=True)
        return (exact or named or [None])[0]

    async def list_snapshots(self, *, team_id: str | None = None) -> list[SnapshotRecord]:
        stmt = select(snapshots).order_by(snapshots.c.created_at, snapshots.c.snapshot_id)
        if team_id is not None:
            stmt = stmt.where(snapshots.c.team_id == team_id)
        return [rows.snapshot(r) for r in await self._rows(stmt)]

    async def delete_snapshot(self, snapshot_id: str) -> None:
        await self._write(delete(snapshots).where(snapshots.c.snapshot_id == snapshot_id))

    # team-quota reservations (cluster-wide admission) --------------------------------------------

    async def reserve_team(self, team_id: str, node_id: str, n: int, limit: int) -> tuple[list[str], int]:
        """Admit `n` more sandboxes of `team_id` against `limit` concurrent ones, counted over every
        node: ([reservation ids], active before) when they fit, ([], active) when they do not. One
        transaction under a per-team lock (PostgreSQL: an advisory lock; SQLite: the write lock the
        insert takes first), so concurrent admissions on any node never both take the last place."""
        if n < 1:
            raise ValueError(f"reserve_team: n must be at least 1, not {n}")
        now = utcnow()
        ids = [uuid.uuid4().hex for _ in range(n)]
        try:
            async with self._team_turn(team_id), self.engine.begin() as conn:
                await self._team_lock(conn, team_id)
                await conn.execute(team_reservations.insert(), [
                    {"reservation_id": rid, "team_id": team_id, "node_id": node_id, "sandbox_id": None,
                     "created_at": now} for rid in ids])
                active = await self._team_active(conn, team_id) - n
                if active + n > limit:
                    raise _OverQuota(active)  # rolls the inserts back
        except _OverQuota as e:
            return [], e.active
        return ids, active

    async def bind_reservation(self, reservation_id: str, sandbox_id: str) -> None:
        """The start holding this reservation is `sandbox_id`: once that sandbox's record counts
        against the quota, the reservation no longer does."""
        await self._write(update(team_reservations).where(team_reservations.c.reservation_id == reservation_id)
                          .values(sandbox_id=sandbox_id))

    async def release_reservations(self, reservation_ids: Sequence[str]) -> None:
        if reservation_ids:
            await self._write(delete(team_reservations)
                              .where(team_reservations.c.reservation_id.in_(list(reservation_ids))))

    async def clear_reservations(self, node_id: str) -> int:
        """Every reservation of `node_id` (a node starting: none of its starts is in flight)."""
        return await self._write(delete(team_reservations).where(team_reservations.c.node_id == node_id))

    async def team_active(self, team_id: str) -> int:
        """The team's sandboxes counted against its quota on every node: records not quota-exempt,
        plus reservations of starts not counted by a record yet."""
        async with self.engine.connect() as conn:
            return await self._team_active(conn, team_id)

    @contextlib.asynccontextmanager
    async def _team_turn(self, team_id: str) -> AsyncIterator[None]:
        """This process's admissions of `team_id` wait for each other here, before they take a pooled
        connection: the team lock below serialises them anyway, and a burst of one team's starts would
        otherwise fill the pool with connections that only wait for that lock (the heartbeat and every
        other query queued behind them)."""
        turn = self._team_turns.setdefault(team_id, [asyncio.Lock(), 0])
        turn[1] += 1
        try:
            async with turn[0]:
                yield
        finally:
            turn[1] -= 1
            if not turn[1]:
                self._team_turns.pop(team_id, None)

    async def _team_lock(self, conn: AsyncConnection, team_id: str) -> None:
        if self.dialect == "postgresql":
            key = zlib.crc32(team_id.encode()) - (1 << 31)  # a signed int4
            await conn.execute(select(func.pg_advisory_xact_lock(_TEAM_LOCK_CLASS, key)))

    async def _team_active(self, conn: AsyncConnection, team_id: str) -> int:
        exempt = [s.value for s in QUOTA_EXEMPT]
        counted = select(sandboxes.c.sandbox_id).where(sandboxes.c.team_id == team_id,
                                                       sandboxes.c.state.not_in(exempt))
        age = timedelta(seconds=RESERVATION_TTL_S)
        cutoff = (func.now() - bindparam("ttl", age, type_=Interval())) if self.dialect == "postgresql" \
            else utcnow() - age
        dead = select(nodes.c.node_id).where(nodes.c.state == "dead")
        r = team_reservations.c
        pending = select(func.count()).select_from(team_reservations).where(
            r.team_id == team_id, r.created_at > cutoff, r.node_id.not_in(dead),
            or_(r.sandbox_id.is_(None), r.sandbox_id.not_in(counted)))
        records = select(func.count()).select_from(counted.subquery())
        # One statement, so one snapshot (PostgreSQL's READ COMMITTED takes one per statement): a
        # start committing its record between two statements would be counted by neither.
        return int(await conn.scalar(select(records.scalar_subquery() + pending.scalar_subquery())))

    # nodes --------------------------------------------------------------------------------------

    async def put_node(self, rec: NodeRecord) -> str:
        """A heartbeat (stamped by the registry's clock); the stored state comes back."""
        values = {"node_id": rec.node_id, "url": rec.url, "state": rec.state, "info": rows.node_info(rec),
                  "heartbeat_at": self._now(), "started_at": rec.started_at}
        stmt = self._upsert(nodes, values, ["node_id"]).returning(nodes.c.state)
        async with self.engine.begin() as conn:
            return (await conn.execute(stmt)).scalar_one()

    async def get_node(self, node_id: str) -> NodeRecord | None:
        found = await self._rows(select(nodes).where(nodes.c.node_id == node_id))
        return rows.node(found[0]) if found else None

    async def list_nodes(self) -> list[NodeRecord]:
        return [rows.node(r) for r in await self._rows(select(nodes).order_by(nodes.c.node_id))]

    async def set_node_state(self, node_id: str, state: str) -> bool:
        return await self._write(update(nodes).where(nodes.c.node_id == node_id).values(state=state)) == 1

    async def expire_nodes(self, dead_after_s: float, *, spare: Iterable[str] = ()) -> dict[str, list[str]]:
        """One transaction: nodes past their deadline (but those in `spare`) become dead and their
        sandboxes that were not safely paused LOST. Returns {node: [lost sandbox ids]} for the nodes
        that died now."""
        async with self.engine.begin() as conn:
            if not await self._sweep_lock(conn):
                return {}  # another scheduler is sweeping right now
            age = timedelta(seconds=dead_after_s)
            cutoff = (func.now() - bindparam("age", age, type_=Interval())) if self.dialect == "postgresql" \
                else utcnow() - age
            dead = await conn.execute(
                update(nodes).where(nodes.c.state != "dead", nodes.c.heartbeat_at < cutoff,
                                    nodes.c.node_id.not_in(list(spare)))
                .values(state="dead").returning(nodes.c.node_id))
            lost = {n: await self._lose_sandboxes(conn, n) for n in dead.scalars().all()}
            if lost:  # its starts in flight died with it: their team-quota reservations go too
                await conn.execute(delete(team_reservations).where(team_reservations.c.node_id.in_(list(lost))))
            return lost

    async def _sweep_lock(self, conn: AsyncConnection) -> bool:
        if self.dialect != "postgresql":
            return True
        return bool(await conn.scalar(select(func.pg_try_advisory_xact_lock(_SWEEP_LOCK))))

    @staticmethod
    async def _lose_sandboxes(conn: AsyncConnection, node_id: str) -> list[str]:
        lost = SandboxState.LOST.value
        safe = and_(sandboxes.c.state.in_([s.value for s in SURVIVES_NODE_LOSS]),
                    or_(sandboxes.c.memory_digest.is_not(None), sandboxes.c.pause_mode == "filesystem"))
        result = await conn.execute(
            update(sandboxes).where(sandboxes.c.node_id == node_id, sandboxes.c.state != lost, ~safe)
            .values(state=lost, slot=None).returning(sandboxes.c.sandbox_id))
        await conn.execute(update(sandboxes).where(sandboxes.c.node_id == node_id, safe,
                                                   sandboxes.c.state == SandboxState.RESUMING.value)
                           .values(state=SandboxState.PAUSED.value, slot=None))  # a resume the node did not finish
        return list(result.scalars().all())
