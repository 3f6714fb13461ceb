"""A node never runs more than `max_sandboxes`: concurrent creates beyond it get the typed 503.

The admission check and the reservation happen with no await in between, and the reservation
stands until the start settles, so a burst of creates cannot slip past the limit while earlier
ones are still resolving their template or pulling a memory image.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import requests
from e2b import AsyncSandbox
from prometheus_client.parser import text_string_to_metric_families

from serverproc import new_data_dir, remove_data_dir, start_extra_server

pytestmark = pytest.mark.timeout(600)

LIMIT = 2
BURST = 8


def _active(url: str) -> float:
    text = requests.get(f"{url}/metrics", timeout=10).text
    for fam in text_string_to_metric_families(text):
        if fam.name == "agentenv_node_sandboxes_active":
            return fam.samples[0].value
    raise AssertionError("agentenv_node_sandboxes_active missing from /metrics")


def test_burst_of_creates_never_exceeds_node_capacity(server):
    d = new_data_dir("cap")
    srv = start_extra_server(d, env={"AGENTENV_MAX_SANDBOXES": str(LIMIT)})
    peak = [0.0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            try:
                peak[0] = max(peak[0], _active(srv.url))
            except requests.RequestException:
                pass
            stop.wait(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    try:
        watcher.start()

        async def scenario() -> tuple:
            results = await asyncio.gather(*(AsyncSandbox.create(timeout=300, **srv.sdk_opts())
                                             for _ in range(BURST)), return_exceptions=True)
            made = [r for r in results if isinstance(r, AsyncSandbox)]
            refused = [r for r in results if not isinstance(r, AsyncSandbox)]
            srv.known_ids.update(s.sandbox_id for s in made)
            listed = requests.get(f"{srv.url}/sandboxes", headers=srv.headers(), timeout=10).json()
            again = None
            if len(made) == LIMIT:  # room frees up as soon as a sandbox is gone
                await made[0].kill()
                again = await AsyncSandbox.create(timeout=300, **srv.sdk_opts())
                srv.known_ids.add(again.sandbox_id)
            for s in [*made, again]:
                if s is not None:
                    await s.kill()
            return made, refused, listed, again

        made, refused, listed, again = asyncio.run(scenario())
        assert len(made) == LIMIT, f"{len(made)} of {BURST} creates succeeded with max_sandboxes={LIMIT}: {refused}"
        for e in refused:  # typed, with the reason; nothing untyped or lost
            assert type(e).__module__.split(".")[0] == "e2b", repr(e)
            assert "capacity" in str(e), str(e)
        assert len(listed) == LIMIT, listed
        assert again is not None
        stop.set()
        watcher.join(5)
        assert peak[0] <= LIMIT, f"node reported {peak[0]} active sandboxes with max_sandboxes={LIMIT}"
    finally:
        stop.set()
        srv.stop()
        remove_data_dir(d)
