"""Baseline: the schema both hand-written stores had reached (SQLite version 7, PostgreSQL version 2).

Convergent, so that every database an older agentenv left behind upgrades in place: on an empty
database it creates everything; on one made by the hand-written migration lists (any of their
versions) it adds only the tables, columns and indexes that are missing, creates the teams of
existing API keys when it creates `teams` (what SQLite's migration 2 -> 3 did), and turns the old
`schema_version` counter into a tombstone that makes old agentenv releases refuse the database.

A frozen copy of the schema as of this revision: later changes go into new revisions, never here.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

LEGACY_VERSION = 1000
_m = sa.MetaData()
_BigInt = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _text(name, *, null=True, default=None):
    kw = {"server_default": sa.text(default)} if default is not None else {}
    return sa.Column(name, sa.Text, nullable=null, **kw)


def _int(name, *, null=True, default=None):
    kw = {"server_default": sa.text(default)} if default is not None else {}
    return sa.Column(name, sa.Integer, nullable=null, **kw)


sa.Table("sandboxes", _m, sa.Column("sandbox_id", sa.Text, primary_key=True),
         _text("template_id", null=False), _text("team_id", null=False), _text("state", null=False),
         _text("started_at", null=False), _text("end_at", null=False), _int("cpu_count", null=False),
         _int("memory_mb", null=False), _int("disk_mb", null=False), _text("envd_access_token", null=False),
         _text("traffic_access_token"), _text("alias"), _text("metadata", null=False, default="'{}'"),
         _text("env_vars", null=False, default="'{}'"), _int("auto_pause", null=False, default="0"),
         _int("auto_resume", null=False, default="0"), _int("allow_internet_access", null=False, default="1"),
         _text("network"), _int("slot"), _text("runtime", null=False), _text("node_id", null=False),
         _text("parent_id"), _text("snapshot_id"), _text("created_at", null=False),
         _text("image", null=False, default="'base'"), _text("layers", null=False, default="'[]'"),
         _text("pause_mode"), _text("memory_digest"),
         sa.Index("sandboxes_team_state", "team_id", "state"), sa.Index("sandboxes_node", "node_id"))
sa.Table("templates", _m, sa.Column("template_id", sa.Text, primary_key=True),
         _text("aliases", null=False, default="'[]'"), _int("cpu_count", null=False), _int("memory_mb", null=False),
         _int("disk_mb", null=False), _text("image", null=False), _int("public", null=False, default="1"),
         _text("created_at", null=False), _text("team_id"), _text("runtime"))
sa.Table("template_builds", _m, sa.Column("build_id", sa.Text, primary_key=True), _text("template_id", null=False),
         _text("team_id", null=False), _text("status", null=False), _text("created_at", null=False),
         _text("data", null=False, default="'{}'"), sa.Index("template_builds_template", "template_id", "created_at"))
sa.Table("template_tags", _m, _text("template_id", null=False), _text("tag", null=False),
         _text("build_id", null=False), _text("created_at", null=False),
         sa.PrimaryKeyConstraint("template_id", "tag"))
sa.Table("build_cache", _m, sa.Column("key", sa.Text, primary_key=True), _text("template_id", null=False),
         _text("data", null=False), _text("created_at", null=False),
         sa.Index("build_cache_template", "template_id"))
sa.Table("api_keys", _m, sa.Column("key_id", sa.Text, primary_key=True),
         sa.Column("key_hash", sa.Text, nullable=False, unique=True), _text("team_id", null=False),
         _text("name", null=False), _text("created_at", null=False), _int("revoked", null=False, default="0"),
         sa.Index("api_keys_team", "team_id"))
sa.Table("teams", _m, sa.Column("team_id", sa.Text, primary_key=True), _text("name", null=False),
         _int("max_sandboxes"), _text("created_at", null=False))
sa.Table("snapshots", _m, sa.Column("snapshot_id", sa.Text, primary_key=True), _text("team_id", null=False),
         _text("names", null=False, default="'[]'"), _text("source_sandbox_id"), _text("template_id", null=False),
         _text("image", null=False), _text("layers", null=False, default="'[]'"), _text("memory_digest"),
         _int("cpu_count", null=False), _int("memory_mb", null=False), _int("disk_mb", null=False),
         _text("env_vars", null=False, default="'{}'"), _text("metadata", null=False, default="'{}'"),
         sa.Column("size_bytes", _BigInt, nullable=False, server_default=sa.text("0")), _text("restore_token"),
         _text("created_at", null=False), _text("network"), _text("runtime"),
         sa.Index("snapshots_team", "team_id", "created_at"))
sa.Table("nodes", _m, sa.Column("node_id", sa.Text, primary_key=True), _text("url", null=False),
         _text("state", null=False), _text("info", null=False),
         sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
         sa.Column("started_at", sa.DateTime(timezone=True), nullable=False))
sa.Table("schema_version", _m, _int("version", null=False))


def _converge(bind, table: sa.Table) -> None:
    """Add the columns and indexes of `table` that an existing table lacks."""
    have = {c["name"] for c in sa.inspect(bind).get_columns(table.name)}
    for col in table.columns:
        if col.name not in have:
            op.add_column(table.name, col._copy())
    if bind.dialect.name == "sqlite":
        _pk_not_null(bind, table.name)
    indexes = {i["name"] for i in sa.inspect(bind).get_indexes(table.name)}
    for index in table.indexes:
        if index.name not in indexes:
            index.create(bind)


def _pk_not_null(bind, name: str) -> None:
    """SQLite let the old `x TEXT PRIMARY KEY` columns hold NULL (a SQLite quirk); the schema says
    NOT NULL. SQLite cannot alter a column: Alembic's batch mode copies the table into a new one."""
    insp = sa.inspect(bind)
    pk = set(insp.get_pk_constraint(name)["constrained_columns"])
    loose = [c["name"] for c in insp.get_columns(name) if c["name"] in pk and c["nullable"]]
    if loose:
        with op.batch_alter_table(name, recreate="always") as batch:
            for col in loose:
                batch.alter_column(col, existing_type=sa.Text(), nullable=False)


def upgrade() -> None:
    bind = op.get_bind()
    existing = set(sa.inspect(bind).get_table_names())
    for table in _m.sorted_tables:
        if table.name not in existing:
            table.create(bind)
        else:
            _converge(bind, table)
    if "teams" not in existing and "api_keys" in existing:
        op.execute("INSERT INTO teams (team_id, name, created_at) "
                   "SELECT team_id, team_id, MIN(created_at) FROM api_keys GROUP BY team_id")
    op.execute("DELETE FROM schema_version")
    op.execute(f"INSERT INTO schema_version (version) VALUES ({LEGACY_VERSION})")


def downgrade() -> None:
    raise NotImplementedError("the baseline has no downgrade: restore a backup of the database instead")
