"""The pool of ready sandboxes and lifecycle throughput (steps `pool` and `lifecycle` of run.py).

- `pool`: `Sandbox.create()` + first `commands.run("true")` with a pool of ready sandboxes
  (`AGENTENV_POOL_SIZE`), sequential; the pool is let refill between samples (untimed), so every
  sample is a create from the pool (checked with the `agentenv_sandbox_pool_taken` counter).
- `lifecycle`: N concurrent clients (threads, one SDK each) loop create → `commands.run("true")` →
  kill for a fixed time; throughput = finished cycles / time, and per core; latency of one cycle.
  Run without a pool and with one.

The server is restarted with the pool setting each needs (BenchServer.start(env=...)).
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time

from machine import machine_cpu_s

POOL_SIZE = int(os.environ.get("AGENTENV_BENCH_POOL_SIZE", "2"))


def metric(url: str, name: str, template: str = "base") -> float:
    import requests
    text = requests.get(f"{url}/metrics", timeout=10).text
    m = re.search(rf'^{name}(?:_total)?{{template="{re.escape(template)}"}} ([0-9.e+]+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def wait_pool(url: str, size: int, limit: float = 180.0) -> float:
    t0 = time.monotonic()
    while metric(url, "agentenv_sandbox_pool_ready") < size:
        if time.monotonic() - t0 > limit:
            raise TimeoutError(f"the pool did not fill to {size} in {limit:.0f}s")
        time.sleep(0.05)
    return time.monotonic() - t0


def restart(bench, pool_size: int, env: dict[str, str] | None = None) -> None:
    bench.srv.stop()
    bench.srv.start(env={"AGENTENV_POOL_SIZE": str(pool_size), **(env or {})})
    if pool_size:
        wait_pool(bench.srv.url, pool_size, 300)


def _pooled_ids(bench) -> list[str]:
    """The pool's sandboxes: sandbox dirs of the server that no sandbox record lists."""
    from e2b import Sandbox

    listed = {s.sandbox_id for s in Sandbox.list(api_key=bench.srv.key, api_url=bench.srv.url).next_items()}
    d = bench.srv.data_dir / "sandboxes"
    return sorted(p.name for p in d.iterdir() if p.name not in listed) if d.exists() else []


def idle_pool_cpu(bench, log, stats, seconds: float, reps: int) -> dict:
    """Host CPU of the pool's ready sandboxes while they wait, in ms a second (their cgroups): frozen
    (`pool_freeze`, the default) and left running (`AGENTENV_POOL_FREEZE=false`), one after the other;
    then `reps` creates + first command from each kind."""
    from agentenv.observability.sampler import cgroup_usage

    out = {}
    for kind, freeze in (("frozen", "true"), ("running", "false")):
        restart(bench, POOL_SIZE, {"AGENTENV_POOL_FREEZE": freeze})
        time.sleep(2.0)  # past the restores' tails
        ids = _pooled_ids(bench)
        u0 = {sid: cgroup_usage(sid) for sid in ids}
        time.sleep(seconds)
        u1 = {sid: cgroup_usage(sid) for sid in ids}
        vals = [(u1[i][0] - u0[i][0]) / 1e6 / seconds for i in ids if u0.get(i) and u1.get(i)]
        firsts = []
        for _ in range(reps):  # creates that take one of them: thawing is on their path
            wait_pool(bench.srv.url, POOL_SIZE)
            time.sleep(1.0)  # frozen again (a refill freezes its sandbox when it is ready)
            firsts.append(sum(bench.create_first_command()))
        out[kind] = {"cpu_ms_per_s": stats(vals), "create_first_cmd": stats(firsts)}
        log(f"pool: {len(vals)} ready sandboxes {kind} while they wait: {out[kind]['cpu_ms_per_s']['p50'] or 0:.1f} ms/s; "
            f"create + first command from them p50 {(out[kind]['create_first_cmd']['p50'] or 0) * 1000:.0f} ms")
    out["seconds"] = seconds
    return out


