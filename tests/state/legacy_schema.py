"""The schemas of the hand-written state stores (agentenv before the SQLAlchemy/Alembic store),
copied verbatim from their migration lists, to make databases as those releases left them.

Each store kept `schema_version (version INTEGER)`; migration N brought it from N to N+1.
"""

SQLITE_MIGRATIONS: list[str] = [
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
]

POSTGRES_MIGRATIONS: list[str] = [
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
]
