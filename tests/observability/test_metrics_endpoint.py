"""`mount_metrics` on a bare aiohttp app (as the cluster roles use it): open, or bearer-token protected."""

from __future__ import annotations

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from agentenv.observability.metrics import Metrics, mount_metrics


async def _serve(app: web.Application):
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def test_mount_metrics_open_and_with_token():
    reg = CollectorRegistry()
    c = Counter("role_things_total", "things", registry=reg)
    c.inc(7)
    open_app, locked_app = web.Application(), web.Application()
    mount_metrics(open_app, reg)

    async def key_ok(request):
        return request.headers.get("X-API-KEY") == "good"

    mount_metrics(locked_app, reg, bearer_token="s3cret", also_allow=key_ok)
    r1, u1 = await _serve(open_app)
    r2, u2 = await _serve(locked_app)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(u1 + "/metrics") as r:
                assert r.status == 200
                fams = {f.name: f for f in text_string_to_metric_families(await r.text())}
                assert fams["role_things"].samples[0].value == 7
            async with s.get(u2 + "/metrics") as r:
                assert r.status == 401 and (await r.json())["code"] == 401
            async with s.get(u2 + "/metrics", headers={"Authorization": "Bearer wrong"}) as r:
                assert r.status == 401
            async with s.get(u2 + "/metrics", headers={"Authorization": "Bearer s3cret"}) as r:
                assert r.status == 200 and "role_things_total 7.0" in await r.text()
            async with s.get(u2 + "/metrics", headers={"X-API-KEY": "good"}) as r:
                assert r.status == 200
    finally:
        await r1.cleanup()
        await r2.cleanup()


def test_metrics_registries_are_independent():
    a, b = Metrics(process=False), Metrics(process=False)
    a.observe_op("create", 0.5)
    fa = {f.name: f for f in text_string_to_metric_families(a.render().decode())}
    fb = {f.name: f for f in text_string_to_metric_families(b.render().decode())}
    count = lambda fams: sum(s.value for s in fams["agentenv_sandbox_operation_duration_seconds"].samples  # noqa: E731
                             if s.name.endswith("_count") and s.labels["operation"] == "create")
    assert count(fa) == 1 and count(fb) == 0
