"""Load test against the gateway: AGENTENV_LOAD_CYCLES (default 500) concurrent create + command +
kill cycles through the async E2B SDK.

All cycles start at once; the cluster bounds what runs (the scheduler admits at most
`max_starting_per_node` starts per node and `max_sandboxes` per node; the rest wait in the
scheduler up to `admission_wait_s`, then get the typed 503 `cluster_full` with Retry-After, which
the clients honour). Asserted: every cycle ends (no request lost: a result or a typed error), no
node ever exceeds its capacity, and afterwards no sandbox, container, netns, mount or record is
left on any node. Loopback/bridge only; bounded by a deadline.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import threading
import time
from collections import Counter

import pytest
from e2b import AsyncSandbox
from e2b.exceptions import ServiceBusyException

from test_cluster_multinode import bindings

pytestmark = [pytest.mark.cluster, pytest.mark.load, pytest.mark.timeout(3600)]

CYCLES = int(os.environ.get("AGENTENV_LOAD_CYCLES", "500"))
DEADLINE_S = float(os.environ.get("AGENTENV_LOAD_DEADLINE_S", "2400"))
# Per request. Generous on purpose: CI and developer machines are small and shared; what is asserted
# is that every request ends with an answer, not how fast (that is benchmarks/ territory).
REQUEST_TIMEOUT_S = 600


class StepFailed(Exception):
    """Which step of a cycle failed, and how (the original error is the cause)."""


async def _cycle(i: int, opts: dict, stats: Counter, deadline: float) -> str:
    try:
        return await _cycle_steps(i, opts, stats, deadline)
    except StepFailed:
        raise
    except Exception as e:  # noqa: BLE001
        raise StepFailed(f"create: {type(e).__name__}: {e}") from e


async def _cycle_steps(i: int, opts: dict, stats: Counter, deadline: float) -> str:
    delay = 1.0
    while True:
        try:
            sbx = await AsyncSandbox.create(timeout=900, request_timeout=REQUEST_TIMEOUT_S, **opts)
            break
        except ServiceBusyException as e:  # typed 503: honour the advice, bounded by the deadline
            stats["busy_503"] += 1
            if time.monotonic() > deadline:
                return f"busy: {e}"
            await asyncio.sleep(delay * random.uniform(0.5, 1.5))
            delay = min(delay * 2, 8.0)
    stats["created"] += 1
    try:
        try:
            # `timeout` bounds the command's own run (SDK default 60 s), which at load 50 on two
            # shared cores an `echo` in a sandbox among ~50 busy ones can exceed.
            out = await sbx.commands.run(f"echo cycle-{i}", timeout=REQUEST_TIMEOUT_S,
                                         request_timeout=REQUEST_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001
            raise StepFailed(f"command: {type(e).__name__}: {e}") from e
        if out.stdout.strip() != f"cycle-{i}":
            return f"wrong output {out.stdout!r}"
    finally:
        try:
            await sbx.kill(request_timeout=REQUEST_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001
            raise StepFailed(f"kill: {type(e).__name__}: {e}") from e
    return "ok"


def _server_side(cluster, failures: list) -> str:
    """The gateway's and nodes' log records of the failed requests (their request ids), so that a red
    run says why a server answered 500, not only that it did."""
    ids = {m for f in failures for m in re.findall(r"request id ([0-9a-f]{16})", str(f))}
    logs = {"gateway": cluster.gateway.log_path, **{name: n.log_path for name, n in cluster.nodes.items()}}
    found = []
    for name, path in logs.items():
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        found += [f"{name}: {line[:3000]}" for line in lines if any(i in line for i in ids)]
    return "\n".join(found[:10]) or f"(no log record names the request ids {sorted(ids)[:5]})"


def test_load_cycles_through_gateway(cluster):
    opts = dict(api_key=cluster.api_key, api_url=cluster.gateway.url, sandbox_url=cluster.gateway.url)
    stats: Counter = Counter()
    peaks: Counter = Counter()
    stop = threading.Event()

    def watch() -> None:  # the nodes' own heartbeats: active sandboxes never above max_sandboxes
        while not stop.is_set():
            try:
                for nid, n in cluster.node_status().items():
                    peaks[nid] = max(peaks[nid], n["sandboxes"])
                    peaks[f"{nid}-max"] = n["max_sandboxes"]
            except Exception:  # noqa: BLE001
                pass
            stop.wait(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()

    async def run() -> list:
        deadline = time.monotonic() + DEADLINE_S
        tasks = [asyncio.create_task(asyncio.wait_for(_cycle(i, opts, stats, deadline), DEADLINE_S + 300))
                 for i in range(CYCLES)]
        return await asyncio.gather(*tasks, return_exceptions=True)

    t0 = time.monotonic()
    results = asyncio.run(run())
    elapsed = time.monotonic() - t0
    stop.set()
    watcher.join(5)
    outcome = Counter("ok" if r == "ok" else (str(r).split(":")[0] if isinstance(r, StepFailed) else
                                              type(r).__name__ if isinstance(r, BaseException) else r.split(":")[0])
                      for r in results)
    print(f"\n{CYCLES} cycles in {elapsed:.0f}s ({CYCLES / elapsed:.2f}/s): {dict(outcome)}; 503s honoured: "
          f"{stats['busy_503']}; node peaks: {dict(peaks)}")
    lost = [r for r in results if isinstance(r, (asyncio.TimeoutError, TimeoutError))]
    assert not lost, f"{len(lost)} cycles never ended"
    failures = [r for r in results if r != "ok"]
    # Every failure must be a typed API error (an E2B SDK exception carrying the server's message).
    causes = [r.__cause__ if isinstance(r, StepFailed) else r for r in failures]
    untyped = [f"{r}" for r, c in zip(failures, causes)
               if isinstance(c, BaseException) and type(c).__module__.split(".")[0] != "e2b"]
    assert not untyped, f"untyped failures: {untyped[:5]}"
    assert outcome["ok"] == CYCLES, f"{len(failures)} cycles failed: {failures[:5]}; what the servers logged of " \
        f"them:\n{_server_side(cluster, failures)}\nthe nodes' lease:\n" + \
        "\n".join(f"{name}: {line}" for name, node in cluster.nodes.items()
                  for line in node.log_tail(20000).splitlines() if "heartbeat" in line or "FENCED" in line)[-6000:]
    for nid in ("a", "b", "c"):
        assert peaks[nid] <= peaks[f"{nid}-max"], f"node {nid} went over capacity: {dict(peaks)}"

    # Nothing left: no records, and on every node no container, netns, mount or sandbox dir.
    assert not [k for k, (_n, st) in bindings(cluster).items() if st != "lost"], "sandbox records left"
    time.sleep(1)
    for node in cluster.nodes.values():
        if node.killed:
            continue
        left = [x for x in node.leftovers() if not x.startswith("process")]
        assert not left, f"node {node.name} leaks: {left}"
        dirs = list((node.data_dir / "sandboxes").glob("i*")) if (node.data_dir / "sandboxes").exists() else []
        assert not dirs, f"node {node.name} keeps sandbox dirs: {dirs[:5]}"
