"""A team's concurrent-sandbox quota holds across the cluster, not per node.

A team with a quota of 3 sends 20 concurrent creates through the gateway: the scheduler spreads
them over three nodes, and each node admits against the team's count in the shared PostgreSQL, so
exactly 3 start (per-node quotas would admit up to 9) and the other 17 get the E2B SDK's
RateLimitException (429 `team_sandbox_limit`). Killing one admits exactly one more.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from e2b import RateLimitException, Sandbox
from sqlalchemy import text

from agentenv.state.postgres import PostgresStateStore

from serverproc import agentenv_executable
from test_cluster_multinode import bindings

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

QUOTA = 3
TRIES = 20


def _cli(cluster, *args: str) -> str:
    """The operator's CLI on the cluster's PostgreSQL (teams and keys live there)."""
    env = {**os.environ, "AGENTENV_DATABASE_URL": cluster.database_url,
           "AGENTENV_DATA_DIR": str(cluster.work / "cli")}
    out = subprocess.run([agentenv_executable(), *args], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _reservations(cluster, team: str) -> list:
    """The team's rows in the shared store's team_reservations."""
    async def go():
        s = PostgresStateStore(cluster.database_url, max_size=1)
        await s.open()
        try:
            async with s.engine.connect() as conn:
                rows = await conn.execute(text("SELECT * FROM team_reservations WHERE team_id = :t"), {"t": team})
                return [tuple(r) for r in rows]
        finally:
            await s.close()

    return asyncio.run(go())


def _create(opts: dict) -> Sandbox | Exception:
    t0 = time.monotonic()
    try:
        sbx = Sandbox.create(timeout=300, request_timeout=300, **opts)
        sbx._took = time.monotonic() - t0  # type: ignore[attr-defined]
        return sbx
    except Exception as e:  # noqa: BLE001 - the caller sorts admitted from refused
        return e


def test_team_quota_holds_across_nodes(cluster):
    _cli(cluster, "teams", "create", "quota3", "--max-sandboxes", str(QUOTA))
    key = _cli(cluster, "keys", "create", "--name", "quota3", "--team", "quota3").splitlines()[-1]
    opts = {**cluster.sdk_opts(), "api_key": key}
    made: list[Sandbox] = []
    try:
        _scenario(cluster, opts, made)
    except BaseException:
        for n in cluster.nodes.values():
            print(f"--- node {n.name} log\n{n.log_tail(40)}")
        raise
    finally:
        for s in made:
            try:
                s.kill()
            except Exception:  # noqa: BLE001 - best effort; the fixture's gc removes the rest
                pass


def _scenario(cluster, opts: dict, made: list[Sandbox]) -> None:
    with ThreadPoolExecutor(TRIES) as pool:
        results = list(pool.map(lambda _i: _create(opts), range(TRIES)))
    made += [r for r in results if isinstance(r, Sandbox)]
    refused = [r for r in results if not isinstance(r, Sandbox)]
    where = bindings(cluster, {s.sandbox_id for s in made})
    print(f"admitted {len(made)} on nodes {sorted(n for n, _ in where.values())} "
          f"in {sorted(round(s._took, 2) for s in made)} s; refused {len(refused)}")
    assert len(made) == QUOTA, results
    assert all(isinstance(e, RateLimitException) and "limit" in str(e).lower() for e in refused), refused
    # the refusals came from the nodes the scheduler placed them on, and every admitted one runs
    assert all(state == "running" for _node, state in where.values())
    assert made[0].commands.run("echo up").stdout == "up\n"
    # every admission released its reservation (the refused ones never kept one)
    assert _reservations(cluster, "quota3") == []

    # a kill frees one place: exactly one of the next concurrent creates is admitted
    made.pop(0).kill()
    with ThreadPoolExecutor(4) as pool:
        again = list(pool.map(lambda _i: _create(opts), range(4)))
    made += [r for r in again if isinstance(r, Sandbox)]
    assert sum(isinstance(r, Sandbox) for r in again) == 1, again
    assert all(isinstance(r, (Sandbox, RateLimitException)) for r in again), again
