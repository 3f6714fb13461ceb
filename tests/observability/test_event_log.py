"""EventLog on its own: sequence numbers survive a restart, the file is JSONL, the webhook delivers."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from agentenv.observability.events import EventLog


async def test_webhook_delivery_and_seq_across_restart(tmp_path):
    received: list[dict] = []
    calls = {"n": 0}

    async def hook(request: web.Request) -> web.Response:
        calls["n"] += 1
        if calls["n"] == 1:
            return web.Response(status=503)  # the first delivery is retried
        received.append(await request.json())
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/hook", hook)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        log = EventLog(tmp_path, webhook_url=f"http://127.0.0.1:{port}/hook")
        log.start()
        for t in ("created", "paused", "killed"):
            log.emit(t, "iaaaaaaaaaaaaaaaaaaaaa", team_id="t1", reason="request")
        for _ in range(100):
            if len(received) == 3:
                break
            await asyncio.sleep(0.1)
        assert [e["type"] for e in received] == ["created", "paused", "killed"]
        assert [e["seq"] for e in received] == [1, 2, 3]
        await log.close()

        again = EventLog(tmp_path)
        assert again.seq == 3
        ev = again.emit("resumed", "iaaaaaaaaaaaaaaaaaaaaa", team_id="t1")
        assert ev["seq"] == 4
        # history from before the restart comes from the file
        assert [e["seq"] for e in again.read(0, team_id="t1")] == [1, 2, 3, 4]
        assert again.read(0, team_id="other") == []
        await again.close()
        lines = (tmp_path / "events.jsonl").read_text().splitlines()
        assert [json.loads(x)["seq"] for x in lines] == [1, 2, 3, 4]
    finally:
        await runner.cleanup()
