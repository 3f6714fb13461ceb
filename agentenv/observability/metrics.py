"""Prometheus metrics: one registry per server process, reusable by every role.

Why a private `CollectorRegistry` instead of prometheus_client's global one: tests and the cluster
roles can build several apps in one process, and each must expose only its own series. Gauges that
describe *current* state (sandboxes per state, node capacity) are computed by collectors at scrape
time from the live view, so they can never drift from the truth; event-like series (latencies,
failures, bytes moved) are counters and histograms updated where the event happens.

Cardinality is bounded on purpose: no sandbox ids on any series here (per-sandbox numbers live in
`GET /sandboxes/{id}/metrics`), operations/reasons come from fixed sets, and template labels are
capped (see `TEMPLATE_LABEL_CAP`).
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.process_collector import ProcessCollector

# No `<name>_created` timestamp series: they double the exposition and Prometheus ignores them.
disable_created_metrics()

# Lifecycle operations timed by `agentenv_sandbox_operation_duration_seconds`.
OPERATIONS = ("create", "restore", "pause", "resume", "snapshot", "fork", "kill")
# Sandbox creates take 0.3-2 s, captures of big sandboxes tens of seconds.
LIFECYCLE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0, 120.0)
PROXY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TRANSFER_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
# More distinct templates than this on one node are summed under template="other".
TEMPLATE_LABEL_CAP = 50


class Metrics:
    """The event-driven series of one server. Current-state gauges come from collectors."""

    def __init__(self, registry: CollectorRegistry | None = None, *, process: bool = True) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        if process:
            ProcessCollector(registry=r)
        self.op_duration = Histogram(
            "agentenv_sandbox_operation_duration_seconds",
            "Wall time of successful sandbox lifecycle operations (restore = create from a snapshot).",
            ["operation"], buckets=LIFECYCLE_BUCKETS, registry=r)
        self.op_failures = Counter(
            "agentenv_sandbox_operation_failures_total",
            "Lifecycle operations that failed, by operation and reason (the API error_code).",
            ["operation", "reason"], registry=r)
        self.events = Counter(
            "agentenv_sandbox_events_total", "Lifecycle events written to the event log, by type.",
            ["type"], registry=r)
        self.fork_children = Counter(
            "agentenv_fork_children_total", "Fork children started, by result.", ["result"], registry=r)
        for op in OPERATIONS:  # every series exists from the first scrape (rate() needs a zero)
            self.op_duration.labels(op)
        for t in ("created", "forked", "paused", "resumed", "snapshotted", "killed", "expired", "failed"):
            self.events.labels(t)
        for result in ("ok", "error"):
            self.fork_children.labels(result)
        self.snapshot_transfer_bytes = Counter(
            "agentenv_snapshot_store_transfer_bytes_total",
            "Bytes of snapshot blobs sent to (upload) or fetched from (download) the snapshot store; "
            "uploads count a blob's size even when the store already had it.",
            ["direction"], registry=r)
        self.snapshot_transfer_seconds = Histogram(
            "agentenv_snapshot_store_transfer_duration_seconds",
            "Wall time of one blob transfer to/from the snapshot store.",
            ["direction"], buckets=TRANSFER_BUCKETS, registry=r)
        for d in ("upload", "download"):
            self.snapshot_transfer_bytes.labels(d)
            self.snapshot_transfer_seconds.labels(d)
        self.proxy_requests = Counter(
            "agentenv_proxy_requests_total", "Requests the data-plane proxy forwarded into sandboxes.",
            ["port", "code"], registry=r)
        self.proxy_duration = Histogram(
            "agentenv_proxy_request_duration_seconds",
            "Time from a proxied request's arrival until its response (or stream) ended.",
            ["port"], buckets=PROXY_BUCKETS, registry=r)
        self.proxy_bytes = Counter(
            "agentenv_proxy_bytes_total", "Body bytes through the data-plane proxy (in = to the sandbox).",
            ["port", "direction"], registry=r)
        self.proxy_active = Gauge(
            "agentenv_proxy_active_requests", "Proxied requests and streams open right now.", registry=r)
        self.http_requests = Counter(
            "agentenv_http_requests_total", "Control-API requests by route template, method and status.",
            ["route", "method", "status"], registry=r)
        self.http_duration = Histogram(
            "agentenv_http_request_duration_seconds", "Control-API request latency by route template.",
            ["route", "method"], buckets=PROXY_BUCKETS + (120.0,), registry=r)
        self.sample_duration = Gauge(
            "agentenv_resource_sampler_duration_seconds",
            "How long the last pass of the sandbox resource sampler took.", registry=r)

    def count_host_files(self, sends: Callable[[], int], stages: Callable[[], int]) -> None:
        """The traffic proxy's own counts of downloads sent from the host and uploads staged there,
        read at each scrape."""
        self.registry.register(_ReadCounter(
            "agentenv_proxy_host_file_sends",
            "Downloads (GET /files) sent from the sandbox's disk on the host instead of through the "
            "sandbox's network (agentenv/proxy/hostfiles.py).", sends))
        self.registry.register(_ReadCounter(
            "agentenv_proxy_host_file_stages",
            "Uploads (POST /files) whose body the host wrote into the sandbox's root dir for envd to "
            "take, instead of sending it through the sandbox's network (agentenv/proxy/hostfiles.py).", stages))

    def observe_op(self, operation: str, seconds: float) -> None:
        self.op_duration.labels(operation).observe(seconds)

    def failed_op(self, operation: str, reason: str) -> None:
        self.op_failures.labels(operation, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def cap_labels(counts: dict[tuple, float], index: int, cap: int = TEMPLATE_LABEL_CAP) -> dict[tuple, float]:
    """Fold label values at `index` beyond the `cap` most frequent into "other"."""
    totals: dict[str, float] = {}
    for key, v in counts.items():
        totals[key[index]] = totals.get(key[index], 0) + v
    if len(totals) <= cap:
        return counts
    keep = set(sorted(totals, key=lambda k: -totals[k])[:cap])
    out: dict[tuple, float] = {}
    for key, v in counts.items():
        if key[index] not in keep:
            key = key[:index] + ("other",) + key[index + 1:]
        out[key] = out.get(key, 0) + v
    return out


def mount_metrics(app: web.Application, registry: CollectorRegistry, *, path: str = "/metrics",
                  bearer_token: str | None = None,
                  also_allow: Callable[[web.Request], Awaitable[bool]] | None = None,
                  before_scrape: Callable[[], Awaitable[None]] | None = None) -> web.AbstractRoute:
    """Serve `registry` in the Prometheus text format at `path` on any aiohttp app.

    With `bearer_token` set, a scrape must send `Authorization: Bearer <token>` (Prometheus'
    `authorization`/`bearer_token` scrape options); `also_allow(request)` may be an async check
    that admits other callers too (the server uses it to accept an API key). Without a token the
    endpoint is open — fine on a loopback or private listener; set one on anything public.
    `before_scrape` is awaited first: roles whose numbers live behind an async call (a state store)
    refresh them there, since collectors themselves are synchronous.
    """

    async def handler(request: web.Request) -> web.Response:
        if bearer_token:
            sent = request.headers.get("Authorization", "")
            ok = sent.startswith("Bearer ") and hmac.compare_digest(sent[7:].strip().encode(), bearer_token.encode())
            if not ok and also_allow is not None:
                ok = bool(await also_allow(request))
            if not ok:
                return web.json_response({"code": 401, "message": "metrics need 'Authorization: Bearer <token>' "
                                          "(metrics_bearer_token) or a valid X-API-Key"}, status=401,
                                         headers={"WWW-Authenticate": "Bearer"})
        t0 = time.perf_counter()
        if before_scrape is not None:
            await before_scrape()
        body = generate_latest(registry)
        resp = web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
        resp.headers["X-Render-Seconds"] = f"{time.perf_counter() - t0:.6f}"
        return resp

    return app.router.add_get(path, handler)


class _ReadCounter:
    """A counter whose value another object keeps (a custom collector: prometheus_client's Counter
    cannot take a function)."""

    def __init__(self, name: str, documentation: str, read: Callable[[], int]) -> None:
        self._name, self._doc, self._read = name, documentation, read

    def describe(self):
        return [CounterMetricFamily(self._name, self._doc)]

    def collect(self):
        yield CounterMetricFamily(self._name, self._doc, value=self._read())