def bench_pool(bench, log, stats) -> None:
    n = 10 if bench.quick else 30
    restart(bench, POOL_SIZE)
    url = bench.srv.url
    try:
        taken0 = metric(url, "agentenv_sandbox_pool_taken")
        total, create, first, refill = [], [], [], []
        log(f"pool: {n} creates from a pool of {POOL_SIZE} + first command")
        for _ in range(n):
            refill.append(wait_pool(url, POOL_SIZE))
            c, f = bench.create_first_command()
            total.append(c + f)
            create.append(c)
            first.append(f)
        from_pool = metric(url, "agentenv_sandbox_pool_taken") - taken0
        bench.results["pool"] = {"size": POOL_SIZE, "ours": stats(total), "ours_create_call": stats(create),
                                 "ours_first_cmd": stats(first), "from_pool": from_pool,
                                 "refill_wait": stats(refill),
                                 "idle": idle_pool_cpu(bench, log, stats, 5.0 if bench.quick else 10.0,
                                                      5 if bench.quick else 15)}
    finally:
        restart(bench, 0)


def _clients(bench, clients: int, seconds: float) -> dict:
    stop_at = time.monotonic() + seconds
    lat: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client() -> None:
        while time.monotonic() < stop_at:
            t0 = time.monotonic()
            try:
                sbx = bench.create()
                try:
                    sbx.commands.run("true")
                finally:
                    sbx.kill()
            except Exception as e:  # noqa: BLE001 - counted, the run goes on
                with lock:
                    errors.append(repr(e)[:200])
                continue
            with lock:
                lat.append(time.monotonic() - t0)

    cpu0, t0 = machine_cpu_s(), time.monotonic()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0  # includes the cycles that finish after stop_at
    cpu = machine_cpu_s() - cpu0  # the SDK clients' share is in it too (~5 ms a cycle, seventh session)
    return {"clients": clients, "cycles": len(lat), "seconds": elapsed, "per_s": len(lat) / elapsed,
            "per_s_per_core": len(lat) / elapsed / (os.cpu_count() or 1), "latency": lat, "errors": errors,
            "machine_cpu_s": cpu, "cpu_ms_per_cycle": 1000 * cpu / len(lat) if lat else None}


def _raw_lifecycle(bench, log, stats, image, layer, clients: int, seconds: float) -> dict:
    """The same cycles on bare runsc (`Raw.lifecycle`) from `image`, a container running envd taken as
    agentenv takes its warm image (after one login shell)."""
    log(f"lifecycle: raw, {clients} clients, {seconds} s")
    r = bench.raw.run(bench.raw.lifecycle(image, layer, clients, seconds))
    r["latency"] = stats(r["latency"])
    log(f"lifecycle: raw {r['per_s']:.2f}/s ({r['per_s_per_core']:.2f}/s per core), "
        f"{r['cpu_ms_per_cycle'] or 0:.0f} ms CPU a cycle, errors {len(r['errors'])}")
    return r


def bench_lifecycle(bench, log, stats) -> None:
    seconds = 15 if bench.quick else 30
    out: dict = {"seconds": seconds, "cores": os.cpu_count()}
    raw = bench.raw
    image, layer = (raw.root / "ckpt-lifecycle", raw.root / "layer-lifecycle") if raw else (None, None)
    try:
        if raw is not None:
            raw.run(raw.image(image, layer))
        for pool in sorted({0, POOL_SIZE}):
            restart(bench, pool)
            for clients in (4, 8):
                # the raw run right before agentenv's without a pool, so the two see the same load
                if raw is not None and pool == 0:
                    out[f"raw_c{clients}"] = _raw_lifecycle(bench, log, stats, image, layer, clients, seconds)
                log(f"lifecycle: {clients} clients, pool {pool}, {seconds} s")
                r = _clients(bench, clients, seconds)
                r["latency"] = stats(r["latency"])
                out[f"pool{pool}_c{clients}"] = r
                log(f"lifecycle: {r['per_s']:.2f}/s ({r['per_s_per_core']:.2f}/s per core), "
                    f"p50 {r['latency']['p50']:.2f}s, {r['cpu_ms_per_cycle'] or 0:.0f} ms CPU a cycle, "
                    f"errors {len(r['errors'])}")
    finally:
        if raw is not None:
            shutil.rmtree(image, ignore_errors=True)
            shutil.rmtree(layer, ignore_errors=True)
        restart(bench, 0)
    bench.results["lifecycle"] = out


