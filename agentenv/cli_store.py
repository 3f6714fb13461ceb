"""`agentenv gc --store`: garbage collection of the snapshot store by hand (storage/storegc.py).

Needs no root and no server lock: it reads the state store (SQLite or the cluster's PostgreSQL)
and the store's manifests, and is safe while servers run and publish.
"""

from __future__ import annotations

import asyncio

import click

from agentenv.config import Settings


def collect_store(settings: Settings, *, dry_run: bool, grace_s: float) -> None:
    from agentenv.state import store_for
    from agentenv.storage.snapshots import store_from_settings
    from agentenv.storage.storegc import collect, state_roots

    async def go():
        state = store_for(settings)
        await state.open()
        try:
            snapshots = store_from_settings(settings)
            return await collect(snapshots, lambda: state_roots(state, snapshots), grace_s=grace_s,
                                 dry_run=dry_run, progress=click.echo)
        finally:
            await state.close()

    asyncio.run(go())