def report(res: dict, ms) -> list[str]:
    L: list[str] = []
    p = res.get("pool")
    if p:
        L += [f"### Create → first command from the pool (size {p['size']}; {p['from_pool']:.0f} of "
              f"{p['ours']['n']} creates served from it)", "", "| | n | p50 | p95 | max |", "|---|---|---|---|---|"]
        for label, k in [("`Sandbox.create()` + `commands.run('true')`", "ours"),
                         ("  of which `Sandbox.create()`", "ours_create_call"),
                         ("  of which first `commands.run`", "ours_first_cmd")]:
            st = p[k]
            L.append(f"| {label} | {st['n']} | {ms(st['p50'])} | {ms(st['p95'])} | {ms(st['max'])} |")
        L.append("")
        idle = p.get("idle")
        if idle:
            L += [f"The pool's ready sandboxes while they wait, host CPU over {idle['seconds']:.0f} s (their cgroups):", "",
                  "| ready sandboxes | n | CPU p50 | CPU max | create + first command from them: n | p50 | p95 |",
                  "|---|---|---|---|---|---|---|"]
            for label, k in [("frozen in the cgroup freezer (`pool_freeze`, default)", "frozen"),
                             ("left running (`AGENTENV_POOL_FREEZE=false`)", "running")]:
                st, c = idle[k]["cpu_ms_per_s"], idle[k]["create_first_cmd"]
                L.append(f"| {label} | {st['n']} | {st['p50']:.1f} ms/s | {st['max']:.1f} ms/s | {c['n']} | "
                         f"{ms(c['p50'])} | {ms(c['p95'])} |")
            L.append("")
    lc = res.get("lifecycle")
    if lc:
        L += [f"### Lifecycle throughput (create → `commands.run('true')` → kill, {lc['seconds']} s per run, "
              f"{lc['cores']} cores)", "",
              "| run | clients | cycles | per second | per second per core | vs raw | machine CPU a cycle | "
              "p50 cycle | p95 cycle | errors |",
              "|---|---|---|---|---|---|---|---|---|---|"]
        for k, r in lc.items():
            if not k.startswith(("pool", "raw_")):
                continue
            raw = lc.get(f"raw_c{r['clients']}")
            label = "**raw** (bare runsc, envd image)" if k.startswith("raw_") else f"agentenv, pool {k[4:].split('_')[0]}"
            vs = f"{r['per_s'] / raw['per_s']:.2f}×" if raw and raw["per_s"] and not k.startswith("raw_") else ""
            cpu = r.get("cpu_ms_per_cycle")
            L.append(f"| {label} | {r['clients']} | {r['cycles']} | {r['per_s']:.2f} | {r['per_s_per_core']:.2f} | {vs} | "
                     f"{'%.0f ms' % cpu if cpu else '–'} | {ms(r['latency']['p50'])} | {ms(r['latency']['p95'])} | "
                     f"{len(r['errors'])} |")
        L.append("")
        if any(k.startswith("raw_") for k in lc):
            L += ["The raw cycle: overlay + slot, `runsc restore` of a container running envd, its first `/health`, "
                  "one `bash -l -c true` through envd's process API, `runsc delete`, slot and overlay released "
                  "(`Raw.lifecycle`). Machine CPU a cycle: all of the machine's CPU over the run (the SDK clients "
                  "and the benchmark included) divided by the cycles.", ""]
    return L
